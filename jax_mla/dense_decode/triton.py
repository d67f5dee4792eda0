"""Pallas Triton kernel for dense paged MLA decode: split-KV flash-decoding.

One kernel serves every dense-decode convention (AITER ``mla_decode_fwd``,
FlashMLA ``flash_mla_with_kvcache``, tpu-inference ragged paged attention).
Each API lowers its metadata to *query groups*: a run of consecutive query
tokens of one request that share a KV page list. Per group ``g``:

- ``q_start[g]``, ``q_len[g]``: the group's query tokens are
  ``q_start .. q_start+q_len-1`` (rows of ``q`` viewed as ``[T*h_q, 576]``).
- ``kv_len[g]``: keys ``0 .. kv_len-1`` of the request exist.
- ``causal_base[g]``: with ``causal``, query ``i`` of the group sees keys
  ``< causal_base + i + 1`` (bottom-right alignment is the caller's choice).
- ``page_base[g]``: key ``t`` lives in page ``page_ids[page_base + t // page_size]``.

MLA shares one latent KV across all heads, so a program takes a block of
``block_m`` (query token, head) rows of one group (>= 16 for the MMA) and one
KV split, streams ``block_n`` keys at a time gathered through the page list,
and keeps an online softmax in base 2 (:mod:`jax_mla._softmax`). ``QK^T`` is two
power-of-two dots (NoPE 512 + RoPE 64); ``PV`` reuses the NoPE part of the same
rows as V. With one split the kernel writes the final output; with more it writes
float32 partials and their LSE, combined by :func:`jax_mla.merge.combine_splits`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla import _softmax
from jax_mla._common import (
  D_NOPE,
  D_ROPE,
  LOG2E,
  cdiv,
  check_num_splits,
  check_power_of_two,
  next_pow2,
  num_sms,
  with_num_splits,
)
from jax_mla.merge import combine_splits


def _cols(rows, start, size):
  """Index arrays for ``ref[rows, start:start+size]`` (a row gather).

  Array indexers on both axes work in the Triton lowering and in interpret mode
  (which cannot mix an array with a slice).
  """
  return rows[:, None], start + lax.broadcasted_iota(jnp.int32, (1, size), 1)


def _decode_kernel(meta_ref, page_ids_ref, scales_ref, q_ref, kv_ref, o_ref, lse_ref, *,
                   h_q, num_rows, block_m, block_n, page_size, num_pages, num_page_ids,
                   num_splits, causal):
  mt, split, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q_start = meta_ref[0, g]
  q_len = meta_ref[1, g]
  kv_len = meta_ref[2, g]
  causal_base = meta_ref[3, g]
  page_base = meta_ref[4, g]
  qk_scale = scales_ref[0]  # sm_scale * q_scale * k_scale * log2(e)
  v_scale = scales_ref[1]

  m = mt * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
  row_ok = m < q_len * h_q
  rows = jnp.where(row_ok, q_start * h_q + m, 0)
  qi = m // h_q
  # Keys this tile needs: all of them, or up to its last query's causal limit.
  hi = kv_len
  if causal:
    last_qi = jnp.minimum(q_len - 1, (mt * block_m + block_m - 1) // h_q)
    hi = jnp.minimum(kv_len, causal_base + last_qi + 1)
    row_lim = jnp.minimum(kv_len, causal_base + qi + 1)
  else:
    row_lim = jnp.full((block_m,), kv_len, jnp.int32)
  hi = jnp.maximum(hi, 0)
  # This split's key range, a whole number of key blocks.
  chunk = pl.cdiv(pl.cdiv(hi, num_splits), block_n) * block_n
  lo = split * chunk
  end = jnp.minimum(lo + chunk, hi)
  num_iters = pl.cdiv(jnp.maximum(end - lo, 0), block_n)

  q_nope = plgpu.load(q_ref.at[_cols(rows, 0, D_NOPE)], mask=row_ok[:, None], other=0.0)
  q_rope = plgpu.load(q_ref.at[_cols(rows, D_NOPE, D_ROPE)], mask=row_ok[:, None], other=0.0)
  q_nope = q_nope.astype(jnp.bfloat16)
  q_rope = q_rope.astype(jnp.bfloat16)

  def body(it, carry):
    acc, m_i, l_i = carry
    t = lo + it * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    t_ok = t < end
    pidx = jnp.where(t_ok, page_base + t // page_size, 0)
    t_ok = t_ok & (pidx >= 0) & (pidx < num_page_ids)
    page = plgpu.load(page_ids_ref.at[jnp.where(t_ok, pidx, 0)], mask=t_ok, other=-1)
    # Invalid page ids are masked and never read.
    k_ok = t_ok & (page >= 0) & (page < num_pages)
    slot = jnp.where(k_ok, page * page_size + t % page_size, 0)
    # Masked rows load as zero, so NaN in unused slots never enters a dot.
    k_nope = plgpu.load(kv_ref.at[_cols(slot, 0, D_NOPE)], mask=k_ok[:, None], other=0.0)
    k_rope = plgpu.load(kv_ref.at[_cols(slot, D_NOPE, D_ROPE)], mask=k_ok[:, None], other=0.0)
    k_nope = k_nope.astype(jnp.bfloat16)
    k_rope = k_rope.astype(jnp.bfloat16)
    nt = (((1,), (1,)), ((), ()))
    s = lax.dot_general(q_nope, k_nope, nt, preferred_element_type=jnp.float32)
    s += lax.dot_general(q_rope, k_rope, nt, preferred_element_type=jnp.float32)
    s *= qk_scale
    ok = k_ok[None, :] & (t[None, :] < row_lim[:, None])
    m_i, l_i, alpha, p = _softmax.step(m_i, l_i, s, ok)
    acc = acc * alpha[:, None] + lax.dot_general(
        p.astype(jnp.bfloat16), k_nope, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32)
    return acc, m_i, l_i

  acc = jnp.zeros((block_m, D_NOPE), jnp.float32)
  m_i, l_i = _softmax.init(block_m)
  acc, m_i, l_i = lax.fori_loop(0, num_iters, body, (acc, m_i, l_i))
  # Empty rows: out 0, lse +inf (a partial that weighs nothing in the combine).
  inv, lse = _softmax.finish(m_i, l_i, v_scale=v_scale)
  out = acc * inv[:, None]
  # Masked rows point past the end: interpret mode scatters every index (even
  # masked ones, rewriting the old value), so they must not alias a live row.
  out_rows = jnp.where(row_ok, split * num_rows + rows, num_splits * num_rows)
  plgpu.store(o_ref.at[_cols(out_rows, 0, D_NOPE)], out.astype(o_ref.dtype), mask=row_ok[:, None])
  plgpu.store(lse_ref.at[out_rows], lse, mask=row_ok)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Triton decode kernel (static; changes no result beyond rounding).

  Attributes:
    block_m: (query token, head) rows per program, a power of two >= 16.
    block_n: keys per step, a power of two >= 16.
    num_warps, num_stages: Triton launch parameters.
    num_splits: KV splits per row tile; ``None`` picks :func:`default_num_splits`.
  """
  block_m: int = 64
  block_n: int = 32
  num_warps: int = 8
  num_stages: int = 2
  num_splits: int | None = None

  def __post_init__(self):
    check_power_of_two("Config.block_m", self.block_m, 16)
    check_power_of_two("Config.block_n", self.block_n, 16)
    check_num_splits("Config.num_splits", self.num_splits)


