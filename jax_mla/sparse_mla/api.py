"""Public entry points: sparse MLA prefill and decode (FlashMLA semantics)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla._common import (
  Implementation,
  check_dtype,
  check_int32,
  check_one_of,
  check_rank,
  check_shape,
  resolve_implementation,
)
from jax_mla.cache.formats import check_cache, latent_size
from jax_mla.sparse_mla import mosaic
from jax_mla.sparse_mla.decode_pallas import sparse_mla_decode_pallas
from jax_mla.sparse_mla.prefill_pallas import sparse_mla_prefill_pallas
from jax_mla.sparse_mla.reference import sparse_mla_decode_reference, sparse_mla_prefill_reference

D_QKS = (576, 512)
D_V = 512
DECODE_CACHE_DTYPES = ("fp8_ds_mla", "fp8_model1", "auto")
_DECODE_D_QK = {"fp8_ds_mla": 576, "fp8_model1": 512}


def _check_d_v(d_v) -> None:
  if d_v != D_V:
    raise ValueError(f"d_v must be {D_V} (V = the first 512 latent columns); got {d_v!r}")


def _check_sink(attn_sink, h_q: int) -> None:
  if attn_sink is not None:
    check_dtype("attn_sink", attn_sink, jnp.float32)
    check_shape("attn_sink", attn_sink, (h_q,))


def _check_lengths(name: str, lengths, size: int) -> None:
  if lengths is not None:
    check_int32(name, lengths)
    check_shape(name, lengths, (size,))


def _check_decode_indices(name: str, indices, b: int, s_q: int) -> None:
  check_rank(name, indices, 3)
  check_int32(name, indices)
  check_shape(name, indices, (b, s_q, None))
  _check_topk(name, indices)


def _check_topk(name: str, indices) -> None:
  if indices.shape[-1] < 1:
    raise ValueError(f"{name} must have topk >= 1; got shape {list(indices.shape)}")


def _check_scale(sm_scale) -> float:
  if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool):
    raise TypeError(f"sm_scale must be a Python float (static); got {type(sm_scale).__name__}")
  return float(sm_scale)


def sparse_mla_prefill(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float,
                       d_v: int = 512, attn_sink: jax.Array | None = None,
                       topk_length: jax.Array | None = None,
                       implementation: Implementation = None, interpret: bool = False):
  """Sparse attention prefill (FlashMLA ``flash_mla_sparse_fwd``).

  Every query token attends to its own ``topk`` key rows of ``kv``, picked by
  ``indices``; all query heads share the one latent KV head (MLA).

  Args:
    q: ``[s_q, h_q, d_qk]`` bf16; ``d_qk`` 576 (DeepSeek V3.2: 512 NoPE + 64 RoPE) or
      512 (DeepSeek V4). Any ``h_q >= 1``.
    kv: ``[s_kv, d_qk]`` or ``[s_kv, 1, d_qk]`` bf16 latent rows; V is the first
      ``d_v`` columns.
    indices: int32 ``[s_q, topk]`` or ``[s_q, 1, topk]``, rows of ``kv``. Entries
      ``< 0`` or ``>= s_kv`` are invalid: masked, never read.
    sm_scale: softmax scale applied to ``q k^T`` (static float).
    d_v: value width; must be 512.
    attn_sink: optional float32 ``[h_q]``: the output is multiplied by
      ``exp(lse) / (exp(lse) + exp(attn_sink))``; ``lse`` and ``max_logits`` are
      unchanged; ``+inf`` gives a zero output, ``-inf`` has no effect.
    topk_length: optional int32 ``[s_q]``: token ``i`` only uses
      ``indices[i, :topk_length[i]]`` (values are clamped to ``[0, topk]``).
    implementation: ``"pallas"`` (Triton), ``"mosaic"`` (Pallas Mosaic GPU, Hopper,
      ``h_q`` a multiple of 64) or ``"xla"`` (reference). ``None`` picks Mosaic GPU on a
      Hopper GPU for the shapes it takes, else Triton on GPU, else the reference.
    interpret: run the Triton kernel in the Pallas interpreter (CPU tests).

  Returns:
    ``(out, max_logits, lse)``: ``out`` bf16 ``[s_q, h_q, d_v]``; ``max_logits``
    float32 ``[s_q, h_q]``, the largest ``sm_scale * q k^T`` over valid keys; ``lse``
    float32 ``[s_q, h_q]``, natural-log sum-exp of those scores. A row with no valid
    key gets ``out = 0``, ``max_logits = -inf`` and ``lse = +inf``.
  """
  check_rank("q", q, 3)
  check_dtype("q", q, jnp.bfloat16)
  s_q, h_q, d_qk = q.shape
  check_one_of("q.shape[-1] (d_qk)", d_qk, D_QKS)
  check_rank("kv", kv, (2, 3))
  check_dtype("kv", kv, jnp.bfloat16)
  if kv.ndim == 3:
    check_shape("kv", kv, (None, 1, d_qk))
    kv = kv.reshape(kv.shape[0], d_qk)
  check_shape("kv", kv, (None, d_qk))
  check_rank("indices", indices, (2, 3))
  check_int32("indices", indices)
  if indices.ndim == 3:
    check_shape("indices", indices, (s_q, 1, None))
    indices = indices.reshape(s_q, indices.shape[-1])
  check_shape("indices", indices, (s_q, None))
  _check_topk("indices", indices)
  _check_d_v(d_v)
  _check_sink(attn_sink, h_q)
  _check_lengths("topk_length", topk_length, s_q)
  return _prefill(q, kv, indices, attn_sink, topk_length, sm_scale=_check_scale(sm_scale),
                  d_v=d_v, impl=_implementation(q, implementation, interpret),
                  interpret=interpret)


def _implementation(q, implementation: Implementation, interpret: bool) -> str:
  """The kernel to run: Mosaic GPU by default on Hopper for the head counts it takes."""
  if implementation == "mosaic":
    mosaic.check_supported(q)
  impl = resolve_implementation(implementation, interpret, has_mosaic=True)
  if implementation is None and not interpret and mosaic.default_for(q):
    return "mosaic"
  return impl


@functools.partial(jax.jit, static_argnames=("sm_scale", "d_v", "impl", "interpret"))
def _prefill(q, kv, indices, attn_sink, topk_length, *, sm_scale, d_v, impl, interpret):
  if impl == "xla":
    return sparse_mla_prefill_reference(q, kv, indices, attn_sink, topk_length,
                                        sm_scale=sm_scale, d_v=d_v)
  if impl == "mosaic":
    return mosaic.sparse_prefill(q, kv, indices, attn_sink, topk_length, sm_scale=sm_scale)
  return sparse_mla_prefill_pallas(q, kv, indices, attn_sink, topk_length, sm_scale=sm_scale,
                                   d_v=d_v, interpret=interpret)


def sparse_mla_decode(q: jax.Array, kv_cache: jax.Array, indices: jax.Array, *,
                      kv_cache_dtype: str = "fp8_ds_mla", sm_scale: float | None = None,
                      d_v: int = 512, attn_sink: jax.Array | None = None,
                      topk_length: jax.Array | None = None,
                      extra_kv_cache: jax.Array | None = None,
                      extra_indices: jax.Array | None = None,
                      extra_topk_length: jax.Array | None = None,
                      implementation: Implementation = None, interpret: bool = False):
  """Sparse attention decode on a paged latent cache (FlashMLA ``flash_mla_with_kvcache``
  with ``indices``).

  Args:
    q: ``[b, s_q, h_q, d_qk]`` bf16; ``d_qk`` 576 for ``"fp8_ds_mla"``, 512 for
      ``"fp8_model1"``, the cache width for ``"auto"``.
    kv_cache: ``[num_blocks, block_size, *]`` cache in format ``kv_cache_dtype``
      (see ``jax_mla.cache``). fp8 rows are dequantized inside the kernel.
    indices: int32 ``[b, s_q, topk]`` global slots ``block * block_size + offset``
      (no block table). Slots ``< 0`` or ``>= num_blocks * block_size`` are invalid:
      masked, never read.
    kv_cache_dtype: ``"fp8_ds_mla"`` (V3.2), ``"fp8_model1"`` (V4) or ``"auto"`` (bf16).
    sm_scale: softmax scale; ``None`` means ``d_qk ** -0.5``.
    d_v: value width; must be 512 (V = the first 512 latent columns).
    attn_sink: optional float32 ``[h_q]``; output times ``exp(lse) / (exp(lse) +
      exp(attn_sink))``, ``lse`` unchanged.
    topk_length: optional int32 ``[b]``: batch ``i`` only uses ``indices[i, :, :topk_length[i]]``.
    extra_kv_cache, extra_indices, extra_topk_length: an optional second key set
      (same format, its own block size, ``extra_indices[b, s_q, extra_topk]``,
      ``extra_topk_length[b]``) attended in the same softmax as the main one
      (DeepSeek V4: sliding window + compressed cache).
    implementation: ``"pallas"`` (Triton), ``"mosaic"`` (Pallas Mosaic GPU, Hopper,
      ``h_q`` a multiple of 64) or ``"xla"`` (reference). ``None`` picks Mosaic GPU on
      a Hopper GPU for the head counts it takes, else Triton on GPU, else the reference.
    interpret: run the Triton kernel in the Pallas interpreter (CPU tests).

  Returns:
    ``(out, lse)``: ``out`` bf16 ``[b, s_q, h_q, d_v]``; ``lse`` float32
    ``[b, h_q, s_q]`` natural log over both key sets, ``+inf`` (and ``out = 0``) for a
    query with no valid key.
  """
  check_one_of("kv_cache_dtype", kv_cache_dtype, DECODE_CACHE_DTYPES)
  check_rank("q", q, 4)
  check_dtype("q", q, jnp.bfloat16)
  b, s_q, h_q, d_qk = q.shape
  check_cache(kv_cache, kv_cache_dtype)
  if kv_cache_dtype == "auto":
    check_dtype("kv_cache", kv_cache, jnp.bfloat16)
  want_d = _DECODE_D_QK.get(kv_cache_dtype, latent_size(kv_cache, kv_cache_dtype))
  if d_qk != want_d or d_qk not in D_QKS:
    raise ValueError(f"q.shape[-1] must be {want_d} for kv_cache_dtype={kv_cache_dtype!r} "
                     f"(576 or 512); got {d_qk}")
  _check_decode_indices("indices", indices, b, s_q)
  _check_lengths("topk_length", topk_length, b)
  has_extra = extra_kv_cache is not None
  if has_extra != (extra_indices is not None):
    raise ValueError("extra_kv_cache and extra_indices must be given together")
  if extra_topk_length is not None and not has_extra:
    raise ValueError("extra_topk_length needs extra_kv_cache and extra_indices")
  if has_extra:
    check_cache(extra_kv_cache, kv_cache_dtype, name="extra_kv_cache")
    check_dtype("extra_kv_cache", extra_kv_cache, kv_cache.dtype)
    if kv_cache_dtype == "auto":
      check_shape("extra_kv_cache", extra_kv_cache, (None, None, d_qk))
    _check_decode_indices("extra_indices", extra_indices, b, s_q)
    _check_lengths("extra_topk_length", extra_topk_length, b)
  _check_d_v(d_v)
  _check_sink(attn_sink, h_q)
  scale = d_qk ** -0.5 if sm_scale is None else _check_scale(sm_scale)
  return _decode(q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices,
                 extra_topk_length, attn_sink, kv_cache_dtype=kv_cache_dtype, sm_scale=scale,
                 d_v=d_v, impl=_implementation(q, implementation, interpret),
                 interpret=interpret)


@functools.partial(jax.jit, static_argnames=("kv_cache_dtype", "sm_scale", "d_v", "impl",
                                             "interpret"))
def _decode(q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices, extra_topk_length,
            attn_sink, *, kv_cache_dtype, sm_scale, d_v, impl, interpret):
  b, s_q, h_q, d_qk = q.shape
  tokens = b * s_q

  def flat_set(cache, idx, lengths):
    # Per-batch lengths apply to each of the batch's s_q query tokens.
    lengths = (jnp.full((tokens,), idx.shape[-1], jnp.int32) if lengths is None
               else jnp.repeat(lengths, s_q))
    return cache, idx.reshape(tokens, idx.shape[-1]), lengths

  sets = [flat_set(kv_cache, indices, topk_length)]
  if extra_kv_cache is not None:
    sets.append(flat_set(extra_kv_cache, extra_indices, extra_topk_length))
  qf = q.reshape(tokens, h_q, d_qk)
  if impl == "xla":
    out, _, lse = sparse_mla_decode_reference(qf, sets, attn_sink, kv_cache_dtype=kv_cache_dtype,
                                              sm_scale=sm_scale, d_v=d_v)
  elif impl == "mosaic":
    out, _, lse = mosaic.sparse_decode(qf, sets, attn_sink, kv_cache_dtype=kv_cache_dtype,
                                       sm_scale=sm_scale)
  else:
    out, _, lse = sparse_mla_decode_pallas(qf, sets, attn_sink, kv_cache_dtype=kv_cache_dtype,
                                           sm_scale=sm_scale, d_v=d_v, interpret=interpret)
  return out.reshape(b, s_q, h_q, d_v), lse.reshape(b, s_q, h_q).transpose(0, 2, 1)
