"""Public entry points for index conversion and metadata helpers.

Each validates its arguments (errors name them; integer metadata of any integer
dtype is cast to int32) and calls a private jitted function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import _common as c
from jax_mla.indexing import metadata as _md
from jax_mla.indexing import reference as _ref
from jax_mla.indexing import triton as _triton


def _kernel_config(config, implementation, interpret, like):
  """``None`` for the reference, else the Triton kernels' config (``like``: the op's
  first array, which decides where ``implementation=None`` runs)."""
  impl = c.resolve_implementation(implementation, interpret, like=like)
  return c.backend_config(impl, config,
                          triton=(_triton.Config, lambda cfg: cfg or _triton.Config()))


def convert_req_index_to_global_index(req_id: jax.Array, block_table: jax.Array,
                                      token_indices: jax.Array, *, block_size: int = 64,
                                      config: _triton.Config | None = None,
                                      implementation: c.Implementation = None,
                                      interpret: bool = False) -> jax.Array:
  """Maps per-request top-k token indices to global KV-cache slots (vLLM FlashMLASparse).

  ``out[t, k] = block_table[req_id[t], tok // block_size] * block_size + tok % block_size``
  with ``tok = token_indices[t, k]``; ``-1`` where ``tok < 0``, where the block lies
  past the table, or where ``req_id[t]`` is not a row of the table.

  Args:
    req_id: ``[T]`` integer (any integer dtype, cast to int32), the request of each token.
    block_table: ``[R, B]`` integer, physical block ids of each request.
    token_indices: ``[T, K]`` integer, request-local token positions (``-1`` = none).
    block_size: tokens per cache block (static).
    config: ``None`` (the defaults) or a :class:`jax_mla.indexing.triton.Config`.
    implementation: ``"triton"`` (old name ``"pallas"``), ``"xla"`` or ``None``
      (Triton on GPU).
    interpret: run the Triton kernel in the Pallas interpreter.

  Returns:
    int32 ``[T, K]`` global slots.
  """
  req_id = c.as_int32("req_id", req_id)
  block_table = c.as_int32("block_table", block_table)
  token_indices = c.as_int32("token_indices", token_indices)
  c.check_rank("req_id", req_id, 1)
  c.check_rank("block_table", block_table, 2)
  c.check_rank("token_indices", token_indices, 2)
  c.check_shape("token_indices", token_indices, (req_id.shape[0], None))
  c.check_static("block_size", block_size, int)
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1; got {block_size}")
  if token_indices.size == 0:
    return jnp.full(token_indices.shape, -1, jnp.int32)
  config = _kernel_config(config, implementation, interpret, req_id)
  return _convert(req_id, block_table, token_indices, block_size=block_size, config=config,
                  interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_size", "config", "interpret"))
def _convert(req_id, block_table, token_indices, *, block_size, config, interpret):
  if config is None:
    return _ref.convert_req_index_to_global_index(
        req_id, block_table, token_indices, block_size=block_size)
  return _triton.convert_req_index_to_global_index(
      req_id, block_table, token_indices, block_size=block_size, config=config,
      interpret=interpret)


def expand_page_indices(block_table: jax.Array, seq_lens: jax.Array, *, kernel_block_size: int,
                        capacity: int, config: _triton.Config | None = None,
                        implementation: c.Implementation = None,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Expands a block table into per-token flat page indices (vLLM AiterMLA, page size 1 view).

  ``indptr = [0, cumsum(seq_lens)]``; token ``t`` of request ``r`` goes to
  ``page_indices[indptr[r] + t] = block_table[r, t // K] * K + t % K`` with
  ``K = kernel_block_size``. Unused tail entries, and tokens whose block lies past
  the table, hold ``-1``; tokens past ``capacity`` are dropped.

  Args:
    block_table: ``[R, B]`` integer (any integer dtype, cast to int32).
    seq_lens: ``[R]`` integer, tokens per request (>= 0).
    kernel_block_size: tokens per block-table entry (static).
    capacity: length of the output (static), at least the total token count.
    config: ``None`` (the defaults) or a :class:`jax_mla.indexing.triton.Config`.

  Returns:
    ``(page_indices int32[capacity], indptr int32[R + 1])``.
  """
  block_table = c.as_int32("block_table", block_table)
  seq_lens = c.as_int32("seq_lens", seq_lens)
  c.check_rank("block_table", block_table, 2)
  c.check_rank("seq_lens", seq_lens, 1)
  c.check_shape("seq_lens", seq_lens, (block_table.shape[0],))
  c.check_static("kernel_block_size", kernel_block_size, int)
  c.check_static("capacity", capacity, int)
  if kernel_block_size < 1:
    raise ValueError(f"kernel_block_size must be >= 1; got {kernel_block_size}")
  if capacity < 0:
    raise ValueError(f"capacity must be >= 0; got {capacity}")
  if block_table.shape[0] == 0 or capacity == 0:
    config = None  # nothing to expand
  else:
    config = _kernel_config(config, implementation, interpret, block_table)
  return _expand(block_table, seq_lens, kernel_block_size=kernel_block_size, capacity=capacity,
                 config=config, interpret=interpret)


@functools.partial(jax.jit,
                   static_argnames=("kernel_block_size", "capacity", "config", "interpret"))
def _expand(block_table, seq_lens, *, kernel_block_size, capacity, config, interpret):
  if block_table.shape[0] == 0 or capacity == 0:
    return (jnp.full((capacity,), -1, jnp.int32),
            jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_lens)]).astype(jnp.int32))
  if config is None:
    return _ref.expand_page_indices(
        block_table, seq_lens, kernel_block_size=kernel_block_size, capacity=capacity)
  return _triton.expand_page_indices(
      block_table, seq_lens, kernel_block_size=kernel_block_size, capacity=capacity,
      config=config, interpret=interpret)


