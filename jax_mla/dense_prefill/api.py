"""Public entry point: varlen MHA prefill with different q/k and v head sizes."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_mla._common import (
  Implementation,
  check_dtype,
  check_int32,
  check_rank,
  check_shape,
  resolve_implementation,
)
from jax_mla.dense_prefill.kernel import mla_prefill_pallas, split_head_dim
from jax_mla.dense_prefill.reference import mla_prefill_reference

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def mla_prefill(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                cu_seqlens_k: jax.Array, *, max_seqlen_q: int, max_seqlen_k: int,
                sm_scale: float | None, causal: bool = True, return_lse: bool = False,
                implementation: Implementation = None, interpret: bool = False):
  """Varlen multi-head attention whose q/k head size differs from v's (MLA prefill).

  The ``flash_attn_varlen_func`` semantics vLLM's MLA backends rely on
  (``_flash_attn_varlen_diff_headdims``): new-token attention with
  ``causal=True`` and ``cu_seqlens_k == cu_seqlens_q``, and context-chunk
  attention with ``causal=False`` and its own ``cu_seqlens_k``, merged by LSE.

  Args:
    q: ``[Tq, H, d_qk]`` packed queries (bf16, fp16 or fp32); ``d_qk`` is 192 for
      DeepSeek (128 NoPE + 64 RoPE).
    k: ``[Tk, H, d_qk]`` packed keys, same dtype.
    v: ``[Tk, H, d_v]`` packed values (``d_v`` 128 for DeepSeek).
    cu_seqlens_q: int32 ``[B + 1]`` query offsets of each sequence (non-decreasing).
    cu_seqlens_k: int32 ``[B + 1]`` key offsets; ``Tq`` and ``Tk`` may differ.
    max_seqlen_q: static, at least the longest query length (as in flash-attn).
    max_seqlen_k: static, at least the longest key length.
    sm_scale: softmax scale; ``None`` means ``1 / sqrt(d_qk)``.
    causal: bottom-right aligned causal mask (flash-attn >= 2.1): query ``i`` of a
      sequence sees key ``j`` iff ``j <= i + len_k - len_q``.
    return_lse: also return the softmax LSE.
    implementation: ``None`` (Pallas on GPU), ``"pallas"`` or ``"xla"`` (reference).
    interpret: run the Pallas kernel in the interpreter (CPU tests).

  Returns:
    ``out[Tq, H, d_v]`` in ``q.dtype``, or ``(out, lse)`` with ``return_lse``:
    ``lse`` float32 natural log, shape ``[H, Tq]`` (flash-attn's layout, the one
    vLLM's ``merge_attn_states`` consumes; transpose it for
    ``jax_mla.merge.merge_attn_states``, which takes ``out.shape[:-1]``). A query
    with no visible key (empty key range, or ``len_q > len_k`` under the causal
    mask) and any token at or past ``cu_seqlens_q[-1]`` get ``out = 0`` and
    ``lse = +inf``.
  """
  check_rank("q", q, 3)
  check_rank("k", k, 3)
  check_rank("v", v, 3)
  check_dtype("q", q, _FLOAT_DTYPES)
  check_dtype("k", k, q.dtype)
  check_dtype("v", v, q.dtype)
  num_heads, d_qk = q.shape[1], q.shape[2]
  check_shape("k", k, (None, num_heads, d_qk))
  check_shape("v", v, (k.shape[0], num_heads, None))
  check_rank("cu_seqlens_q", cu_seqlens_q, 1)
  check_int32("cu_seqlens_q", cu_seqlens_q)
  check_int32("cu_seqlens_k", cu_seqlens_k)
  if cu_seqlens_q.shape[0] < 2:
    raise ValueError(f"cu_seqlens_q must have shape [B + 1] with B >= 1; got {cu_seqlens_q.shape}")
  check_shape("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape)
  for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
    if not isinstance(value, int) or value < 0:
      raise ValueError(f"{name} must be a static int >= 0; got {value!r}")
  impl = resolve_implementation(implementation, interpret)
  if impl == "triton":
    split_head_dim(d_qk)
    d_v = v.shape[2]
    if d_v < 16 or d_v & (d_v - 1):
      raise ValueError(f"the Pallas kernel needs a power-of-two v head size >= 16; got {d_v}")
  scale = 1.0 / math.sqrt(d_qk) if sm_scale is None else float(sm_scale)
  out, lse = _mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, sm_scale=scale, causal=bool(causal),
                          impl=impl, interpret=interpret)
  return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "max_seqlen_k", "sm_scale", "causal",
                                             "impl", "interpret"))
def _mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, sm_scale,
                 causal, impl, interpret):
  if impl == "xla":
    return mla_prefill_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                 max_seqlen_k=max_seqlen_k, sm_scale=sm_scale, causal=causal)
  return mla_prefill_pallas(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                            sm_scale=sm_scale, causal=causal, interpret=interpret)
