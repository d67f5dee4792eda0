"""Pallas Mosaic GPU kernel (Hopper wgmma + TMA) for dense paged MLA decode.

The second backend of :func:`jax_mla.dense_decode.mla_decode_paged` (FlashMLA
convention; ``implementation="mosaic"``, and the default on Hopper GPUs for the
shapes it takes), with warp specialisation, which the Triton lowering cannot
express. One CTA takes 64 query rows (``(token, head)`` pairs of one request),
one KV split, and three warpgroups:

- a producer warpgroup loads the 64 x 576 query tile once, then streams the
  request's cache blocks (64 keys each, found through the block table) into a
  two-stage shared-memory ring with TMA;
- two consumer warpgroups each own 256 of the 512 output columns (a 64 x 512
  float32 accumulator does not fit one warpgroup's registers). They take the stages
  in turns: one computes a stage's ``S = Q K^T`` (64 x 64, over 512 NoPE + 64 RoPE
  columns) and the online softmax in base 2 and hands ``P`` to both through SMEM;
  each multiplies ``P`` by its half of ``V`` (the first 512 columns of the same
  latent rows) (:func:`jax_mla._mosaic.consume_stages`).

Unwritten cache slots may hold NaN, and ``0 * NaN`` is NaN, so no CTA reads
them: each request's partial last block comes from a small copy (``tail``) in
which the slots past the sequence are zeroed, and invalid block ids read a
zero block; their scores are masked to ``-inf`` as well.

On an H100 (jax 0.11.2) the b128 s_q1 h128 seqlen-4096 row runs at 350-370
TFLOP/s (the Triton kernel: 153-157). Tried and dropped, as they timed the
same within noise: FlashAttention-3 ping-pong ordering of the two consumers,
and masking only the blocks that need it (a uniform ``lax.cond``). Splitting
KV for that row (512 CTAs) was 5% slower. Computing ``S`` once and sharing ``P``
through SMEM (FlashMLA's split; before, both consumers computed ``S``, a third of the
tensor-core work) took that row from 400 to 369-388 us (2026-11-23).

Shapes: ``s_q * h_q`` must be a multiple of 64 (and ``h_q`` a multiple of 64
when ``causal`` and ``s_q > 1``), the cache block size 64, everything bf16.
Other shapes belong to the Triton kernel (``implementation="triton"``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _mosaic
from jax_mla._common import (
  D_NOPE,
  D_QK,
  D_ROPE,
  LN2,
  LOG2E,
  cdiv,
  check_num_splits,
  num_sms,
  with_num_splits,
)
from jax_mla.merge import combine_splits

BLOCK_M = 64  # query rows per CTA: one wgmma M
PAGE = 64  # keys per pipeline step: one cache block
HALF = D_NOPE // 2  # output columns per consumer warpgroup (wgmma N <= 256)
NUM_STAGES = 2  # 72 KiB query + 2 x 72 KiB key stages fill the 227 KiB of SMEM


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Mosaic GPU decode kernel (static; changes no result beyond rounding).

  Attributes:
    num_splits: KV splits per row tile; ``None`` picks :func:`default_num_splits`.
    consumer_registers, producer_registers: per-thread registers of each consumer
      warpgroup and of the producer (``setmaxnreg``: multiples of 8, and
      ``2 * consumer + producer <= 512`` so three warpgroups fit the register file).
      The consumers hold a 64 x 256 float32 accumulator each.
  """
  num_splits: int | None = None
  consumer_registers: int = 232
  producer_registers: int = 40

  def __post_init__(self):
    check_num_splits("Config.num_splits", self.num_splits)
    c, p = self.consumer_registers, self.producer_registers
    if c % 8 or p % 8 or not 24 <= p <= c <= 256 or 2 * c + p > 512:
      raise ValueError("Config register split must be multiples of 8 with 24 <= producer <= "
                       f"consumer <= 256 and 2 * consumer + producer <= 512; got {c}, {p}")


