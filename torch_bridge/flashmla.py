"""The installed FlashMLA kernels (CUDA, python module ``flash_mla``) on jax.Arrays.

Each function takes and returns jax.Arrays with exactly the arguments of the
jax_mla op of the same name, so results compare one-to-one with jax_mla::

  out, lse = torch_bridge.flashmla.sparse_mla_decode(q, cache, idx, sm_scale=s)
  ref, ref_lse = jax_mla.sparse_mla.sparse_mla_decode(q, cache, idx, sm_scale=s)

Inputs are shared with torch without a copy (DLPack); FlashMLA runs on torch's
current stream, ordered after JAX's producers and before JAX's consumers.
FlashMLA builds for sm90 (H100/H200) and sm100 only.
"""

from __future__ import annotations

import jax

from torch_bridge import _external

_HINT = ("Build it from https://github.com/deepseek-ai/FlashMLA (git clone --recursive, then "
         "pip install --no-build-isolation .; needs CUDA >= 12.8, an sm90 or sm100 GPU, and "
         "a CUDA build of torch).")


def _flash_mla():
  return _external.load("flash_mla", "FlashMLA", _HINT)


def _cache_view(kv_cache, kv_cache_dtype: str):
  """jax_mla's ``[nb, bs, d]`` cache as FlashMLA's ``[nb, bs, 1, d]`` torch view."""
  t = _external.to_torch(kv_cache)
  if t is None:
    return None
  if kv_cache_dtype == "fp8_model1":
    from jax_mla.cache.model1 import MODEL1
    nb, bs, width = t.shape
    token = MODEL1.token_bytes
    # FlashMLA views each padded block as bs rows of 584 bytes (token data, then
    # scales); only the block stride says where the next block starts.
    return t.as_strided((nb, bs, 1, token), (bs * width, token, token, 1))
  return t.unsqueeze(2)


def sparse_mla_decode(q: jax.Array, kv_cache: jax.Array, indices: jax.Array, *,
                      kv_cache_dtype: str = "fp8_ds_mla", sm_scale: float | None = None,
                      d_v: int = 512, attn_sink: jax.Array | None = None,
                      topk_length: jax.Array | None = None,
                      extra_kv_cache: jax.Array | None = None,
                      extra_indices: jax.Array | None = None,
                      extra_topk_length: jax.Array | None = None,
                      ) -> tuple[jax.Array, jax.Array]:
  """FlashMLA's fp8 sparse decode with ``jax_mla.sparse_mla.sparse_mla_decode``'s arguments.

  ``kv_cache_dtype`` must be ``"fp8_ds_mla"`` (q head 576) or ``"fp8_model1"``
  (q head 512): FlashMLA's sparse decode reads fp8 caches only.

  Returns:
    ``(out bf16[b, s_q, h_q, d_v], lse f32[b, h_q, s_q])``.

  FlashMLA's sm90 kernels take ``topk_length`` and the extra cache only with
  ``"fp8_model1"``; with ``"fp8_ds_mla"`` FlashMLA itself raises (pad short rows
  with ``-1`` indices instead).

  Raises:
    ImportError: FlashMLA is not installed.
    RuntimeError: the inputs are not on a CUDA GPU, or FlashMLA refused them.
    ValueError: ``kv_cache_dtype`` is not an fp8 sparse format.
  """
  if kv_cache_dtype not in ("fp8_ds_mla", "fp8_model1"):
    raise ValueError("FlashMLA's sparse decode reads 'fp8_ds_mla' or 'fp8_model1' caches; got "
                     f"kv_cache_dtype={kv_cache_dtype!r}")
  fm = _flash_mla()
  _external.require_gpu("FlashMLA", "cuda", {
      "q": q, "kv_cache": kv_cache, "indices": indices, "attn_sink": attn_sink,
      "topk_length": topk_length, "extra_kv_cache": extra_kv_cache,
      "extra_indices": extra_indices, "extra_topk_length": extra_topk_length})
  meta, _ = fm.get_mla_metadata()
  out, lse = fm.flash_mla_with_kvcache(
      _external.to_torch(q), _cache_view(kv_cache, kv_cache_dtype), None, None, d_v, meta,
      None, softmax_scale=sm_scale, causal=False, is_fp8_kvcache=True,
      indices=_external.to_torch(indices), attn_sink=_external.to_torch(attn_sink),
      extra_k_cache=_cache_view(extra_kv_cache, kv_cache_dtype),
      extra_indices_in_kvcache=_external.to_torch(extra_indices),
      topk_length=_external.to_torch(topk_length),
      extra_topk_length=_external.to_torch(extra_topk_length))
  return _external.jax_outputs(out, lse)


def mla_decode_paged(q: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                     cache_seqlens: jax.Array, *, sm_scale: float | None = None,
                     causal: bool = False) -> tuple[jax.Array, jax.Array]:
  """FlashMLA's dense bf16 decode with ``jax_mla.dense_decode.mla_decode_paged``'s arguments.

  Args:
    q: ``[b, s_q, h_q, 576]`` bf16.
    kv_cache: ``[num_blocks, block_size, 576]`` bf16 (FlashMLA needs block_size 64).
    block_table: ``[b, max_blocks]`` int32.
    cache_seqlens: ``[b]`` int32.

  Returns:
    ``(out bf16[b, s_q, h_q, 512], lse f32[b, h_q, s_q])``.
  """
  fm = _flash_mla()
  _external.require_gpu("FlashMLA", "cuda", {
      "q": q, "kv_cache": kv_cache, "block_table": block_table,
      "cache_seqlens": cache_seqlens})
  meta, _ = fm.get_mla_metadata()
  out, lse = fm.flash_mla_with_kvcache(
      _external.to_torch(q), _cache_view(kv_cache, "auto"), _external.to_torch(block_table),
      _external.to_torch(cache_seqlens), 512, meta, None, softmax_scale=sm_scale,
      causal=causal)
  return _external.jax_outputs(out, lse)


def sparse_mla_prefill(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float,
                       d_v: int = 512, attn_sink: jax.Array | None = None,
                       topk_length: jax.Array | None = None,
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """FlashMLA's ``flash_mla_sparse_fwd`` with ``jax_mla.sparse_mla.sparse_mla_prefill``'s arguments.

  FlashMLA needs ``h_q`` 64 or 128 (jax_mla pads any ``h_q``).

  Returns:
    ``(out bf16[s_q, h_q, d_v], max_logits f32[s_q, h_q], lse f32[s_q, h_q])``.
  """
  fm = _flash_mla()
  _external.require_gpu("FlashMLA", "cuda", {
      "q": q, "kv": kv, "indices": indices, "attn_sink": attn_sink,
      "topk_length": topk_length})
  kv_t, idx_t = _external.to_torch(kv), _external.to_torch(indices)
  if kv_t.ndim == 2:
    kv_t = kv_t.unsqueeze(1)
  if idx_t.ndim == 2:
    idx_t = idx_t.unsqueeze(1)
  out, max_logits, lse = fm.flash_mla_sparse_fwd(
      _external.to_torch(q), kv_t, idx_t, sm_scale, d_v, _external.to_torch(attn_sink),
      _external.to_torch(topk_length))
  return _external.jax_outputs(out, max_logits, lse)
