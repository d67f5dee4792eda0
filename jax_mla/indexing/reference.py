"""jax.numpy references for the index and metadata helpers (the oracles)."""

from __future__ import annotations

import jax.numpy as jnp


def convert_req_index_to_global_index(req_id, block_table, token_indices, *, block_size):
  """Request-local token indices -> global cache slots ``block*block_size + offset``.

  ``-1`` where the token index is negative, its block lies past the table or the
  request id is out of range (the table is never read there).
  """
  num_reqs, num_blocks = block_table.shape
  tok = token_indices
  block = tok // block_size
  req = req_id.reshape(req_id.shape + (1,) * (tok.ndim - 1))
  valid = (tok >= 0) & (block < num_blocks) & (req >= 0) & (req < num_reqs)
  base = block_table[jnp.where(valid, req, 0), jnp.where(valid, block, 0)]
  return jnp.where(valid, base * block_size + tok % block_size, -1).astype(jnp.int32)


def expand_page_indices(block_table, seq_lens, *, kernel_block_size, capacity):
  """Per-token flat page indices for a page-size-1 view of a paged cache.

  Token ``t`` of request ``r`` lands at ``indptr[r] + t`` with value
  ``block_table[r, t // K] * K + t % K``; positions past the total (and tokens
  whose block lies past the table) hold ``-1``.
  """
  num_reqs, num_blocks = block_table.shape
  indptr = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_lens.astype(jnp.int32))]).astype(jnp.int32)
  pos = jnp.arange(capacity, dtype=jnp.int32)
  req = jnp.clip(jnp.searchsorted(indptr, pos, side="right") - 1, 0, num_reqs - 1)
  tok = pos - indptr[req]
  block = tok // kernel_block_size
  valid = (pos < indptr[-1]) & (block < num_blocks)
  base = block_table[req, jnp.where(valid, block, 0)]
  pages = jnp.where(valid, base * kernel_block_size + tok % kernel_block_size, -1)
  return pages.astype(jnp.int32), indptr


def req_id_per_token(query_start_loc, *, num_tokens):
  """Request id of each of ``num_tokens`` tokens; padding tokens past the last request get 0."""
  num_reqs = query_start_loc.shape[0] - 1
  pos = jnp.arange(num_tokens, dtype=jnp.int32)
  req = jnp.searchsorted(query_start_loc.astype(jnp.int32), pos, side="right") - 1
  valid = (pos < query_start_loc[-1]) & (req >= 0) & (req < num_reqs)
  return jnp.where(valid, req, 0).astype(jnp.int32)


def filter_prefill_indices(indices, prefill_context_lengths):
  """Splits top-k indices into cached-context and new-token parts (vLLM's FlashMLASparse).

  Returns ``(context_indices, new_token_indices)``: an index below the row's
  context length stays in the first (``-1`` in the second); one at or above it
  moves to the second, shifted down by the context length.
  """
  ctx = prefill_context_lengths.reshape(
      prefill_context_lengths.shape + (1,) * (indices.ndim - prefill_context_lengths.ndim))
  context = jnp.where(indices < ctx, indices, -1)
  new = jnp.where(indices >= ctx, indices - ctx, -1)
  return context.astype(indices.dtype), new.astype(indices.dtype)


__all__ = [
    "convert_req_index_to_global_index", "expand_page_indices", "filter_prefill_indices",
    "req_id_per_token",
]
