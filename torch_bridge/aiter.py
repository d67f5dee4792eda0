"""The installed AITER MLA decode kernel (ROCm, python module ``aiter``) on jax.Arrays.

``mla_decode`` takes exactly the arguments of ``jax_mla.dense_decode``
(AITER's ``mla_decode_fwd`` convention), so the same metadata, built by
jax_mla's own builders, drives both::

  kv_indices, kv_indptr = jax_mla.indexing.expand_page_indices(
      block_table, seq_lens, kernel_block_size=bs, capacity=cap)
  args = (q, cache.reshape(-1, 1, 576), qo_indptr, kv_indptr, kv_indices, ones)
  out, lse = torch_bridge.aiter.mla_decode(*args, max_seqlen_q=1)
  ref, ref_lse = jax_mla.mla_decode(*args, max_seqlen_q=1)

Untested here: AITER needs a ROCm GPU (MI300/MI350), which this project's
machines do not have.
"""

from __future__ import annotations

import inspect

import jax

from torch_bridge import _external

_HINT = ("Install it on a ROCm machine from https://github.com/ROCm/aiter (git clone "
         "--recursive, then python3 setup.py develop); it needs a ROCm build of torch and an "
         "MI300/MI350-class GPU.")


def mla_decode(q: jax.Array, kv_cache: jax.Array, qo_indptr: jax.Array, kv_indptr: jax.Array,
               kv_indices: jax.Array, kv_last_page_lens: jax.Array, *, max_seqlen_q: int,
               sm_scale: float | None = None, causal: bool = True,
               q_scale: jax.Array | None = None, kv_scale: jax.Array | None = None,
               num_kv_splits: int | None = None) -> tuple[jax.Array, jax.Array]:
  """AITER ``mla_decode_fwd`` with ``jax_mla.dense_decode``'s arguments.

  Args:
    q: ``[T, h_q, 576]`` bf16 (or fp8 with ``q_scale``).
    kv_cache: ``[num_pages, page_size, 576]`` bf16 or fp8 (with ``kv_scale``).
    qo_indptr, kv_indptr: ``[B + 1]`` int32; kv_indices ``[N]`` int32 page ids;
      kv_last_page_lens ``[B]`` int32.
    max_seqlen_q: longest query of the batch.
    causal: AITER's kernel is bottom-right causal; ``False`` is refused.

  Returns:
    ``(out bf16[T, h_q, 512], lse f32[T, h_q])``.

  Raises:
    ImportError: AITER is not installed.
    RuntimeError: the inputs are not on a ROCm GPU.
  """
  if not causal:
    raise ValueError("AITER's mla_decode_fwd is causal only; got causal=False")
  aiter_mla = _external.load("aiter.mla", "AITER", _HINT)
  _external.require_gpu("AITER", "rocm", {
      "q": q, "kv_cache": kv_cache, "qo_indptr": qo_indptr, "kv_indptr": kv_indptr,
      "kv_indices": kv_indices, "kv_last_page_lens": kv_last_page_lens,
      "q_scale": q_scale, "kv_scale": kv_scale})
  import torch

  q_t = _external.to_torch(q)
  kv_t = _external.to_torch(kv_cache)
  page_size = kv_t.shape[1]
  out = torch.empty((q_t.shape[0], q_t.shape[1], 512), dtype=torch.bfloat16, device=q_t.device)
  kwargs = {}
  if "return_lse" in inspect.signature(aiter_mla.mla_decode_fwd).parameters:
    kwargs["return_lse"] = True
  result = aiter_mla.mla_decode_fwd(
      q_t, kv_t.unsqueeze(2), out, _external.to_torch(qo_indptr),
      _external.to_torch(kv_indptr), _external.to_torch(kv_indices),
      _external.to_torch(kv_last_page_lens), max_seqlen_q, page_size=page_size,
      sm_scale=sm_scale, num_kv_splits=num_kv_splits, q_scale=_external.to_torch(q_scale),
      kv_scale=_external.to_torch(kv_scale), **kwargs)
  # AITER returns (logits, lse); with splits, lse is per split [T, splits, h, 1] and
  # the final one is the last element of the tuple when return_lse is honoured.
  lse = result[-1] if isinstance(result, tuple) else result
  return _external.jax_outputs(out, lse.reshape(q_t.shape[0], q_t.shape[1]).float())
