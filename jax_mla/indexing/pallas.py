"""Pallas (Triton lowering) kernels for the index conversions.

Tiles are contiguous masked slices (``pl.ds``), so rows and columns may have any
size; block-table reads are masked gathers, so invalid entries are never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla._common import cdiv


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
                                      interpret=False, rows=8, cols=256):
  num_tokens, topk = token_indices.shape
  num_reqs, num_blocks = block_table.shape
  cols = min(cols, pl.next_power_of_2(topk))
  kernel = functools.partial(
      _convert_kernel, num_tokens=num_tokens, topk=topk, num_reqs=num_reqs,
      num_blocks=num_blocks, block_size=block_size, rows=rows, cols=cols)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_tokens, topk), jnp.int32),
      grid=(cdiv(num_tokens, rows), cdiv(topk, cols)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="convert_req_index_to_global_index",
  )(req_id, block_table.reshape(-1), token_indices)


def _expand_kernel(bt_ref, lens_ref, indptr_ref, out_ref, *, num_reqs, num_blocks,
                   kernel_block_size, capacity, chunk):
  req = pl.program_id(0)
  start = indptr_ref[req]
  n = lens_ref[req]
  lane = jnp.arange(chunk, dtype=jnp.int32)

  def write_tokens(i, carry):
    t = i * chunk + lane
    pos = start + t
    live = (t < n) & (pos < capacity)
    block = t // kernel_block_size
    valid = live & (block < num_blocks)
    base = plgpu.load(bt_ref.at[req * num_blocks + jnp.where(valid, block, 0)], mask=valid,
                      other=0)
    pages = jnp.where(valid, base * kernel_block_size + t % kernel_block_size, -1)
    plgpu.store(out_ref.at[pl.ds(start + i * chunk, chunk)], pages, mask=live)
    return carry

  lax.fori_loop(0, (jnp.minimum(n, capacity) + chunk - 1) // chunk, write_tokens, 0)

  # The unused tail [total, capacity) is shared out among the programs.
  total = jnp.minimum(indptr_ref[num_reqs], capacity)
  share = (capacity - total + num_reqs - 1) // num_reqs
  tail_start = total + req * share
  tail_end = jnp.minimum(tail_start + share, capacity)

  def write_tail(i, carry):
    pos = tail_start + i * chunk + lane
    live = pos < tail_end
    plgpu.store(out_ref.at[pl.ds(tail_start + i * chunk, chunk)],
                jnp.full((chunk,), -1, jnp.int32), mask=live)
    return carry

  lax.fori_loop(0, (share + chunk - 1) // chunk, write_tail, 0)


def expand_page_indices(block_table, seq_lens, *, kernel_block_size, capacity, interpret=False,
                        chunk=1024):
  num_reqs, num_blocks = block_table.shape
  indptr = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_lens.astype(jnp.int32))]).astype(jnp.int32)
  kernel = functools.partial(
      _expand_kernel, num_reqs=num_reqs, num_blocks=num_blocks,
      kernel_block_size=kernel_block_size, capacity=capacity, chunk=chunk)
  pages = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((capacity,), jnp.int32),
      grid=(num_reqs,),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="expand_page_indices",
  )(block_table.reshape(-1), seq_lens.astype(jnp.int32), indptr)
  return pages, indptr
