"""Pallas Triton paged decode attention with a split KV sequence (flash-decoding).

One program per (sequence, kv head, kv split) computes all query heads of the
group at once (padded to 16 rows for the tensor-core dot) over its share of the
sequence's tiles with the online softmax of :mod:`jax_mla._softmax`, and writes a
normalised partial output plus its LSE. The splits (and the attention sink) are
combined afterwards in XLA (:func:`jax_mla.paged.layout.finish_parts`). Against the seed
``kernel_paged_attention_2d``:

- splitting the sequence lets a few long sequences fill the GPU;
- a tile spans several cache blocks (64 tokens, 128 for fp8, not one 16-token
  block), so each iteration has more loads in flight, and loads are not masked
  per token, so they stay 16 bytes wide;
- fp8 K/V are widened exactly to the query dtype; ``k_scale`` is folded into the
  score scale and ``v_scale`` into the epilogue instead of scaling every element;
- with a sliding window the loop starts at the first tile inside the window
  instead of masking every tile before it;
- slots at or past ``seq_len`` and blocks with an out-of-range id never reach the
  result: their scores are selected to -inf and their V rows to 0 (NaN-safe), and
  an out-of-range block id is never dereferenced.
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
  LOG2E,
  cdiv,
  check_num_splits,
  check_power_of_two,
  next_pow2,
  num_sms,
  with_num_splits,
)
from jax_mla.paged.layout import CacheView, decode_rows, finish_parts


def _kernel(scal_ref, row_ref, len_ref, bt_ref, q_ref, k_ref, v_ref, *rest, group, head_dim,
            block_size, k_x, v_x, block_n, num_splits, sliding_window, num_blocks, has_alibi):
  if has_alibi:
    alibi_ref, o_ref, lse_ref = rest
  else:
    o_ref, lse_ref = rest
  s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  g_pad, d_pad = o_ref.shape
  max_blocks = bt_ref.shape[1]
  qk_scale = scal_ref[0]  # sm_scale * k_scale * log2(e): scores live in base 2
  v_scale = scal_ref[1]

  seq_len = len_ref[s]  # 0 for skipped sequences
  row = jnp.maximum(row_ref[s], 0)
  g = jnp.arange(g_pad, dtype=jnp.int32)
  d = jnp.arange(d_pad, dtype=jnp.int32)
  g_ok = g < group
  d_ok = d < head_dim
  d_full = head_dim == d_pad
  q = plgpu.load(q_ref.at[row, h, g[:, None], d[None, :]], mask=g_ok[:, None] & d_ok[None, :],
                 other=0)
  slope = plgpu.load(alibi_ref.at[h, g], mask=g_ok, other=0) if has_alibi else None

  # This split's tiles: an equal share of the tiles that touch the window.
  num_tiles = (seq_len + block_n - 1) // block_n
  first = 0
  if sliding_window > 0:
    first = jnp.maximum(seq_len - sliding_window, 0) // block_n
  per_split = (num_tiles - first + num_splits - 1) // num_splits
  lo = first + split * per_split
  hi = jnp.minimum(lo + per_split, num_tiles)

  def body(j, carry):
    m, l, acc = carry
    pos = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    # lax.div/rem (not // and %, which add sign fixes) keep the offsets' contiguity
    # visible to Triton, which then issues 16-byte loads.
    logical = lax.div(pos, block_size)
    blk = bt_ref[s, jnp.minimum(logical, max_blocks - 1)]
    blk_ok = (blk >= 0) & (blk < num_blocks)
    valid = (pos < seq_len) & (logical < max_blocks) & blk_ok
    if sliding_window > 0:
      valid &= (seq_len - 1 - pos) < sliding_window
    # Every lane reads inside the cache (a bad block id reads block 0), and no load is
    # masked per token: a per-token mask would stop vector loads along the token axis.
    # What invalid slots hold (NaN, stale data) is dropped by selects below: their
    # scores become -inf and their V rows 0, so it never reaches an arithmetic op.
    blk = jnp.where(blk_ok, blk, 0)
    off = lax.rem(pos, block_size)

    def gather(ref, x):  # [block_n, d_pad]; head-dim padding lanes are not read
      return plgpu.load(ref.at[blk[:, None], h, lax.div(d, x)[None, :], off[:, None],
                               lax.rem(d, x)[None, :]],
                        mask=None if d_full else d_ok[None, :])

    # Both tiles are loaded before any math so that their reads overlap.
    k = gather(k_ref, k_x).astype(q.dtype)
    v = gather(v_ref, v_x).astype(q.dtype)
    if not d_full:  # masked lanes are undefined: zero them (q is 0 there, 0 * NaN is not)
      k = jnp.where(d_ok[None, :], k, 0)
    v = jnp.where(valid[:, None] if d_full else valid[:, None] & d_ok[None, :], v, 0)
    scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * qk_scale
    if has_alibi:
      rel = (pos - (seq_len - 1)).astype(jnp.float32)
      scores += slope[:, None] * rel[None, :]
    m, l, alpha, p = _softmax.step(m, l, scores, valid[None, :])
    pv = lax.dot_general(p.astype(q.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return m, l, acc * alpha[:, None] + pv

  m, l = _softmax.init(g_pad)
  m, l, acc = lax.fori_loop(lo, hi, body, (m, l, jnp.zeros((g_pad, d_pad), jnp.float32)))
  inv, lse = _softmax.finish(m, l, v_scale=v_scale)
  o_ref[...] = acc * inv[:, None]
  lse_ref[...] = lse


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Triton paged-attention kernel (static; changes no result beyond rounding).

  Attributes:
    block_n: tokens per tile (spanning several cache blocks), a power of two >= 16.
    num_warps, num_stages: Triton launch parameters.
    num_splits: KV splits per (sequence, kv head); ``None`` picks
      :func:`default_num_kv_splits`.
  """
  block_n: int = 64
  num_warps: int = 4
  num_stages: int = 2
  num_splits: int | None = None

  def __post_init__(self):
    check_power_of_two("Config.block_n", self.block_n, 16)
    check_num_splits("Config.num_splits", self.num_splits)