def req_id_per_token(query_start_loc: jax.Array, *, num_tokens: int) -> jax.Array:
  """Request id of each token from ``query_start_loc`` (integer ``[R + 1]``).

  Tokens at or past ``query_start_loc[-1]`` (batch padding) get 0.
  """
  query_start_loc = c.as_int32("query_start_loc", query_start_loc)
  c.check_rank("query_start_loc", query_start_loc, 1)
  if query_start_loc.shape[0] < 1:
    raise ValueError("query_start_loc must have at least one entry (R + 1 with R >= 0)")
  c.check_static("num_tokens", num_tokens, int)
  if num_tokens < 0:
    raise ValueError(f"num_tokens must be >= 0; got {num_tokens}")
  return _req_id_per_token(query_start_loc, num_tokens=num_tokens)


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def _req_id_per_token(query_start_loc, *, num_tokens):
  return _md.token_requests(query_start_loc, num_tokens)[0]


def filter_prefill_indices(indices: jax.Array,
                           prefill_context_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits prefill top-k indices into cached-context and new-token indices.

  As vLLM's ``FlashMLASparseDecodeAndContextMetadata.filter_prefill_indices``:
  with ``ctx = prefill_context_lengths[t]``, index ``i`` of row ``t`` stays in
  ``context_indices`` when ``i < ctx`` (``-1`` in ``new_token_indices``), else it
  goes to ``new_token_indices`` as ``i - ctx`` (``-1`` in ``context_indices``).

  Args:
    indices: ``[T, ...]`` integer top-k indices (any integer dtype, cast to int32).
    prefill_context_lengths: ``[T]`` integer.
  """
  indices = c.as_int32("indices", indices)
  prefill_context_lengths = c.as_int32("prefill_context_lengths", prefill_context_lengths)
  c.check_rank("prefill_context_lengths", prefill_context_lengths, 1)
  if indices.ndim < 1 or indices.shape[0] != prefill_context_lengths.shape[0]:
    raise ValueError(
        f"indices must have leading dimension {prefill_context_lengths.shape[0]} "
        f"(len(prefill_context_lengths)); got shape {tuple(indices.shape)}")
  return _filter_prefill_indices(indices, prefill_context_lengths)


_filter_prefill_indices = jax.jit(_md.filter_prefill_indices)