def _decode_kernel(seq_ref, bt_ref, q_ref, kv_ref, tail_ref, o_ref, lse_ref, smem, barriers, *,
                   plgpu, batch, s_q, h_q, num_blocks, num_splits, causal, scale, registers):
  q_nope, q_rope, kv_nope, kv_rope, lse_smem, p_stats = smem
  q_bar, kv_bar, free_bar, done_bar, p_ready = barriers
  bi = lax.axis_index("b")
  split = lax.axis_index("s")
  tile = lax.axis_index("t")
  wg = lax.axis_index("wg")
  r0 = bi * (s_q * h_q) + tile * BLOCK_M

  seq = seq_ref[bi]  # clipped to the block table by the wrapper
  if causal:  # the tile is one query token (h_q % 64 == 0 or s_q == 1)
    lim = jnp.minimum(jnp.maximum(seq - (s_q - 1) + lax.div(tile * BLOCK_M, h_q), 0), seq)
  else:
    lim = seq
  n_total = lax.div(lim + (PAGE - 1), PAGE)
  chunk = lax.div(n_total + (num_splits - 1), num_splits)
  blk0 = split * chunk
  steps = jnp.minimum(jnp.maximum(n_total - blk0, 0), chunk)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(registers[0], action="increase")
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, PAGE), 1, layout=plgpu.Layout.WGMMA)

    def mask(i, slot):
      del slot
      blk = blk0 + i
      pg = bt_ref[bi, blk]
      kmax = jnp.where((pg >= 0) & (pg < num_blocks), lim - blk * PAGE, 0)
      return lambda s: jnp.where(col < kmax, s, -jnp.inf)

    acc, m, l = _mosaic.consume_stages(
        plgpu, wg=wg, q_main=q_nope, q_rope=q_rope, k_main=kv_nope, k_rope=kv_rope, steps=steps,
        barriers=(q_bar, kv_bar, free_bar, done_bar), shared=(p_stats, p_ready),
        mask=mask, scale=scale)

    # Both consumers are done with Q: its NoPE halves become the output staging.
    empty, l_safe = _mosaic.empty_rows(l)
    inv = jnp.where(empty, 0.0, 1.0 / l_safe)
    q_nope.at[wg][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(q_nope.dtype)

    @pl.when(wg == 0)
    def _():
      lse_smem[...] = jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(l_safe))

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_nope.at[wg],
                            o_ref.at[split, pl.ds(r0, BLOCK_M), pl.ds(wg * HALF, HALF)])

    @pl.when(wg == 0)
    def _():
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, pl.ds(r0, BLOCK_M)])

    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(registers[1], action="decrease")
    rows = pl.ds(r0, BLOCK_M)
    for h in range(2):
      plgpu.copy_gmem_to_smem(q_ref.at[rows, pl.ds(h * HALF, HALF)], q_nope.at[h], q_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[rows, pl.ds(D_NOPE, D_ROPE)], q_rope, q_bar)
    last_blk = lax.div(seq - 1, PAGE)
    partial = lax.rem(seq, PAGE) != 0

    @pl.loop(0, steps)
    def _(i):
      slot = lax.rem(i, NUM_STAGES)

      @pl.when(i >= NUM_STAGES)
      def _():
        plgpu.barrier_wait(free_bar.at[slot])

      blk = blk0 + i
      pg = bt_ref[bi, blk]
      is_tail = partial & (blk == last_blk)
      from_cache = (pg >= 0) & (pg < num_blocks) & jnp.logical_not(is_tail)

      def load(src_ref, first_row):
        src_rows = pl.ds(first_row, PAGE)
        for h in range(2):
          plgpu.copy_gmem_to_smem(src_ref.at[src_rows, pl.ds(h * HALF, HALF)],
                                  kv_nope.at[slot, h], kv_bar.at[slot])
        plgpu.copy_gmem_to_smem(src_ref.at[src_rows, pl.ds(D_NOPE, D_ROPE)],
                                kv_rope.at[slot], kv_bar.at[slot])

      pl.when(from_cache)(lambda: load(kv_ref, pg * PAGE))
      # tail row `bi` is this request's zero-padded last block, row `batch` all zeros.
      pl.when(jnp.logical_not(from_cache))(
          lambda: load(tail_ref, jnp.where(is_tail, bi, batch) * PAGE))


def _tail_blocks(kv_cache, block_table, seq):
  """``[(b+1)*64, 576]``: row block ``i`` is request ``i``'s last cache block with the
  slots past its sequence zeroed (zeros if its id is invalid); block ``b`` is zeros."""
  b = block_table.shape[0]
  num_blocks = kv_cache.shape[0]
  last = jnp.maximum(seq - 1, 0) // PAGE
  pg = block_table[jnp.arange(b), last]
  ok = (pg >= 0) & (pg < num_blocks)
  keep = ok[:, None] & (jnp.arange(PAGE)[None, :] < (seq - last * PAGE)[:, None])
  tail = jnp.where(keep[..., None], kv_cache[jnp.clip(pg, 0, num_blocks - 1)], 0)
  tail = jnp.concatenate([tail, jnp.zeros((1, PAGE, D_QK), kv_cache.dtype)])
  return tail.reshape((b + 1) * PAGE, D_QK)