def default_config(*, fp8_cache: bool, head_dim: int) -> Config:
  """Tile defaults from the H100 sweep (benchmarks/bench_paged_attention.py --sweep):
  64 tokens, 2 stages for 2-byte caches; 128 tokens, 3 stages for fp8; 32 tokens for
  head sizes above 128."""
  block_n = (128 if fp8_cache else 64) if max(16, next_pow2(head_dim)) <= 128 else 32
  return Config(block_n=block_n, num_warps=4, num_stages=3 if fp8_cache else 2)


def default_num_kv_splits(num_seqs: int, num_kv_heads: int, max_tiles: int,
                          num_cores: int) -> int:
  """Splits so that about two programs per core run, each with >= 4 tiles."""
  splits = 1
  while (num_seqs * num_kv_heads * splits < 2 * num_cores
         and max_tiles // (2 * splits) >= 4):
    splits *= 2
  return splits


def with_defaults(config: Config | None, *, num_kv_splits: int | None, fp8_cache: bool,
                  head_dim: int, num_seqs: int, num_kv_heads: int, max_tokens: int,
                  interpret: bool) -> Config:
  """``config`` (``None``: :func:`default_config`) with ``num_splits`` set: the op's
  ``num_kv_splits`` when given, else the config's, else :func:`default_num_kv_splits`."""
  config = config or default_config(fp8_cache=fp8_cache, head_dim=head_dim)
  return with_num_splits(config, num_kv_splits, lambda: default_num_kv_splits(
      num_seqs, num_kv_heads, cdiv(max_tokens, config.block_n), 1 if interpret else num_sms()))


def paged_attention_triton(query, key_view_: CacheView, value_view_: CacheView, block_table,
                           seq_lens, *, sm_scale, k_scale, v_scale, attn_sink, alibi_slopes,
                           sliding_window, query_start_loc, out_scale, config: Config,
                           interpret=False):
  """Kernel path of ``paged_attention`` (arguments validated, ``config.num_splits`` set)."""
  t, hq, head_dim = query.shape
  num_blocks, hkv, _, block_size, _ = key_view_.data.shape
  num_seqs = block_table.shape[0]
  num_splits = config.num_splits
  group = hq // hkv
  g_pad = max(16, next_pow2(group))
  d_pad = max(16, next_pow2(head_dim))

  query_row, lens = decode_rows(seq_lens, query_start_loc, t)
  scalars = jnp.stack([jnp.asarray(sm_scale, jnp.float32) * jnp.asarray(k_scale, jnp.float32)
                       * LOG2E, jnp.asarray(v_scale, jnp.float32)])
  inputs = [scalars, query_row, lens, block_table, query.reshape(t, hkv, group, head_dim),
            key_view_.data, value_view_.data]
  if alibi_slopes is not None:
    inputs.append(alibi_slopes.astype(jnp.float32).reshape(hkv, group) * LOG2E)

  kernel = functools.partial(
      _kernel, group=group, head_dim=head_dim, block_size=block_size, k_x=key_view_.x,
      v_x=value_view_.x, block_n=config.block_n, num_splits=num_splits,
      sliding_window=sliding_window, num_blocks=num_blocks,
      has_alibi=alibi_slopes is not None)
  out_part, lse_part = pl.pallas_call(
      kernel,
      grid=(num_seqs, hkv, num_splits),
      in_specs=[pl.no_block_spec] * len(inputs),
      out_specs=[
          pl.BlockSpec((None, None, None, g_pad, d_pad), lambda s, h, p: (s, p, h, 0, 0)),
          pl.BlockSpec((None, None, None, g_pad), lambda s, h, p: (s, p, h, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((num_seqs, num_splits, hkv, g_pad, d_pad), jnp.float32),
          jax.ShapeDtypeStruct((num_seqs, num_splits, hkv, g_pad), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="paged_attention",
  )(*inputs)

  out_part = out_part[..., :group, :head_dim].reshape(num_seqs, num_splits, hq, head_dim)
  lse_part = lse_part[..., :group].reshape(num_seqs, num_splits, hq)
  return finish_parts(jnp.moveaxis(out_part, 1, 0), jnp.moveaxis(lse_part, 1, 0), attn_sink,
                      query_row, t, identity=query_start_loc is None, dtype=query.dtype,
                      out_scale=out_scale)
