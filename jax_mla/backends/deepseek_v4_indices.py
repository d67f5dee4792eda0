"""Index helpers of the DeepSeek V4 sparse attention path (vLLM's ``deepseek_v4`` ops), in JAX.

DeepSeek V4 attends, for a token at position ``pos``, to the last
``min(pos + 1, window_size)`` raw tokens of the sliding-window (SWA) cache and to
``min((pos + 1) // compress_ratio, topk)`` entries of a compressed cache, in one
softmax with a per-head sink. These helpers turn request-local positions into
cache slots and workspace rows.

vLLM's kernels emit ragged CSR outputs whose length is only known on the device.
Under ``jit`` every shape is static, so here a ragged output is sized by its
maximum (``num_rows * max_row_len``) and comes with its lengths and ``indptr``;
the unused tail holds ``-1``. Dense ``[rows, max_row_len]`` forms (valid entries
first, ``-1`` after) are what the sparse-MLA ops take; the ragged forms are built
from them by :func:`build_ragged_indices_from_dense`.

All functions are pure ``jax.numpy``, jit-compatible, with static sizes as
keyword arguments. Token ``t`` of request ``r`` sits at position
``seq_lens[r] - query_len[r] + (t - query_start_loc[r])``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import _common as c
from jax_mla.cache import gather_dequantize
from jax_mla.indexing import convert_req_index_to_global_index, req_id_per_token


def token_positions(query_start_loc, seq_lens, req, token):
  """Position of ``token`` (numbered like ``query_start_loc``) inside its request ``req``:
  ``seq_lens[req] - query_len[req] + (token - query_start_loc[req])``."""
  query_len = query_start_loc[req + 1] - query_start_loc[req]
  return seq_lens[req] - query_len + (token - query_start_loc[req])


def _to_global_slots(req, block_table, tok, block_size):
  # One place for block-table lookups: the shared converter masks tok < 0 and
  # blocks past the table with -1 (the table is never read there).
  return convert_req_index_to_global_index(
      req.astype(jnp.int32), block_table, tok.astype(jnp.int32), block_size=block_size,
      implementation="xla")


def _pack_valid_first(values, valid):
  """Moves the ``valid`` entries of each row to its front (order kept); ``-1`` after."""
  rows, width = values.shape
  dest = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, width)
  row = jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, width))
  packed = jnp.full((rows, width), -1, jnp.int32)
  return packed.at[row, dest].set(values.astype(jnp.int32), mode="drop")


@jax.jit
def build_ragged_indices_from_dense(indices: jax.Array,
                                    lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Packs the leading ``lengths[i]`` entries of each row of ``indices`` into one CSR.

  Args:
    indices: int32 ``[N, W]`` dense rows.
    lengths: int32 ``[N]``; clipped to ``[0, W]``.

  Returns:
    ``(flat int32[N * W], indptr int32[N + 1])``: row ``i`` is
    ``flat[indptr[i]:indptr[i + 1]]``; entries past ``indptr[N]`` hold ``-1``.
  """
  c.check_rank("indices", indices, 2)
  c.check_rank("lengths", lengths, 1)
  c.check_int32("indices", indices)
  c.check_int32("lengths", lengths)
  c.check_shape("lengths", lengths, (indices.shape[0],))
  rows, width = indices.shape
  lengths = jnp.clip(lengths, 0, width)
  indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)]).astype(jnp.int32)
  col = jnp.arange(width, dtype=jnp.int32)[None, :]
  dest = jnp.where(col < lengths[:, None], indptr[:-1, None] + col, rows * width)
  flat = jnp.full((rows * width,), -1, jnp.int32)
  return flat.at[dest.reshape(-1)].set(indices.reshape(-1), mode="drop"), indptr