def default_config(rows_per_group: int) -> Config:
  """The heuristic for groups of up to ``rows_per_group`` (query token, head) rows.

  Rows per program: 64, or fewer (>= 16) for small groups. 64-row tiles keep a
  64x512 float32 accumulator (8 warps) and the 64x576 query in shared memory, so
  their key blocks are 32 rows to stay under the H100's 227 KiB. Small
  (memory-bound) tiles stream 32-key blocks three deep: on an H100, b132 h16
  seqlen 8192 ran at 2.61 TB/s this way and 1.59 TB/s with 64-key blocks two deep.
  """
  block_m = max(16, min(64, next_pow2(rows_per_group)))
  if block_m >= 64:
    return Config(block_m=block_m, block_n=32, num_warps=8, num_stages=2)
  return Config(block_m=block_m, block_n=32, num_warps=4, num_stages=3)


def default_num_splits(num_programs: int, avg_kv_len: float, *, block_m: int,
                       block_n: int) -> int:
  """Splits so that groups x row tiles x splits fill the GPU.

  Compute-bound 64-row tiles (one per SM) aim at one wave; small memory-bound
  tiles at two, to keep more loads in flight. Each split keeps at least 4 key
  blocks (the combine costs a pass over float32 partials); at most 64 splits.
  """
  target = num_sms() * (1 if block_m >= 64 else 2)
  want = pl.cdiv(target, max(num_programs, 1))
  cap = max(1, int(avg_kv_len) // (4 * block_n))
  return int(max(1, min(want, cap, 64)))


def with_defaults(config: Config | None, *, num_kv_splits: int | None, rows_per_group: int,
                  num_groups: int, avg_kv_len: float) -> Config:
  """``config`` (``None``: :func:`default_config`) with ``num_splits`` set: the op's
  ``num_kv_splits`` when given, else the config's, else :func:`default_num_splits`."""
  config = config or default_config(rows_per_group)
  programs = num_groups * cdiv(rows_per_group, config.block_m)
  return with_num_splits(config, num_kv_splits, lambda: default_num_splits(
      programs, avg_kv_len, block_m=config.block_m, block_n=config.block_n))


@functools.partial(
    jax.jit,
    static_argnames=("h_q", "rows_per_group", "page_size", "causal", "config", "out_dtype",
                     "interpret"))
def paged_mla_decode(q2d, kv2d, meta, page_ids, scales, *, h_q, rows_per_group, page_size,
                     causal, config: Config, out_dtype, interpret):
  """Runs the kernel over query groups. See the module docstring.

  Args:
    q2d: ``[T*h_q, 576]`` bf16 or fp8 queries (token-major, then head).
    kv2d: ``[num_pages*page_size, 576]`` bf16 or fp8 latent cache.
    meta: ``i32[5, G]`` rows ``q_start, q_len, kv_len, causal_base, page_base``.
    page_ids: ``i32[N]`` page ids indexed by ``page_base + t // page_size``.
    scales: ``f32[2]``: ``sm_scale*q_scale*k_scale*log2(e)`` and ``v_scale``.
    rows_per_group: static bound on ``q_len * h_q`` of any group.
    config: the tuning, ``num_splits`` set.

  Returns:
    ``(out [T*h_q, 512] out_dtype, lse f32[T*h_q])``. Rows of tokens outside
    every group are not written (undefined).
  """
  block_m, num_splits = config.block_m, config.num_splits
  num_rows = q2d.shape[0]
  num_groups = meta.shape[1]
  num_mtiles = pl.cdiv(rows_per_group, block_m)
  final = num_splits == 1
  kernel = functools.partial(
      _decode_kernel, h_q=h_q, num_rows=num_rows, block_m=block_m, block_n=config.block_n,
      page_size=page_size, num_pages=kv2d.shape[0] // page_size,
      num_page_ids=page_ids.shape[0], num_splits=num_splits, causal=causal)
  o_dtype = out_dtype if final else jnp.float32
  out, lse = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((num_splits * num_rows, D_NOPE), o_dtype),
                 jax.ShapeDtypeStruct((num_splits * num_rows,), jnp.float32)),
      # Row tiles of one group are adjacent in launch order: they share KV in L2.
      grid=(num_mtiles, num_splits, num_groups),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
  )(meta, page_ids, scales, q2d, kv2d)
  if final:
    return out, lse
  return combine_splits(out.reshape(num_splits, num_rows, D_NOPE),
                        lse.reshape(num_splits, num_rows), out_dtype)


def kernel_scales(sm_scale: float, q_scale=None, k_scale=None, v_scale=None) -> jax.Array:
  """The kernel's ``scales`` operand from per-tensor scales (None means 1)."""
  def as_scalar(x):
    return jnp.asarray(1.0 if x is None else x, jnp.float32).reshape(())
  return jnp.stack([sm_scale * LOG2E * as_scalar(q_scale) * as_scalar(k_scale),
                    as_scalar(v_scale)])
