"""Index plumbing shared by the sparse MLA reference and kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def valid_slots(indices: jax.Array, lengths: jax.Array | None, num_slots: int) -> jax.Array:
  """Boolean mask of usable indices: in ``[0, num_slots)`` and at a position ``< lengths``.

  ``indices[..., topk]``; ``lengths`` broadcasts against ``indices.shape[:-1]``.
  """
  valid = (indices >= 0) & (indices < num_slots)
  if lengths is not None:
    pos = jnp.arange(indices.shape[-1], dtype=jnp.int32)
    valid &= pos < jnp.asarray(lengths)[..., None]
  return valid


def token_lengths(indices: jax.Array, topk_length: jax.Array | None) -> jax.Array:
  """int32 ``[T]`` usable entries of each row of ``indices[T, topk]``: ``topk_length``,
  or the whole ``topk`` when it is None."""
  if topk_length is None:
    return jnp.full(indices.shape[:1], indices.shape[1], jnp.int32)
  return topk_length