def default_num_splits(num_tiles: int, max_blocks: int) -> int:
  """KV splits so that tiles x splits fill one wave, each split keeping >= 4 blocks."""
  if num_tiles >= num_sms():
    return 1
  return int(max(1, min(cdiv(num_sms(), num_tiles), max_blocks // 4, 64)))


def check_supported(q, kv_cache, *, causal):
  """Raises ``ValueError`` for shapes this kernel does not take (the Triton one does)."""
  _, s_q, h_q, _ = q.shape
  why = None
  if kv_cache.shape[1] != PAGE:
    why = f"cache block size {PAGE} (got {kv_cache.shape[1]})"
  elif (s_q * h_q) % BLOCK_M:
    why = f"s_q * h_q a multiple of {BLOCK_M} (got s_q={s_q}, h_q={h_q})"
  elif causal and s_q > 1 and h_q % BLOCK_M:
    why = f"h_q a multiple of {BLOCK_M} with causal and s_q > 1 (got h_q={h_q})"
  if why:
    raise ValueError(f"the Mosaic GPU dense-decode kernel needs {why}; use "
                     "implementation='triton' for this shape")


def with_defaults(config: Config | None, *, num_kv_splits: int | None, batch: int, s_q: int,
                  h_q: int, max_blocks: int) -> Config:
  """``config`` (``None``: the defaults) with ``num_splits`` set: the op's
  ``num_kv_splits`` when given, else the config's, else :func:`default_num_splits`."""
  return with_num_splits(config or Config(), num_kv_splits, lambda: default_num_splits(
      batch * s_q * h_q // BLOCK_M, max_blocks))


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "config"))
def paged_decode(q, kv_cache, block_table, cache_seqlens, *, sm_scale, causal, config: Config):
  """Runs the kernel; inputs validated by :func:`jax_mla.dense_decode.mla_decode_paged`
  and :func:`check_supported`, ``config.num_splits`` set. Returns token-major
  ``(out [b, s_q, h_q, 512] bf16, lse f32[b, s_q, h_q])``."""
  plgpu = _mosaic.plgpu()
  num_splits = config.num_splits
  b, s_q, h_q, _ = q.shape
  num_blocks, max_blocks = kv_cache.shape[0], block_table.shape[1]
  rows = b * s_q * h_q
  tiles = s_q * h_q // BLOCK_M
  seq = jnp.clip(cache_seqlens, 0, max_blocks * PAGE)
  tail = _tail_blocks(kv_cache, block_table, seq)

  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  shared_smem, shared_barrier = _mosaic.shared_scratch(plgpu, BLOCK_M, NUM_STAGES)
  smem = (
      plgpu.SMEM((2, BLOCK_M, HALF), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((BLOCK_M, D_ROPE), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((NUM_STAGES, 2, PAGE, HALF), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((NUM_STAGES, PAGE, D_ROPE), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      shared_smem,
  )
  barriers = (
      plgpu.Barrier(num_arrivals=3),  # query: three TMA copies (2 NoPE halves + RoPE)
      plgpu.Barrier(num_arrivals=3, num_barriers=NUM_STAGES),  # key stage loaded, likewise
      plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),  # stage free: both consumers
      plgpu.Barrier(num_arrivals=2),  # both consumers done with the query
      shared_barrier,
  )
  kernel = functools.partial(
      _decode_kernel, plgpu=plgpu, batch=b, s_q=s_q, h_q=h_q, num_blocks=num_blocks,
      num_splits=num_splits, causal=causal, scale=sm_scale * LOG2E,
      registers=(config.consumer_registers, config.producer_registers))

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                  barriers, collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((num_splits, rows, D_NOPE), jnp.bfloat16),
              jax.ShapeDtypeStruct((num_splits, rows), jnp.float32))
  out, lse = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): out_type},
      # The row tiles of one request are adjacent in launch order (the last grid axis
      # is blockIdx.x): they read the same cache blocks, which L2 then serves once.
      grid=(b, num_splits, tiles), grid_names=("b", "s", "t"), num_threads=3,
      thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
  )(seq, block_table, q.reshape(rows, D_QK), kv_cache.reshape(-1, D_QK), tail)
  if num_splits == 1:
    out, lse = out[0], jnp.where(lse[0] == -jnp.inf, jnp.inf, lse[0])
  else:  # bf16 partials (they are staged in the query's SMEM), float32 merge
    out, lse = combine_splits(out, lse, jnp.bfloat16)
  return out.reshape(b, s_q, h_q, D_NOPE), lse.reshape(b, s_q, h_q)
