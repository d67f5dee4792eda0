"""Per-token request metadata, the one home of "which request owns token t".

Used by the public :func:`jax_mla.req_id_per_token`, the dense-decode conventions
(AITER ``qo_indptr``, tpu-inference ``cu_q_lens``) and the index references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_requests(cu: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
  """Request of each of ``num_tokens`` tokens for non-decreasing offsets ``cu`` ``[R+1]``.

  Returns ``(req i32[num_tokens], ok bool[num_tokens])``: token ``t`` belongs to
  request ``r`` when ``cu[r] <= t < cu[r+1]``; tokens outside ``[cu[0], cu[-1])``
  have ``ok = False`` and ``req = 0``.
  """
  cu = cu.astype(jnp.int32)
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  req = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
  ok = (t >= cu[0]) & (t < cu[-1])
  num_req = cu.shape[0] - 1
  return jnp.where(ok, jnp.minimum(req, num_req - 1), 0), ok


def block_table_checks(block_table: jax.Array, seq_lens: jax.Array, *, block_size: int,
                       num_blocks: int, table_name: str = "block_table",
                       lens_name: str = "seq_lens"):
  """``checks=True`` conditions (for :func:`jax_mla._common.check_values`) of a block
  table ``[S, max_blocks]`` and its lengths ``[S]``: lengths in ``[0, max_blocks *
  block_size]``, and the block ids each length uses inside ``[0, num_blocks)`` (ids past
  the sequence are never read and may be anything)."""
  max_blocks = block_table.shape[1]
  capacity = max_blocks * block_size
  blocks = (jnp.clip(seq_lens, 0, capacity) + block_size - 1) // block_size
  used = jnp.arange(max_blocks)[None, :] < blocks[:, None]
  ids_ok = ~used | ((block_table >= 0) & (block_table < num_blocks))
  return ((seq_lens >= 0, f"{lens_name} must be >= 0"),
          (seq_lens <= capacity,
           f"{lens_name} must be <= {table_name}.shape[1] * block_size = {capacity}"),
          (ids_ok, f"{table_name} ids used by {lens_name} must lie in [0, {num_blocks})"))


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
