"""Public entry points for index conversion and metadata helpers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import _common as c
from jax_mla.indexing import pallas as _pallas
from jax_mla.indexing import reference as _ref


@functools.partial(jax.jit, static_argnames=("block_size", "implementation", "interpret"))
def convert_req_index_to_global_index(req_id: jax.Array, block_table: jax.Array,
                                      token_indices: jax.Array, *, block_size: int = 64,
                                      implementation: c.Implementation = None,
                                      interpret: bool = False) -> jax.Array:
  """Maps per-request top-k token indices to global KV-cache slots (vLLM FlashMLASparse).

  ``out[t, k] = block_table[req_id[t], tok // block_size] * block_size + tok % block_size``
  with ``tok = token_indices[t, k]``; ``-1`` where ``tok < 0``, where the block lies
  past the table, or where ``req_id[t]`` is not a row of the table.

  Args:
    req_id: int32 ``[T]``, the request of each query token.
    block_table: int32 ``[R, B]``, physical block ids of each request.
    token_indices: int32 ``[T, K]``, request-local token positions (``-1`` = none).
    block_size: tokens per cache block (static).
    implementation: ``"pallas"``, ``"xla"`` or ``None`` (Pallas on GPU).
    interpret: run the Pallas kernel in the interpreter.

  Returns:
    int32 ``[T, K]`` global slots.
  """
  c.check_rank("req_id", req_id, 1)
  c.check_rank("block_table", block_table, 2)
  c.check_rank("token_indices", token_indices, 2)
  for name, x in (("req_id", req_id), ("block_table", block_table),
                  ("token_indices", token_indices)):
    c.check_int32(name, x)
  c.check_shape("token_indices", token_indices, (req_id.shape[0], None))
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1; got {block_size}")
  if token_indices.size == 0:
    return jnp.full(token_indices.shape, -1, jnp.int32)
  if c.resolve_implementation(implementation, interpret) == "xla":
    return _ref.convert_req_index_to_global_index(
        req_id, block_table, token_indices, block_size=block_size)
  return _pallas.convert_req_index_to_global_index(
      req_id, block_table, token_indices, block_size=block_size, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("kernel_block_size", "capacity", "implementation",
                                             "interpret"))
def expand_page_indices(block_table: jax.Array, seq_lens: jax.Array, *, kernel_block_size: int,
                        capacity: int, implementation: c.Implementation = None,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Expands a block table into per-token flat page indices (vLLM AiterMLA, page size 1 view).

  ``indptr = [0, cumsum(seq_lens)]``; token ``t`` of request ``r`` goes to
  ``page_indices[indptr[r] + t] = block_table[r, t // K] * K + t % K`` with
  ``K = kernel_block_size``. Unused tail entries, and tokens whose block lies past
  the table, hold ``-1``; tokens past ``capacity`` are dropped.

  Args:
    block_table: int32 ``[R, B]``.
    seq_lens: int32 ``[R]``, tokens per request (>= 0).
    kernel_block_size: tokens per block-table entry (static).
    capacity: length of the output (static), at least the total token count.

  Returns:
    ``(page_indices int32[capacity], indptr int32[R + 1])``.
  """
  c.check_rank("block_table", block_table, 2)
  c.check_rank("seq_lens", seq_lens, 1)
  c.check_int32("block_table", block_table)
  c.check_int32("seq_lens", seq_lens)
  c.check_shape("seq_lens", seq_lens, (block_table.shape[0],))
  if kernel_block_size < 1:
    raise ValueError(f"kernel_block_size must be >= 1; got {kernel_block_size}")
  if capacity < 0:
    raise ValueError(f"capacity must be >= 0; got {capacity}")
  if block_table.shape[0] == 0 or capacity == 0:
    return (jnp.full((capacity,), -1, jnp.int32),
            jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_lens)]).astype(jnp.int32))
  if c.resolve_implementation(implementation, interpret) == "xla":
    return _ref.expand_page_indices(
        block_table, seq_lens, kernel_block_size=kernel_block_size, capacity=capacity)
  return _pallas.expand_page_indices(
      block_table, seq_lens, kernel_block_size=kernel_block_size, capacity=capacity,
      interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def req_id_per_token(query_start_loc: jax.Array, *, num_tokens: int) -> jax.Array:
  """Request id of each token from ``query_start_loc`` (int32 ``[R + 1]``).

  Tokens at or past ``query_start_loc[-1]`` (batch padding) get 0.
  """
  c.check_rank("query_start_loc", query_start_loc, 1)
  c.check_int32("query_start_loc", query_start_loc)
  if query_start_loc.shape[0] < 1:
    raise ValueError("query_start_loc must have at least one entry (R + 1 with R >= 0)")
  if num_tokens < 0:
    raise ValueError(f"num_tokens must be >= 0; got {num_tokens}")
  return _ref.req_id_per_token(query_start_loc, num_tokens=num_tokens)


@jax.jit
def filter_prefill_indices(indices: jax.Array,
                           prefill_context_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits prefill top-k indices into cached-context and new-token indices.

  As vLLM's ``FlashMLASparseDecodeAndContextMetadata.filter_prefill_indices``:
  with ``ctx = prefill_context_lengths[t]``, index ``i`` of row ``t`` stays in
  ``context_indices`` when ``i < ctx`` (``-1`` in ``new_token_indices``), else it
  goes to ``new_token_indices`` as ``i - ctx`` (``-1`` in ``context_indices``).

  Args:
    indices: int32 ``[T, ...]`` top-k indices.
    prefill_context_lengths: int32 ``[T]``.
  """
  c.check_int32("indices", indices)
  c.check_int32("prefill_context_lengths", prefill_context_lengths)
  c.check_rank("prefill_context_lengths", prefill_context_lengths, 1)
  if indices.ndim < 1 or indices.shape[0] != prefill_context_lengths.shape[0]:
    raise ValueError(
        f"indices must have leading dimension {prefill_context_lengths.shape[0]} "
        f"(len(prefill_context_lengths)); got shape {tuple(indices.shape)}")
  return _ref.filter_prefill_indices(indices, prefill_context_lengths)
