"""jax.numpy references for the index kernels of :mod:`jax_mla.indexing.triton` (the oracles)."""

from __future__ import annotations

import jax.numpy as jnp

from jax_mla.indexing.metadata import token_requests


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
  num_blocks = block_table.shape[1]
  indptr = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_lens.astype(jnp.int32))]).astype(jnp.int32)
  req, valid = token_requests(indptr, capacity)
  tok = jnp.arange(capacity, dtype=jnp.int32) - indptr[req]
  block = tok // kernel_block_size
  valid &= block < num_blocks
  base = block_table[req, jnp.where(valid, block, 0)]
  pages = jnp.where(valid, base * kernel_block_size + tok % kernel_block_size, -1)
  return pages.astype(jnp.int32), indptr


__all__ = ["convert_req_index_to_global_index", "expand_page_indices"]