@functools.partial(jax.jit, static_argnames=("block_size",))
def compute_global_topk_indices_and_lens(
    topk_indices: jax.Array, token_to_req_indices: jax.Array, block_table: jax.Array,
    is_valid_token: jax.Array, *, block_size: int) -> tuple[jax.Array, jax.Array]:
  """Maps request-local top-k compressed positions to global compressed-cache slots.

  ``slot = block_table[req, i // block_size] * block_size + i % block_size`` for
  each ``i = topk_indices[t, k] >= 0`` (``req = token_to_req_indices[t]``). Valid
  slots are packed to the front of each row (order kept) and counted, so
  ``topk_lens`` can be used as a ``topk_length``; padding tokens
  (``is_valid_token[t]`` false) get length 0 and a row of ``-1``.

  Args:
    topk_indices: int32 ``[T, K]`` indexer output (``-1`` = none).
    token_to_req_indices: int32 ``[T]``.
    block_table: int32 ``[R, B]`` block table of the compressed cache.
    is_valid_token: bool ``[T]`` (``slot_mapping >= 0``).
    block_size: entries per compressed-cache block (static).

  Returns:
    ``(global_topk_indices int32[T, K], topk_lens int32[T])``.
  """
  _check_topk_args(topk_indices, token_to_req_indices, block_table, is_valid_token)
  slots = _to_global_slots(token_to_req_indices, block_table, topk_indices, block_size)
  valid = (slots >= 0) & is_valid_token[:, None]
  return _pack_valid_first(slots, valid), jnp.sum(valid, axis=1, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_size",))
def compute_global_topk_ragged_indices_and_indptr(
    topk_indices: jax.Array, token_to_req_indices: jax.Array, block_table: jax.Array,
    block_size: int, is_valid_token: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Ragged (CSR) form of :func:`compute_global_topk_indices_and_lens` (vLLM ROCm name).

  Argument order follows vLLM: ``(topk_indices, token_to_req_indices, block_table,
  block_size, is_valid_token)``; ``block_size`` is static.

  Returns:
    ``(global_topk_ragged int32[T * K], topk_indptr int32[T + 1], topk_lens int32[T])``;
    the tail past ``topk_indptr[T]`` holds ``-1``.
  """
  dense, lens = compute_global_topk_indices_and_lens(
      topk_indices, token_to_req_indices, block_table, is_valid_token, block_size=block_size)
  ragged, indptr = build_ragged_indices_from_dense(dense, lens)
  return ragged, indptr, lens


@functools.partial(jax.jit, static_argnames=("window_size", "block_size"))
def compute_swa_indices_and_lens(
    query_start_loc: jax.Array, seq_lens: jax.Array, token_to_req_indices: jax.Array,
    is_valid_token: jax.Array, block_table: jax.Array, *, window_size: int,
    block_size: int) -> tuple[jax.Array, jax.Array]:
  """Sliding-window cache slots of each (decode) token.

  Token ``t`` at position ``pos`` sees positions ``max(pos - window_size + 1, 0) ..
  pos`` of its request, looked up in the SWA block table. Padding tokens get
  length 0 and a row of ``-1``.

  Args:
    query_start_loc: int32 ``[R + 1]``; token numbering of ``token_to_req_indices``.
    seq_lens: int32 ``[R]``, tokens per request including the new ones.
    token_to_req_indices: int32 ``[T]``.
    is_valid_token: bool ``[T]``.
    block_table: int32 ``[R, B]`` SWA block table (indexed by absolute position).
    window_size, block_size: static.

  Returns:
    ``(swa_indices int32[T, window_size], swa_lens int32[T])``.
  """
  c.check_rank("query_start_loc", query_start_loc, 1)
  c.check_rank("seq_lens", seq_lens, 1)
  c.check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,))
  c.check_rank("token_to_req_indices", token_to_req_indices, 1)
  c.check_shape("is_valid_token", is_valid_token, token_to_req_indices.shape)
  c.check_rank("block_table", block_table, 2)
  for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                  ("token_to_req_indices", token_to_req_indices), ("block_table", block_table)):
    c.check_int32(name, x)
  req = token_to_req_indices
  token = jnp.arange(req.shape[0], dtype=jnp.int32)
  pos = token_positions(query_start_loc, seq_lens, req, token)
  start = jnp.maximum(pos - window_size + 1, 0)
  lens = jnp.where(is_valid_token, pos + 1 - start, 0).astype(jnp.int32)
  col = jnp.arange(window_size, dtype=jnp.int32)[None, :]
  tok = jnp.where(col < lens[:, None], start[:, None] + col, -1)
  return _to_global_slots(req, block_table, tok, block_size), lens


@functools.partial(jax.jit, static_argnames=("window_size",))
def compute_prefill_gather_lens(query_start_loc: jax.Array, seq_lens: jax.Array, *,
                                window_size: int) -> jax.Array:
  """SWA tokens to gather per prefill request: ``query_len + min(prefix_len, window_size - 1)``.

  The last ``gather_len`` tokens of a request cover its new tokens and the window
  of its first new token.
  """
  c.check_rank("seq_lens", seq_lens, 1)
  c.check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,))
  query_len = query_start_loc[1:] - query_start_loc[:-1]
  prefix_len = seq_lens - query_len
  return (query_len + jnp.minimum(prefix_len, window_size - 1)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("window_size", "compress_ratio", "topk", "M", "N"))
def combine_topk_swa_indices(
    topk_indices: jax.Array, query_start_loc: jax.Array, seq_lens: jax.Array,
    gather_lens: jax.Array, *, window_size: int, compress_ratio: int, topk: int, M: int,
    N: int) -> tuple[jax.Array, jax.Array]:
  """Per-token workspace rows for the V4 prefill: compressed top-k, then the window.

  The prefill workspace holds, for request ``b`` of the chunk, its compressed
  entries at rows ``[b*M, b*M + N)`` and its last ``gather_lens[b]`` SWA tokens at
  rows ``[b*M + N, ...)``. Row ``t`` of the output (the query token numbered ``t``
  like ``query_start_loc``) lists ``topk_len = min(topk, (pos+1) // compress_ratio)``
  top-k rows (``topk_indices[t, :topk_len] + b*M``; an entry outside
  ``[0, (pos+1) // compress_ratio)`` becomes ``-1``), then ``swa_len = min(pos+1,
  window_size)`` window rows. Rows of tokens outside every request get length 0.

  Callers that slice ``topk_indices`` to a chunk pass ``query_start_loc`` minus the
  chunk's first token (vLLM subtracts ``query_start_loc[0]`` itself).

  Args:
    topk_indices: int32 ``[Tq, K]`` request-local compressed positions (``K`` may be 0).
    query_start_loc: int32 ``[C + 1]``; seq_lens, gather_lens: int32 ``[C]``.
    window_size, compress_ratio, topk, M, N: static, as in vLLM.

  Returns:
    ``(combined_indices int32[Tq, topk + window_size], combined_lens int32[Tq])``.
  """
  c.check_rank("topk_indices", topk_indices, 2)
  c.check_int32("topk_indices", topk_indices)
  for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                  ("gather_lens", gather_lens)):
    c.check_rank(name, x, 1)
    c.check_int32(name, x)
  c.check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,))
  c.check_shape("gather_lens", gather_lens, seq_lens.shape)
  num_tokens, width = topk_indices.shape
  token = jnp.arange(num_tokens, dtype=jnp.int32)
  req = req_id_per_token(query_start_loc, num_tokens=num_tokens)
  in_req = (token >= query_start_loc[0]) & (token < query_start_loc[-1])
  pos = token_positions(query_start_loc, seq_lens, req, token)
  num_compressed = (pos + 1) // compress_ratio
  topk_len = jnp.where(in_req, jnp.minimum(num_compressed, topk), 0)
  swa_len = jnp.where(in_req, jnp.minimum(pos + 1, window_size), 0)
  gather_start = seq_lens[req] - gather_lens[req]

  col = jnp.arange(topk + window_size, dtype=jnp.int32)[None, :]
  base = (M * req)[:, None]
  picked = jnp.take_along_axis(
      topk_indices, jnp.minimum(col, width - 1), axis=1) if width else jnp.full(col.shape, -1)
  topk_ok = (col < topk_len[:, None]) & (col < width) & (picked >= 0) & (
      picked < num_compressed[:, None])
  topk_rows = jnp.where(topk_ok, base + picked, -1)
  swa_j = col - topk_len[:, None]
  swa_rows = base + N + swa_j + (pos - swa_len + 1 - gather_start)[:, None]
  is_swa = (swa_j >= 0) & (swa_j < swa_len[:, None])
  combined = jnp.where(col < topk_len[:, None], topk_rows, jnp.where(is_swa, swa_rows, -1))
  return combined.astype(jnp.int32), (topk_len + swa_len).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("window_size", "compress_ratio", "topk", "M", "N"))
def combine_topk_swa_indices_ragged(
    topk_indices: jax.Array, query_start_loc: jax.Array, seq_lens: jax.Array,
    gather_lens: jax.Array, window_size: int, compress_ratio: int, topk: int, M: int,
    N: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Ragged (CSR) form of :func:`combine_topk_swa_indices` (vLLM ROCm name and order).

  Returns:
    ``(combined_ragged int32[Tq * (topk + window_size)], combined_indptr int32[Tq + 1],
    combined_lens int32[Tq])``; the tail past ``combined_indptr[Tq]`` holds ``-1``.
  """
  dense, lens = combine_topk_swa_indices(
      topk_indices, query_start_loc, seq_lens, gather_lens, window_size=window_size,
      compress_ratio=compress_ratio, topk=topk, M=M, N=N)
  ragged, indptr = build_ragged_indices_from_dense(dense, lens)
  return ragged, indptr, lens


@functools.partial(jax.jit, static_argnames=("compress_ratio", "topk", "num_decode_tokens",
                                             "block_size"))
def build_c128a_topk_metadata(
    positions: jax.Array, token_to_req_indices: jax.Array, block_table: jax.Array,
    slot_mapping: jax.Array, *, compress_ratio: int, topk: int, num_decode_tokens: int,
    block_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-k lists of the "all compressed entries" layers (compress ratio 128).

  A token at ``pos`` attends to compressed entries ``0 .. n-1`` with
  ``n = min((pos + 1) // compress_ratio, topk)``.

  Args:
    positions: int32 ``[T]``; the first ``num_decode_tokens`` are decode tokens.
    token_to_req_indices: int32 ``[T]``.
    block_table: int32 ``[R, B]`` compressed-cache block table.
    slot_mapping: int32 ``[T]``; ``< 0`` marks padding decode tokens (length 0).
    compress_ratio, topk, num_decode_tokens, block_size: static.

  Returns:
    ``(global_decode_topk_indices int32[Td, topk], decode_topk_lens int32[Td],
    prefill_topk_indices int32[T - Td, topk])``: global compressed-cache slots for
    decode tokens and request-local entry ids for prefill tokens, ``-1`` past ``n``.
  """
  c.check_rank("positions", positions, 1)
  c.check_shape("token_to_req_indices", token_to_req_indices, positions.shape)
  c.check_shape("slot_mapping", slot_mapping, positions.shape)
  col = jnp.arange(topk, dtype=jnp.int32)[None, :]
  n = jnp.minimum((positions + 1) // compress_ratio, topk)
  local = jnp.where(col < n[:, None], col, -1)
  td = num_decode_tokens
  decode_local = jnp.where((slot_mapping[:td] >= 0)[:, None], local[:td], -1)
  decode_global = _to_global_slots(token_to_req_indices[:td], block_table, decode_local,
                                   block_size)
  decode_lens = jnp.sum(decode_global >= 0, axis=1, dtype=jnp.int32)
  return decode_global, decode_lens, local[td:]


@functools.partial(jax.jit, static_argnames=("offset", "capacity", "kv_cache_dtype"))
def dequantize_and_gather_k_cache(
    out: jax.Array, k_cache: jax.Array, seq_lens: jax.Array, gather_lens: jax.Array | None,
    block_table: jax.Array, *, offset: int, capacity: int,
    kv_cache_dtype: str = "fp8_model1") -> jax.Array:
  """Dequantizes the last tokens of each request of a paged cache into a bf16 workspace.

  For request ``b``, entry ``i < gather_len[b]`` (``gather_len = seq_lens`` when
  ``gather_lens`` is None) is the token at position ``seq_lens[b] - gather_len[b] + i``,
  read through ``block_table[b]`` and written to ``out[b, offset + i]``. Rows
  ``i >= gather_len[b]`` keep their old content; ``gather_len`` is clipped to
  ``capacity``. The cache block size is ``k_cache.shape[1]``.

  Args:
    out: bf16 ``[B, M, D]`` workspace; ``offset + capacity <= M``.
    k_cache: paged cache in ``kv_cache_dtype`` (``"fp8_model1"`` for DeepSeek V4).
    seq_lens, gather_lens: int32 ``[B]``.
    block_table: int32 ``[B, nb]``.
    offset, capacity: static workspace row offset and rows per request.

  Returns:
    The updated workspace.
  """
  c.check_rank("out", out, 3)
  c.check_rank("seq_lens", seq_lens, 1)
  c.check_shape("block_table", block_table, (out.shape[0], None))
  c.check_shape("seq_lens", seq_lens, (out.shape[0],))
  if gather_lens is not None:
    c.check_shape("gather_lens", gather_lens, (out.shape[0],))
  if offset < 0 or capacity < 0 or offset + capacity > out.shape[1]:
    raise ValueError(f"offset + capacity must lie in [0, {out.shape[1]}] (out.shape[1]); "
                     f"got offset={offset}, capacity={capacity}")
  if capacity == 0:
    return out
  num_reqs = out.shape[0]
  gather_len = seq_lens if gather_lens is None else gather_lens
  col = jnp.arange(capacity, dtype=jnp.int32)[None, :]
  valid = col < gather_len[:, None]
  tok = jnp.where(valid, (seq_lens - gather_len)[:, None] + col, -1)
  slots = _to_global_slots(jnp.arange(num_reqs, dtype=jnp.int32), block_table, tok,
                           k_cache.shape[1])
  rows = gather_dequantize(k_cache, slots.reshape(-1), kv_cache_dtype=kv_cache_dtype)
  rows = rows.reshape(num_reqs, capacity, -1).astype(out.dtype)
  old = out[:, offset:offset + capacity]
  # select (not multiply): unwritten cache slots may dequantize to NaN.
  new = jnp.where((valid & (slots >= 0))[..., None], rows[..., :out.shape[2]], old)
  return out.at[:, offset:offset + capacity].set(new)


def _check_topk_args(topk_indices, token_to_req_indices, block_table, is_valid_token):
  c.check_rank("topk_indices", topk_indices, 2)
  c.check_rank("token_to_req_indices", token_to_req_indices, 1)
  c.check_rank("block_table", block_table, 2)
  for name, x in (("topk_indices", topk_indices), ("token_to_req_indices", token_to_req_indices),
                  ("block_table", block_table)):
    c.check_int32(name, x)
  c.check_shape("token_to_req_indices", token_to_req_indices, (topk_indices.shape[0],))
  c.check_shape("is_valid_token", is_valid_token, (topk_indices.shape[0],))


__all__ = [
    "build_c128a_topk_metadata", "build_ragged_indices_from_dense", "combine_topk_swa_indices",
    "combine_topk_swa_indices_ragged", "compute_global_topk_indices_and_lens",
    "compute_global_topk_ragged_indices_and_indptr", "compute_prefill_gather_lens",
    "compute_swa_indices_and_lens", "dequantize_and_gather_k_cache",
]
