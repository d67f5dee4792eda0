"""Pure jax.numpy references for dense MLA decode (the oracle for the kernel).

Every convention reduces to one dense computation per query token: the token's
page list, how many of its request's keys it may see, and a softmax over those
keys of the latent cache (``[kv_c(512) | k_pe(64)]``, V = the first 512).
Memory is ``O(T * max_keys * 576)``: meant for tests and small batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mla._common import D_NOPE, D_QK
from jax_mla.dense_decode.metadata import (
  aiter_seq_lens,
  causal_num_keys,
  ragged_token_layout,
  update_kv_cache,
)
from jax_mla.indexing.metadata import token_requests


def attend_token_pages(q, kv_cache, token_pages, token_num_keys, *, sm_scale, q_scale=None,
                       k_scale=None, v_scale=None, out_dtype=jnp.bfloat16):
  """Dense attention of each query token over its own paged keys.

  Args:
    q: ``[T, H, 576]`` queries (bf16 or fp8).
    kv_cache: ``[num_pages, page_size, 576]`` latent cache (bf16 or fp8).
    token_pages: ``i32[T, P]``: page id of each token's key block ``t // page_size``.
    token_num_keys: ``i32[T]``: the token sees keys ``0 .. n-1`` (causal limit applied).
    sm_scale, q_scale, k_scale, v_scale: scores are ``q.k * sm_scale * q_scale *
      k_scale``; the output is scaled by ``v_scale`` (per-tensor dequantisation).

  Returns:
    ``(out [T, H, 512] out_dtype, lse f32[T, H])``; rows without keys get 0, ``+inf``.
  """
  num_pages, page_size, _ = kv_cache.shape
  num_keys = token_pages.shape[1] * page_size
  t = jnp.arange(num_keys, dtype=jnp.int32)
  page = token_pages[:, t // page_size]  # [T, K]
  ok = (t[None, :] < token_num_keys[:, None]) & (page >= 0) & (page < num_pages)
  slot = jnp.where(ok, page * page_size + t[None, :] % page_size, 0)
  kv = kv_cache.reshape(-1, D_QK)[slot].astype(jnp.float32)  # [T, K, 576]
  kv = jnp.where(ok[..., None], kv, 0.0)  # unused slots may hold NaN
  qs = 1.0 if q_scale is None else jnp.asarray(q_scale, jnp.float32).reshape(())
  ks = 1.0 if k_scale is None else jnp.asarray(k_scale, jnp.float32).reshape(())
  vs = 1.0 if v_scale is None else jnp.asarray(v_scale, jnp.float32).reshape(())
  s = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), kv,
                 precision=jax.lax.Precision.HIGHEST) * (sm_scale * qs * ks)
  s = jnp.where(ok[:, None, :], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  empty = lse == -jnp.inf
  p = jnp.exp(s - jnp.where(empty, 0.0, lse)[..., None])
  out = jnp.einsum("thk,tkd->thd", p, kv[..., :D_NOPE],
                   precision=jax.lax.Precision.HIGHEST) * vs
  out = jnp.where(empty[..., None], 0.0, out)
  return out.astype(out_dtype), jnp.where(empty, jnp.inf, lse)


def mla_decode_reference(q, kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, *,
                         sm_scale, causal=True, q_scale=None, kv_scale=None):
  """Reference for :func:`jax_mla.dense_decode` (AITER ``mla_decode_fwd``)."""
  num_tokens = q.shape[0]
  page_size = kv_cache.shape[1]
  seq_lens = aiter_seq_lens(kv_indptr, kv_last_page_lens, page_size)
  req, tok_ok = token_requests(qo_indptr, num_tokens)
  n_idx = kv_indices.shape[0]
  j = jnp.arange(n_idx, dtype=jnp.int32)
  n_pages = (kv_indptr[1:] - kv_indptr[:-1])[req]
  pos = kv_indptr[:-1][req][:, None] + j[None, :]
  pages = jnp.where((j[None, :] < n_pages[:, None]) & (pos >= 0) & (pos < n_idx),
                    kv_indices[jnp.clip(pos, 0, n_idx - 1)], -1)
  q_len = (qo_indptr[1:] - qo_indptr[:-1])[req]
  q_idx = jnp.arange(num_tokens, dtype=jnp.int32) - qo_indptr[:-1][req]
  n_keys = causal_num_keys(seq_lens[req], q_len, q_idx, causal)
  n_keys = jnp.where(tok_ok, n_keys, 0)
  return attend_token_pages(q, kv_cache, pages, n_keys, sm_scale=sm_scale, q_scale=q_scale,
                            k_scale=kv_scale, v_scale=kv_scale, out_dtype=jnp.bfloat16)


def mla_decode_paged_reference(q, kv_cache, block_table, cache_seqlens, *, sm_scale,
                               causal=False):
  """Reference for :func:`jax_mla.mla_decode_paged` (FlashMLA dense decode), token-major:
  ``(out [b, s_q, h_q, 512], lse f32[b, s_q, h_q])``."""
  b, s_q, h_q, _ = q.shape
  max_keys = block_table.shape[1] * kv_cache.shape[1]
  seq = jnp.minimum(cache_seqlens, max_keys)
  q_idx = jnp.tile(jnp.arange(s_q, dtype=jnp.int32), b)
  n_keys = causal_num_keys(jnp.repeat(seq, s_q), s_q, q_idx, causal)
  out, lse = attend_token_pages(q.reshape(b * s_q, h_q, -1), kv_cache,
                                jnp.repeat(block_table, s_q, axis=0), n_keys,
                                sm_scale=sm_scale, out_dtype=q.dtype)
  return out.reshape(b, s_q, h_q, D_NOPE), lse.reshape(b, s_q, h_q)


def mla_ragged_paged_attention_reference(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens,
                                         page_indices, cu_q_lens, distribution, *, sm_scale,
                                         q_scale=None, k_scale=None, v_scale=None):
  """Reference for :func:`jax_mla.mla_ragged_paged_attention` (tpu-inference MLA v1)."""
  cache_kv = update_kv_cache(new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens,
                             distribution)
  num_tokens = ql_nope.shape[0]
  num_seqs_max = kv_lens.shape[0]
  pages_per_seq = page_indices.shape[0] // num_seqs_max
  seq, ok, q_idx, cu = ragged_token_layout(cu_q_lens, distribution, num_tokens)
  q_len = (cu[1:] - cu[:-1])[seq]
  seq_len = jnp.minimum(kv_lens, pages_per_seq * cache_kv.shape[1])[seq]
  n_keys = jnp.where(ok, causal_num_keys(seq_len, q_len, q_idx, True), 0)
  pages = page_indices.reshape(num_seqs_max, pages_per_seq)[seq]
  q = jnp.concatenate([ql_nope, q_pe], axis=-1)
  out, _ = attend_token_pages(q, cache_kv, pages, n_keys, sm_scale=sm_scale, q_scale=q_scale,
                              k_scale=k_scale, v_scale=v_scale, out_dtype=ql_nope.dtype)
  return out, cache_kv
