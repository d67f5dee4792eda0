"""Public entry points: varlen MHA prefill with different q/k and v head sizes.

Inside, LSE is token-major ``[Tq, H]``; :func:`mla_prefill` returns flash-attn's
``[H, Tq]`` (the upstream layout), :func:`mla_prefill_token_major` the internal one
(for callers that merge by :func:`jax_mla.merge.merge_attn_states`, which takes
``out.shape[:-1]``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_mla import _mosaic
from jax_mla._common import (
  Implementation,
  as_int32,
  backend_config,
  check_dtype,
  check_rank,
  check_shape,
  check_static,
  resolve_implementation,
)
from jax_mla.dense_prefill import backward, mosaic, triton, triton_backward
from jax_mla.dense_prefill.reference import mla_prefill_reference
from jax_mla.sharding import OpSharding, shape_of

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def mla_prefill(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                cu_seqlens_k: jax.Array, *, max_seqlen_q: int, max_seqlen_k: int,
                sm_scale: float | None, causal: bool = True, return_lse: bool = False,
                config: triton.Config | mosaic.Config | None = None,
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
    cu_seqlens_q: ``[B + 1]`` integer query offsets of each sequence (non-decreasing;
      any integer dtype, cast to int32).
    cu_seqlens_k: ``[B + 1]`` integer key offsets; ``Tq`` and ``Tk`` may differ.
    max_seqlen_q: static, at least the longest query length (as in flash-attn).
    max_seqlen_k: static, at least the longest key length.
    sm_scale: static softmax scale (a Python number); ``None`` means ``1 / sqrt(d_qk)``.
    causal: bottom-right aligned causal mask (flash-attn >= 2.1): query ``i`` of a
      sequence sees key ``j`` iff ``j <= i + len_k - len_q``.
    return_lse: also return the softmax LSE.
    config: ``None`` (the tuned defaults), a :class:`jax_mla.dense_prefill.triton.Config`
      (Triton) or a :class:`jax_mla.dense_prefill.mosaic.Config` (Mosaic GPU), matching
      the implementation that runs.
    implementation: ``None`` (on a Hopper GPU the Mosaic GPU kernel for the inputs it
      takes where it is the faster one: token counts multiples of 8, sequences of 256
      queries or more on average; else Triton on GPU and the reference elsewhere),
      ``"mosaic"`` (Pallas Mosaic GPU: bf16/fp16, ``d_v`` and ``d_qk - d_v`` multiples of
      64 up to 256), ``"triton"`` (old name ``"pallas"``) or ``"xla"`` (the reference).
    interpret: run the Triton kernel in the Pallas interpreter (CPU tests).

  Returns:
    ``out[Tq, H, d_v]`` in ``q.dtype``, or ``(out, lse)`` with ``return_lse``:
    ``lse`` float32 natural log, shape ``[H, Tq]`` (flash-attn's layout, the one
    vLLM's ``merge_attn_states`` consumes; :func:`mla_prefill_token_major` gives
    ``[Tq, H]`` for ``jax_mla.merge.merge_attn_states``, which takes ``out.shape[:-1]``).
    A query with no visible key (empty key range, or ``len_q > len_k`` under the
    causal mask) and any token at or past ``cu_seqlens_q[-1]`` get ``out = 0`` and
    ``lse = +inf``.

  Differentiable (``jax.grad``) in ``q``, ``k`` and ``v`` on every implementation; the
  backward runs on the kernels of the forward's backend (Mosaic GPU or Triton), in
  jax.numpy after the reference (docs/api.md, section 9).
  """
  args, static = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k, sm_scale=sm_scale, causal=causal,
                           config=config, implementation=implementation, interpret=interpret)
  out, lse = _mla_prefill(*args, **static, head_major_lse=True)
  return (out, lse) if return_lse else out


