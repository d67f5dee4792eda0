"""How each dense-decode convention's metadata maps tokens to requests, pages and keys.

Shared by the kernels' wrappers (:mod:`jax_mla.dense_decode.api`) and the
references (:mod:`jax_mla.dense_decode.reference`), so both read the conventions
the same way. The kernels take *query groups* (``i32[5, G]`` rows ``q_start, q_len,
kv_len, causal_base, page_base``; see :mod:`jax_mla.dense_decode.triton`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_mla._common import D_QK, cdiv
from jax_mla.indexing.metadata import token_requests


def aiter_seq_lens(kv_indptr, kv_last_page_lens, page_size):
  """Keys per request in AITER's page-level ``kv_indptr`` convention."""
  num_pages = kv_indptr[1:] - kv_indptr[:-1]
  if page_size == 1:  # AITER ignores last-page lengths for a flat cache
    return jnp.maximum(num_pages, 0)
  return jnp.clip((num_pages - 1) * page_size + kv_last_page_lens, 0, num_pages * page_size)


def causal_num_keys(seq_len, q_len, q_idx, causal):
  """Keys visible to query ``q_idx`` of ``q_len`` (bottom-right causal alignment)."""
  if not causal:
    return seq_len
  return jnp.clip(seq_len - (q_len - 1 - q_idx), 0, seq_len)


def aiter_groups(qo_indptr, kv_indptr, kv_last_page_lens, *, page_size):
  """Query groups (one per request) for AITER's ``mla_decode_fwd`` convention."""
  seq_lens = aiter_seq_lens(kv_indptr, kv_last_page_lens, page_size)
  q_len = qo_indptr[1:] - qo_indptr[:-1]
  return jnp.stack([qo_indptr[:-1], q_len, seq_lens, seq_lens - q_len, kv_indptr[:-1]])


def aiter_computed_tokens(qo_indptr, num_tokens, max_seqlen_q):
  """Tokens the AITER convention computes: inside a request and within ``max_seqlen_q``."""
  req, ok = token_requests(qo_indptr, num_tokens)
  return ok & (jnp.arange(num_tokens) - qo_indptr[:-1][req] < max_seqlen_q)


def paged_groups(block_table, cache_seqlens, *, s_q, page_size):
  """Query groups (one per request) for FlashMLA's block-table convention."""
  b, max_blocks = block_table.shape
  seq = jnp.clip(cache_seqlens, 0, max_blocks * page_size)
  req = jnp.arange(b, dtype=jnp.int32)
  return jnp.stack([req * s_q, jnp.full((b,), s_q, jnp.int32), seq, seq - s_q,
                    req * max_blocks])


def live_cu_q_lens(cu_q_lens, distribution):
  """tpu-inference's ``cu_q_lens`` with the entries past the ``distribution[2]`` live
  sequences held at the last live offset (those sequences have no queries)."""
  num_seqs = distribution[2]
  idx = jnp.arange(cu_q_lens.shape[0], dtype=jnp.int32)
  return jnp.where(idx <= num_seqs, cu_q_lens, cu_q_lens[num_seqs])


def ragged_token_layout(cu_q_lens, distribution, num_tokens):
  """Per token: sequence id, whether it is live, its index within its sequence, and
  :func:`live_cu_q_lens` (tpu-inference convention).

  Sequences ``>= distribution[2]`` are unused; tokens past their queries are padding.
  """
  cu = live_cu_q_lens(cu_q_lens, distribution)
  seq, ok = token_requests(cu, num_tokens)
  q_idx = jnp.arange(num_tokens, dtype=jnp.int32) - cu[seq]
  return seq, ok, q_idx, cu


def ragged_groups(cu_q_lens, kv_lens, distribution, *, tokens_per_group, num_tokens,
                  pages_per_seq, page_size):
  """Query groups for tpu-inference's ragged convention: each live sequence's queries
  in groups of ``tokens_per_group`` tokens.

  ``G = max_num_seqs + ceil(T / tokens_per_group)`` (a static bound); unused groups
  have ``q_len = 0``.
  """
  num_seqs_max = kv_lens.shape[0]
  num_groups = num_seqs_max + cdiv(num_tokens, tokens_per_group)
  cu = live_cu_q_lens(cu_q_lens, distribution)
  q_lens = cu[1:] - cu[:-1]
  chunks = (q_lens + tokens_per_group - 1) // tokens_per_group
  chunk_end = jnp.cumsum(chunks)
  g = jnp.arange(num_groups, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(chunk_end, g, side="right"), num_seqs_max - 1)
  c = g - (chunk_end - chunks)[seq]
  live = g < chunk_end[-1]
  first = c * tokens_per_group
  q_len = jnp.where(live, jnp.minimum(tokens_per_group, q_lens[seq] - first), 0)
  kv_len = jnp.minimum(kv_lens, pages_per_seq * page_size)[seq]
  causal_base = kv_len - q_lens[seq] + first
  return jnp.stack([cu[seq] + first, q_len, kv_len, causal_base, seq * pages_per_seq])


def update_kv_cache(new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens,
                    distribution):
  """Writes each live token's latent into its slot (tpu-inference ``update_kv_cache``).

  Token ``j`` of sequence ``i`` (``q_len`` new tokens) is key position
  ``kv_lens[i] - q_len + j``, in page ``page_indices[i*pages_per_seq + pos//page_size]``.
  Padding tokens and out-of-range pages are dropped.
  """
  num_pages, page_size, _ = cache_kv.shape
  num_tokens = new_kv_c.shape[0]
  pages_per_seq = page_indices.shape[0] // kv_lens.shape[0]
  seq, ok, q_idx, cu = ragged_token_layout(cu_q_lens, distribution, num_tokens)
  q_len = (cu[1:] - cu[:-1])[seq]
  pos = kv_lens[seq] - q_len + q_idx
  blk = pos // page_size
  ok &= (pos >= 0) & (blk < pages_per_seq)
  page = page_indices[jnp.where(ok, seq * pages_per_seq + blk, 0)]
  ok &= (page >= 0) & (page < num_pages)
  slot = jnp.where(ok, page * page_size + pos % page_size, num_pages * page_size)
  new = jnp.concatenate([new_kv_c, new_k_pe], axis=-1).astype(cache_kv.dtype)
  flat = cache_kv.reshape(num_pages * page_size, D_QK).at[slot].set(new, mode="drop")
  return flat.reshape(cache_kv.shape)
