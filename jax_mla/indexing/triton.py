"""Pallas Triton kernels for the index conversions.

Tiles are contiguous masked slices (``pl.ds``), so rows and columns may have any
size; block-table reads are masked gathers, so invalid entries are never read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla._common import cdiv


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the index kernels (static; changes no result).

  Attributes:
    rows, cols: token rows and top-k columns per program of the index conversion
      (``cols`` is capped at the next power of two of ``topk``; powers of two).
    chunk: tokens per program step of the page-index expansion (capped at the next
      power of two of the table's tokens), ``lens_chunk`` lengths per step of its
      in-kernel prefix sum (powers of two).
    num_warps: Triton warps per program.
  """
  rows: int = 1
  cols: int = 1024
  chunk: int = 1024
  lens_chunk: int = 256
  num_warps: int = 4

  def __post_init__(self):
    for name in ("rows", "cols", "chunk", "lens_chunk"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"Config.{name} must be a positive power of two; got {v!r}")


def _convert_kernel(req_ref, bt_ref, tok_ref, out_ref, *, num_tokens, topk, num_reqs,
                    num_blocks, block_size, rows, cols):
  r0, c0 = pl.program_id(0) * rows, pl.program_id(1) * cols
  r = r0 + jnp.arange(rows, dtype=jnp.int32)
  c = c0 + jnp.arange(cols, dtype=jnp.int32)
  in_bounds = (r < num_tokens)[:, None] & (c < topk)[None, :]
  tile = (pl.ds(r0, rows), pl.ds(c0, cols))
  req = plgpu.load(req_ref.at[pl.ds(r0, rows)], mask=r < num_tokens, other=-1)[:, None]
  tok = plgpu.load(tok_ref.at[tile], mask=in_bounds, other=-1)
  block = tok // block_size
  valid = in_bounds & (tok >= 0) & (block < num_blocks) & (req >= 0) & (req < num_reqs)
  base = plgpu.load(bt_ref.at[jnp.where(valid, req * num_blocks + block, 0)], mask=valid, other=0)
  out = jnp.where(valid, base * block_size + tok % block_size, -1)
  plgpu.store(out_ref.at[tile], out, mask=in_bounds)


def convert_req_index_to_global_index(req_id, block_table, token_indices, *, block_size,
                                      config: Config, interpret=False):
  num_tokens, topk = token_indices.shape
  num_reqs, num_blocks = block_table.shape
  rows = config.rows
  cols = min(config.cols, pl.next_power_of_2(topk))
  kernel = functools.partial(
      _convert_kernel, num_tokens=num_tokens, topk=topk, num_reqs=num_reqs,
      num_blocks=num_blocks, block_size=block_size, rows=rows, cols=cols)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_tokens, topk), jnp.int32),
      grid=(cdiv(num_tokens, rows), cdiv(topk, cols)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="convert_req_index_to_global_index",
  )(req_id, block_table.reshape(-1), token_indices)


def _expand_kernel(bt_ref, lens_ref, pages_ref, indptr_ref, *, num_reqs, num_blocks,
                   kernel_block_size, capacity, chunk, lens_chunk):
  """Program (r, j) writes tokens [j*chunk, (j+1)*chunk) of request r, plus its share
  of the -1 tail. Offsets come from an in-kernel prefix sum, so there is one launch."""
  req, j = pl.program_id(0), pl.program_id(1)
  num_chunks = pl.num_programs(1)

  def lens_sum(upto):
    def body(i, acc):
      idx = i * lens_chunk + jnp.arange(lens_chunk, dtype=jnp.int32)
      m = idx < upto
      return acc + jnp.sum(plgpu.load(lens_ref.at[pl.ds(i * lens_chunk, lens_chunk)], mask=m,
                                      other=0))
    return lax.fori_loop(0, (upto + lens_chunk - 1) // lens_chunk, body, jnp.int32(0))

  start = lens_sum(req)
  n = lens_ref[req]
  lane = jnp.arange(chunk, dtype=jnp.int32)

  @pl.when(j == 0)
  def _():
    indptr_ref[req + 1] = start + n

    @pl.when(req == 0)
    def _():
      indptr_ref[0] = jnp.int32(0)

  def write_tokens(c, carry):
    t = c * chunk + lane
    live = (t < n) & (start + t < capacity)
    block = t // kernel_block_size
    valid = live & (block < num_blocks)
    base = plgpu.load(bt_ref.at[req * num_blocks + jnp.where(valid, block, 0)], mask=valid,
                      other=0)
    pages = jnp.where(valid, base * kernel_block_size + t % kernel_block_size, -1)
    plgpu.store(pages_ref.at[pl.ds(start + c * chunk, chunk)], pages, mask=live)
    return carry

  # Chunks j, j + num_chunks, ...: one pass in the common case that the grid covers
  # the table; requests longer than the table (their tail is -1) loop further.
  todo = (jnp.minimum(n, capacity) + chunk - 1) // chunk
  lax.fori_loop(0, (todo - j + num_chunks - 1) // num_chunks,
                lambda i, carry: write_tokens(j + i * num_chunks, carry), 0)

  # The unused tail [total, capacity) is shared out among all programs.
  total = jnp.minimum(lens_sum(num_reqs), capacity)
  programs = num_reqs * num_chunks
  share = (capacity - total + programs - 1) // programs
  tail_start = total + (req * num_chunks + j) * share
  tail_end = jnp.minimum(tail_start + share, capacity)

  def write_tail(i, carry):
    pos = tail_start + i * chunk + lane
    plgpu.store(pages_ref.at[pl.ds(tail_start + i * chunk, chunk)],
                jnp.full((chunk,), -1, jnp.int32), mask=pos < tail_end)
    return carry

  lax.fori_loop(0, (share + chunk - 1) // chunk, write_tail, 0)


def expand_page_indices(block_table, seq_lens, *, kernel_block_size, capacity,
                        config: Config, interpret=False):
  num_reqs, num_blocks = block_table.shape
  chunk = min(config.chunk, pl.next_power_of_2(max(num_blocks * kernel_block_size, 1)))
  kernel = functools.partial(
      _expand_kernel, num_reqs=num_reqs, num_blocks=num_blocks,
      kernel_block_size=kernel_block_size, capacity=capacity, chunk=chunk,
      lens_chunk=min(config.lens_chunk, pl.next_power_of_2(num_reqs)))
  return pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((capacity,), jnp.int32),
                 jax.ShapeDtypeStruct((num_reqs + 1,), jnp.int32)),
      grid=(num_reqs, max(1, cdiv(num_blocks * kernel_block_size, chunk))),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="expand_page_indices",
  )(block_table.reshape(-1), seq_lens.astype(jnp.int32))