def mla_prefill_token_major(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                            cu_seqlens_k: jax.Array, *, max_seqlen_q: int, max_seqlen_k: int,
                            sm_scale: float | None, causal: bool = True,
                            config: triton.Config | mosaic.Config | None = None,
                            implementation: Implementation = None, interpret: bool = False):
  """:func:`mla_prefill` with ``return_lse=True`` and the LSE token-major:
  ``(out [Tq, H, d_v], lse f32[Tq, H])``, ready for ``jax_mla.merge.merge_attn_states``."""
  args, static = _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k, sm_scale=sm_scale, causal=causal,
                           config=config, implementation=implementation, interpret=interpret)
  return _mla_prefill(*args, **static, head_major_lse=False)


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, sm_scale,
              causal, config, implementation, interpret):
  """Checks the arguments; returns the jitted function's ``(arrays, static kwargs)``."""
  check_rank("q", q, 3)
  check_rank("k", k, 3)
  check_rank("v", v, 3)
  check_dtype("q", q, _FLOAT_DTYPES)
  check_dtype("k", k, q.dtype)
  check_dtype("v", v, q.dtype)
  num_heads, d_qk = q.shape[1], q.shape[2]
  check_shape("k", k, (None, num_heads, d_qk))
  check_shape("v", v, (k.shape[0], num_heads, None))
  cu_seqlens_q = as_int32("cu_seqlens_q", cu_seqlens_q)
  cu_seqlens_k = as_int32("cu_seqlens_k", cu_seqlens_k)
  check_rank("cu_seqlens_q", cu_seqlens_q, 1)
  if cu_seqlens_q.shape[0] < 2:
    raise ValueError(f"cu_seqlens_q must have shape [B + 1] with B >= 1; got {cu_seqlens_q.shape}")
  check_shape("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape)
  for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
    if not isinstance(value, int) or value < 0:
      raise ValueError(f"{name} must be a static int >= 0; got {value!r}")
  if sm_scale is not None:
    check_static("sm_scale", sm_scale, (int, float))
  if implementation == "mosaic":
    mosaic.check_supported(q, v, config if isinstance(config, mosaic.Config) else None)
  impl = resolve_implementation(implementation, interpret, has_mosaic=True, like=q)
  if implementation is None and impl == "triton" and not interpret and _mosaic.default_for(
      mosaic.check_default, q, k, v, cu_seqlens_q.shape[0] - 1):
    impl = "mosaic"
  if impl == "triton":
    triton.split_head_dim(d_qk)
    d_v = v.shape[2]
    if d_v < 16 or d_v & (d_v - 1):
      raise ValueError(f"the Triton kernel needs a power-of-two v head size >= 16; got {d_v}")
  config = backend_config(impl, config, triton=(triton.Config, lambda c: c or triton.Config()),
                          mosaic=(mosaic.Config,
                                  lambda c: c or mosaic.default_config(d_qk, v.shape[2])))
  scale = 1.0 / math.sqrt(d_qk) if sm_scale is None else float(sm_scale)
  return (q, k, v, cu_seqlens_q, cu_seqlens_k), dict(
      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, sm_scale=scale, causal=bool(causal),
      config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "max_seqlen_k", "sm_scale", "causal",
                                             "config", "interpret", "head_major_lse"))
def _mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, sm_scale,
                 causal, config, interpret, head_major_lse):
  statics = (max_seqlen_q, max_seqlen_k, sm_scale, causal, config, interpret)
  out, lse = _differentiable_prefill(statics, q, k, v, cu_seqlens_q, cu_seqlens_k)
  return out, (lse.T if head_major_lse else lse)


def _prefill_forward(statics, q, k, v, cu_seqlens_q, cu_seqlens_k):
  max_seqlen_q, max_seqlen_k, sm_scale, causal, config, interpret = statics
  if config is None:
    return mla_prefill_reference(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 sm_scale=sm_scale, causal=causal)
  if isinstance(config, mosaic.Config):
    return mosaic.mla_prefill_mosaic(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q=max_seqlen_q, sm_scale=sm_scale,
                                     causal=causal, config=config)
  return triton.mla_prefill_triton(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                   max_seqlen_q=max_seqlen_q, sm_scale=sm_scale, causal=causal,
                                   config=config, interpret=interpret)


# The backward from the saved out and lse: XLA (backward.py) after the reference forward,
# the Mosaic GPU kernels (mosaic.py) after the Mosaic GPU forward, else the Triton kernels
# (triton_backward.py).
_differentiable_prefill = jax.custom_vjp(_prefill_forward, nondiff_argnums=(0,))


def _prefill_fwd(statics, q, k, v, cu_seqlens_q, cu_seqlens_k):
  out, lse = _prefill_forward(statics, q, k, v, cu_seqlens_q, cu_seqlens_k)
  return (out, lse), (q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse)


def _prefill_bwd(statics, residuals, cotangents):
  max_seqlen_q, max_seqlen_k, sm_scale, causal, config, interpret = statics
  q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse = residuals
  d_out, d_lse = cotangents
  kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, sm_scale=sm_scale,
            causal=causal)
  if config is None:
    grads = backward.mla_prefill_bwd(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, d_out,
                                     d_lse, **kw)
    return *grads, None, None
  grad_config = mosaic.default_config(q.shape[-1], v.shape[-1], grad=True)
  if isinstance(config, mosaic.Config) and grad_config is not None:
    # After the Mosaic GPU forward, its backward kernels where their SMEM fits.
    grads = mosaic.mla_prefill_bwd_mosaic(
        q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, lse,
        triton_backward.row_term(out, lse, d_out, d_lse), config=grad_config, **kw)
    return *grads, None, None
  grads = triton_backward.mla_prefill_bwd(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, d_out,
                                          d_lse, config=triton_backward.Config(),
                                          interpret=interpret, **kw)
  return *grads, None, None


_differentiable_prefill.defvjp(_prefill_fwd, _prefill_bwd)


# --- sharding: how jax_mla.sharding splits these ops over devices (see OpSharding) ---------

# Ragged metadata (cu_seqlens): requests only stacked. mla_prefill's LSE is [H, Tq].
mla_prefill.sharding = OpSharding(
    heads=dict(q=1, k=1, v=1), head_outs=lambda a: (1, 0) if a["return_lse"] else 1,
    num_heads=shape_of("q", 1))
mla_prefill_token_major.sharding = OpSharding(heads=dict(q=1, k=1, v=1), head_outs=(1, 1),
                                              num_heads=shape_of("q", 1))
