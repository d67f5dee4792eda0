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
  in pairs, FlashMLA's split: each computes ``S = Q K^T`` of one stage of the pair
  (64 x 64, over 512 NoPE + 64 RoPE columns) and its online softmax in base 2, and
  each multiplies both stages' ``P`` by its half of ``V`` (the first 512 columns of
  the same latent rows), the other's ``P`` through SMEM
  (:func:`jax_mla._mosaic.consume_pairs`). Each half of a stage has its own
  barriers, so a half is refilled as soon as its one reader is done.

Unwritten cache slots may hold NaN, and ``0 * NaN`` is NaN, so none reaches the
products: the producer loads a request's partial last block onto its own barrier,
waits for it and zeroes the rows past the sequence in shared memory before it
hands the stage over (:func:`_zero_rows`); an invalid block id loads nothing and
hands over a zeroed stage. Their scores are masked to ``-inf`` as well. (Before, an
XLA pass copied every request's last block, zero-padded, ahead of the kernel: 24-35 us
a call at b 128-132; without it the rows ran 1-2% faster on an H100.)

On an H100 (jax 0.11.2) the b128 s_q1 h128 seqlen-4096 row ran at 350-370 TFLOP/s
(the Triton kernel: 153-157), and at 426-440 on 2026-11-25. Tried and dropped, as they
timed the same within noise: FlashAttention-3 ping-pong ordering of the two consumers,
and masking only the blocks that need it (a uniform ``lax.cond``). Splitting
KV for that row (512 CTAs) was 5% slower. Computing ``S`` once and sharing ``P``
through SMEM (FlashMLA's split; before, both consumers computed ``S``, a third of the
tensor-core work) took that row from 400 to 369-388 us (2026-11-23); the pair split
with per-half barriers took it from 331-333 to 315-320 us and the b64 s_q2 row from
597-602 to 553-558 us, and the query's RoPE columns kept in SMEM (not registers) to
307-316 and 541-551 us (2026-11-26). What the consumers wait for most is the refill of
the two halves the pair loop frees last (slot 0's half 1, slot 1's half 0): without
those loads the b128 row ran 257 against 311 us. All slower (RESULTS.md, session 33): L2
prefetch of whole blocks; per-64-column barriers, by 1 KiB TMAs (Pallas' per-copy
arrivals) or chunk-major halves (register spills); consumer-issued refills of those
halves (spills). With 64-row tiles the producer's first thread issues a half's TMA
copies onto a hand-rolled mbarrier (one arrival a phase; :func:`_load_half`): a Pallas
copy arrives from all 128 threads of the warpgroup, and that took 274 ns from the
producer's wake-up to the issue of a half. The b128 row went from 314.7 to 307.4 us,
the b64 s_q 2 row from 529.6 to 511.7 (session 34). Also measured there: L2
prefetching of the late halves or whole blocks (slower), and the late halves issued by
the consumers that free them, onto the same mbarriers (no faster than the producer).

A request with at most 32 query rows (tensor parallelism leaves 8, 16 or 32 heads a
GPU) takes the transposed form of the sparse kernels' loop, in which the consumers take
the stages in turns (:func:`jax_mla._mosaic.consume_stages`), as the sparse kernel for
such head counts does (:mod:`jax_mla.sparse_mla.mosaic_transposed`): one CTA puts its 16 or 32
rows on wgmma's N side and the 64 keys of a block on M, ``S^T = K Q^T`` and ``O^T +=
V^T P^T``, so no tensor-core row is spent on padding. More rows take 64-row tiles, the
last one padded (:func:`row_tiles`). A tile may hold rows of several query tokens,
also with ``causal``: each row is masked at its own token's length.

Shapes: the cache block size 64, everything bf16. Other shapes belong to the Triton
kernel (``implementation="triton"``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _inline, _mosaic, merge_mosaic
from jax_mla._common import (
  D_NOPE,
  D_QK,
  D_ROPE,
  LN2,
  LOG2E,
  cdiv,
  check_num_splits,
  with_num_splits,
)

BLOCK_M = 64  # query rows per CTA: one wgmma M
PAGE = 64  # keys per pipeline step: one cache block
HALF = D_NOPE // 2  # output columns per consumer warpgroup (wgmma N <= 256)
NUM_STAGES = 2  # 72 KiB query + 2 x 72 KiB key stages fill the 227 KiB of SMEM


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Mosaic GPU decode kernel (static; changes no result beyond rounding).

  Attributes:
    num_splits: KV splits per row tile; ``None`` picks :func:`jax_mla._mosaic.default_num_splits`.
    consumer_registers, producer_registers: per-thread registers of each consumer
      warpgroup and of the producer (``setmaxnreg``: multiples of 8, and
      ``2 * consumer + producer == 504``, :func:`jax_mla._mosaic.register_budget` of three
      warpgroups: a split that asks for more hangs the kernel).
      The consumers hold a 64 x 256 float32 accumulator each.
  """
  num_splits: int | None = None
  consumer_registers: int = 232
  producer_registers: int = 40

  def __post_init__(self):
    check_num_splits("Config.num_splits", self.num_splits)
    _mosaic.check_register_split(self.consumer_registers, self.producer_registers)


def _decode_kernel(seq_ref, bt_ref, q_ref, kv_ref, o_ref, lse_ref, smem, barriers, *,
                   plgpu, s_q, h_q, tiles, num_blocks, num_splits, causal, scale, registers):
  """One CTA: a row tile of request ``b`` and KV split ``s``. Without splits the LSE
  leaves in FlashMLA's ``[b, h_q, s_q]`` (``lse_ref``), one row per thread; with them,
  each split's LSE leaves as its tile's row of floats for the combine."""
  q_nope, q_rope, kv_nope, kv_rope, p_t, lse_smem, words, p_stats = smem
  kept_rows = words.at[pl.ds(0, 1)]
  # 64-row tiles: the ring halves' "loaded" mbarriers, then a partial block's halves'
  mbarriers = words.at[pl.ds(_LOADED_WORD, 2 * _MBARRIERS)]
  mbarrier = lambda k: mbarriers.at[pl.ds(2 * k, 2)]  # noqa: E731
  if lse_smem is None:  # 64-row tiles: consume_pairs leaves this row free for the LSE
    lse_smem = p_stats.at[0]
  q_bar, ready, free, done_bar, tail_bar, p_ready = barriers
  rows = q_nope.shape[1]  # of this tile: 64, or at most 32 transposed
  transposed = rows != BLOCK_M
  # 64-row tiles: the query's RoPE tile is the third of consume_pairs' four RoPE
  # tiles; transposed, it has its own.
  q_rope_tile = (lambda: q_rope) if transposed else (lambda: kv_rope.at[NUM_STAGES])
  bi = lax.axis_index("b")
  split = lax.axis_index("s")
  tile = lax.axis_index("t")
  wg = lax.axis_index("wg")
  first_row = tile * rows  # within the request, whose rows are (token, head) pairs
  r0 = (bi * tiles + tile) * rows

  seq = jnp.clip(seq_ref[bi], 0, bt_ref.shape[1] * PAGE)  # what the block table holds

  def limit(token):  # keys a query token sees
    if not causal:
      return seq
    return jnp.minimum(jnp.maximum(seq - (s_q - 1) + token, 0), seq)

  # The tile's last token sees the most keys (padding rows count as the last token).
  lim = limit(jnp.minimum(lax.div(first_row + rows - 1, h_q), s_q - 1))
  n_total = lax.div(lim + (PAGE - 1), PAGE)
  chunk = lax.div(n_total + (num_splits - 1), num_splits)
  blk0 = split * chunk
  steps = jnp.minimum(jnp.maximum(n_total - blk0, 0), chunk)
  # With causal, rows of different tokens see different keys: a row's own limit.
  per_row = causal and s_q > 1 and h_q % rows != 0
  least_limit = limit(lax.div(first_row, h_q)) if per_row else lim  # the tile's first token's

  if not transposed:
    _mosaic.init_mbarriers(plgpu, mbarriers, count=_MBARRIERS, arrivals=1)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(registers[0], action="increase")
    s_shape, key_axis = ((PAGE, rows), 0) if transposed else ((rows, PAGE), 1)

    def iota(axis):  # S's indices along `axis`, as a vector (half the registers of a tile)
      layout = _mosaic.col_layout if axis == 1 else _mosaic.row_layout
      return plgpu.broadcasted_iota(jnp.int32, (s_shape[axis],), 0, layout=layout(plgpu))

    def mask(i, slot):
      del slot
      blk = blk0 + i
      pg = bt_ref[bi, blk]
      # An invalid block id shifts every limit below 0: no key of the block is seen.
      base = jnp.where((pg >= 0) & (pg < num_blocks), blk * PAGE, 1 << 30)

      def key_limits():  # the keys' indices and the rows' key limits (vectors or scalar)
        key = iota(key_axis)
        if not per_row:
          return key, lim
        # Token of each row: the first row's, plus one per token boundary crossed (a
        # tile of `rows` rows crosses at most (h_q + rows - 2) // h_q of them).
        row = iota(1 - key_axis) + first_row
        token0 = lax.div(first_row, h_q)
        token = token0
        for j in range(1, (h_q + rows - 2) // h_q + 1):
          token = token + jnp.where(row >= (token0 + j) * h_q, 1, 0)
        return key, limit(token)

      def apply(s, limits):
        key, row_lim = limits
        if per_row:
          row_lim = lax.broadcast_in_dim(row_lim, s.shape, [1 - key_axis])
        key = lax.broadcast_in_dim(key, s.shape, [key_axis])
        return jnp.where(key < row_lim - base, s, -jnp.inf)

      if transposed:
        limits = key_limits()
        return lambda s: apply(s, limits)
      # 64-row tiles: made after the scores' wait, not held across it, and only for a
      # block some row does not see whole (its last): with the key indices in every
      # step, ptxas spilled 472 bytes a thread in consume_pairs (RESULTS.md, session 29).
      return lambda s: lax.cond(least_limit - base >= PAGE, lambda s: s,
                                lambda s: apply(s, key_limits()), s)

    consume = dict(wg=wg, q_main=q_nope, k_main=kv_nope, steps=steps, mask=mask, scale=scale)
    if transposed:
      acc, m, l = _mosaic.consume_stages(
          plgpu, q_rope=q_rope, k_rope=kv_rope, p_t=p_t, shared=(p_stats, p_ready), barriers=(
              q_bar, *_mosaic.stage_barriers(plgpu, ready, free), done_bar), **consume)
    else:
      def wait_loaded(i, slot, half):  # stage i is the slot's (i // 2)-th fill
        _mosaic.wait_parity(plgpu, mbarrier(_mosaic.half_part(slot, half)),
                            lax.rem(lax.div(i, NUM_STAGES), 2))

      def release(slot, half):
        plgpu.barrier_arrive(free.at[_mosaic.half_part(slot, half)])

      acc, m, l = _mosaic.consume_pairs(plgpu, rope=kv_rope, shared=p_stats, barriers=(
          q_bar, wait_loaded, release), **consume)

    # Both consumers are done with Q: its NoPE halves become the output staging.
    empty, l_safe = _mosaic.empty_rows(l)
    inv = jnp.where(empty, 0.0, 1.0 / l_safe)
    o = (acc * lax.broadcast_in_dim(inv, acc.shape, [int(transposed)])).astype(q_nope.dtype)
    if transposed:  # O^T stored as O
      q_nope.at[wg].transpose((1, 0))[...] = plgpu.layout_cast(
          o, plgpu.Layout.WGMMA_TRANSPOSED)
    else:
      q_nope.at[wg][...] = o

    @pl.when(wg == 0)
    def _():
      # A row with no key: lse +inf (FlashMLA's convention; the combine reads it as empty).
      lse_smem.at[pl.ds(0, rows)][...] = jnp.where(empty, jnp.inf, m * LN2 + jnp.log(l_safe))

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_nope.at[wg],
                            o_ref.at[split, pl.ds(r0, rows), pl.ds(wg * HALF, HALF)])

    @pl.when(wg == 0)
    def _():
      if num_splits == 1:
        _mosaic.store_lse_rows(plgpu, lse_smem, lse_ref.at[bi], first_row, count=rows)
      else:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, bi * tiles + tile])

    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(registers[1], action="decrease")
    q_rows = pl.ds(r0, rows)
    for h in range(2):
      plgpu.copy_gmem_to_smem(q_ref.at[q_rows, pl.ds(h * HALF, HALF)], q_nope.at[h], q_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows, pl.ds(D_NOPE, D_ROPE)], q_rope_tile(), q_bar)
    swizzled = plgpu.RefType(_mosaic.swizzled(plgpu))
    # The ring's barriers guard whole stages (transposed: both consumers read all of
    # one) or halves (64-row tiles: each half has one reader, see consume_pairs).
    parts = 1 if transposed else 2
    zero_rows = [plgpu.inline_mgpu(arg_types=(plgpu.RefType(), swizzled, swizzled))(
        functools.partial(_zero_rows, halves=2 // parts, rope=parts == 1 or part == 1))
                 for part in range(parts)]

    tma_half = [plgpu.inline_mgpu(arg_types=(plgpu.RefType(), swizzled, swizzled, plgpu.RefType(),
                                             _mosaic.scalar_arg(plgpu)))(
        functools.partial(_load_half, half=h)) for h in range(2)]
    arrive = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_arrive)

    def load_part(i, part):
      """Part ``part`` of stage ``i`` into its slot once its readers have freed it: the
      whole stage, or half ``part`` of the main columns (half 1 with the RoPE tile)."""
      slot = lax.rem(i, NUM_STAGES)
      bar = slot if parts == 1 else _mosaic.half_part(slot, part)

      blk = blk0 + i
      pg = bt_ref[bi, blk]  # read before the wait for the slot, which hides its latency
      # Rows of the block inside the sequence; 0 for an invalid block id.
      kept = jnp.where((pg >= 0) & (pg < num_blocks), jnp.minimum(seq - blk * PAGE, PAGE), 0)

      @pl.when(i >= NUM_STAGES)
      def _():
        plgpu.barrier_wait(free.at[bar])

      def load(barrier):  # transposed: the whole stage, _STAGE_COPIES copies
        src_rows = pl.ds(pg * PAGE, PAGE)
        for h in range(2):
          plgpu.copy_gmem_to_smem(kv_ref.at[src_rows, pl.ds(h * HALF, HALF)],
                                  kv_nope.at[slot, h], barrier)
        plgpu.copy_gmem_to_smem(kv_ref.at[src_rows, pl.ds(D_NOPE, D_ROPE)], kv_rope.at[slot],
                                barrier)

      def load_half(mbar):  # 64-row tiles
        tma_half[part](kv_ref, kv_nope.at[slot, part], kv_rope.at[slot], mbar, pg)

      if parts == 1:
        pl.when(kept == PAGE)(lambda: load(ready.at[bar]))
      else:
        pl.when(kept == PAGE)(lambda: load_half(mbarrier(bar)))

      @pl.when(kept < PAGE)
      def _():
        @pl.when(kept > 0)
        def _():
          if parts == 1:
            load(tail_bar)
            plgpu.barrier_wait(tail_bar)
          else:  # a sequence has one partial block: each half's barrier is used once
            load_half(mbarrier(_LOADED_BARRIERS + part))
            _mosaic.wait_parity(plgpu, mbarrier(_LOADED_BARRIERS + part), 0)

        kept_rows[...] = jnp.full((1,), kept, jnp.int32)
        zero_rows[part](kept_rows, kv_nope.at[slot] if parts == 1 else kv_nope.at[slot, part],
                        kv_rope.at[slot])
        plgpu.commit_smem()  # the zeros are read by wgmma (the async proxy)
        if parts == 1:
          for _ in range(_STAGE_COPIES):
            plgpu.barrier_arrive(ready.at[bar])
        else:
          arrive(mbarrier(bar))

    if transposed:
      pl.loop(0, steps)(lambda i: load_part(i, 0))
    else:  # halves in the order consume_pairs frees them
      @pl.loop(0, lax.div(steps + 1, 2))
      def _(k):
        stages = 2 * k, 2 * k + 1
        for j, h in _mosaic.PAIR_FILL_ORDER:
          if j == 0:  # stage 2k exists; 2k + 1 may not
            load_part(stages[j], h)
          else:
            pl.when(stages[j] < steps)(functools.partial(load_part, stages[j], h))


# 64-row tiles: the ring halves' "loaded" mbarriers (one per half, _mosaic.half_part),
# then one per half of a partial block (a sequence has one, so each is used once), in the
# words after the kept-rows count. One arrival a phase: one producer thread arms a half
# with its bytes and issues its TMA copies. A Pallas copy arrives from all 128 threads of
# the warpgroup, and a half's refill took 274 ns from the producer's wake-up to its TMA
# issue, on the consumers' path for the halves they free last (RESULTS.md, session 34).
_LOADED_WORD = 8  # 8-byte aligned
_LOADED_BARRIERS = 2 * NUM_STAGES
_MBARRIERS = _LOADED_BARRIERS + 2
# Transposed tiles: the arrivals that complete a stage's Pallas barrier, the producer's
# copies (two NoPE halves and the RoPE tile) or its arrivals for a zeroed stage.
_STAGE_COPIES = 3


def _arrive(ctx, bar_ref):
  """One arrival (the producer's first thread) on a hand-rolled mbarrier."""
  del ctx
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  _inline.asm(_inline.void(), "{.reg .b64 s; @$1 mbarrier.arrive.shared::cta.b64 s, [$0];}",
              "r,b", mgpu_utils.memref_ptr(bar_ref), _inline.warpgroup_leader(), effects=True)


def _load_half(ctx, kv_ref, nope_ref, rope_ref, bar_ref, block, *, half):
  """Half ``half`` of cache block ``block`` (half 1 with the RoPE tile) into its ring
  slot: the warpgroup's first thread arms the hand-rolled mbarrier ``bar_ref`` with the
  bytes and issues the TMA copies onto it.

  Every copy of the cache in a 64-row kernel goes through here: on jax 0.11.2 a Pallas
  copy of the same window in the same kernel reused this TMA descriptor and failed
  Mosaic GPU's verification (a shared-memory pointer where a generic one belongs)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  leader = _inline.warpgroup_leader()
  copies = [(nope_ref, half * HALF, HALF)] + ([(rope_ref, D_NOPE, D_ROPE)] if half == 1 else [])
  nbytes = sum(PAGE * width * 2 for _, _, width in copies)
  bar = mgpu_utils.memref_ptr(bar_ref)
  _inline.asm(_inline.void(), "{.reg .b64 s; @$1 mbarrier.arrive.expect_tx.shared::cta.b64 s, "
              f"[$0], {nbytes};}}", "r,b", bar, leader, effects=True)
  barrier = mgpu.BarrierRef(base_address=bar, offset=_inline.const(0), phases=None,
                            num_barriers=1)
  row = arith.index_cast(ir.IndexType.get(),
                         arith.muli(block.registers.item(), _inline.const(PAGE)))
  for dst, col, width in copies:  # swizzled()'s tiles
    ctx.async_copy(src_ref=kv_ref, dst_ref=dst,
                   gmem_slice=(mgpu.ds(row, PAGE), mgpu.ds(col, width)),
                   gmem_transform=mgpu.TileTransform((8, 64)), swizzle=128, barrier=barrier,
                   arrive=False, predicate=leader)


def _zero_rows(ctx, kept_ref, nope_ref, rope_ref, *, halves: int, rope: bool):
  """Zeroes rows ``kept_ref[0]`` .. 63 of a key stage or a half of one (inline Mosaic
  GPU): the main columns (``halves`` of ``[64, 256]``) and, with ``rope``, the ``[64,
  64]`` RoPE tile, bf16 in 8-row x 128-byte swizzled tiles. The swizzle only permutes
  the 16-byte pieces of a 128-byte tile row, so a whole zeroed tile row is zero in any
  order. Thread ``t`` zeroes piece ``t % 8`` of rows ``t // 8 + 16 k`` in each column
  tile."""
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  i32, i8 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
  c32 = lambda v: mgpu.c(v, i32)  # noqa: E731
  tid = _inline.warpgroup_thread()
  kept = memref.load(kept_ref, [mgpu.c(0, ir.IndexType.get())])
  piece = arith.muli(arith.andi(tid, c32(7)), c32(16))
  nope = mgpu_utils.memref_ptr(nope_ref)
  rope_base = mgpu_utils.memref_ptr(rope_ref)
  tiles_per_half = HALF // 64
  for k in range(PAGE // 16):
    row = arith.addi(arith.shrui(tid, c32(3)), c32(16 * k))
    in_tile = arith.addi(arith.muli(arith.andi(row, c32(7)), c32(128)), piece)
    tile_row = arith.shrui(row, c32(3))
    offsets = [(nope, arith.addi(arith.muli(tile_row, c32(tiles_per_half * 1024)),
                                 c32(h * PAGE * HALF * 2 + c * 1024)))
               for h in range(halves) for c in range(tiles_per_half)]
    if rope:
      offsets.append((rope_base, arith.muli(tile_row, c32(1024))))
    zero = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.sge, row, kept))
    for base, off in offsets:
      at = mgpu_utils.getelementptr(base, [arith.addi(off, in_tile)], i8)
      llvm.inline_asm(ir.Type.parse("!llvm.void"), [at, zero],
                      "{.reg .pred p; setp.ne.b32 p, $1, 0; "
                      "@p st.shared.v4.b32 [$0], {0, 0, 0, 0};}", "r,r", has_side_effects=True)


def row_tiles(s_q: int, h_q: int) -> tuple[int, int]:
  """``(tiles, rows_per_tile)`` over a request's ``s_q * h_q`` query rows: at most 32
  rows take one transposed tile (16 or 32 rows); more take 64-row tiles, the last one
  padded with zero queries. Every tile reads the whole sequence, so fewer tiles read
  less (H100, b 132 L 8192: 48 heads in two transposed tiles ran at 2.05 TB/s, 16 and
  32 heads in one at 2.78-2.80)."""
  rows = s_q * h_q
  if rows <= _mosaic.TRANSPOSED_MAX_ROWS:
    return _mosaic.transposed_tiles(rows)
  return cdiv(rows, BLOCK_M), BLOCK_M


def check_supported(q, kv_cache, *, causal):
  """Raises ``ValueError`` for shapes this kernel does not take (the Triton one does)."""
  del q, causal
  if kv_cache.shape[1] != PAGE:
    raise ValueError(f"the Mosaic GPU dense-decode kernel needs cache block size {PAGE} (got "
                     f"{kv_cache.shape[1]}); use implementation='triton' for this shape")


def with_defaults(config: Config | None, *, num_kv_splits: int | None, batch: int, s_q: int,
                  h_q: int, max_blocks: int) -> Config:
  """``config`` (``None``: the defaults) with ``num_splits`` set: the op's
  ``num_kv_splits`` when given, else the config's, else
  :func:`jax_mla._mosaic.default_num_splits`."""
  return with_num_splits(config or Config(), num_kv_splits, lambda: _mosaic.default_num_splits(
      batch * row_tiles(s_q, h_q)[0], max_blocks))


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "config"))
def paged_decode(q, kv_cache, block_table, cache_seqlens, *, sm_scale, causal, config: Config):
  """Runs the kernel; inputs validated by :func:`jax_mla.dense_decode.mla_decode_paged`
  and :func:`check_supported`, ``config.num_splits`` set. Returns ``(out [b, s_q, h_q,
  512] bf16, lse f32[b, h_q, s_q])``, the LSE in FlashMLA's layout."""
  plgpu = _mosaic.plgpu()
  num_splits = config.num_splits
  b, s_q, h_q, _ = q.shape
  num_blocks = kv_cache.shape[0]
  tiles, rows = row_tiles(s_q, h_q)
  q_rows = s_q * h_q
  padded = tiles * rows  # a request's rows with the last tile's zero padding
  q = jnp.pad(q.reshape(b, q_rows, D_QK), ((0, 0), (0, padded - q_rows), (0, 0)))

  swizzled = _mosaic.swizzled(plgpu)
  transposed = rows != BLOCK_M
  # consume_pairs hands off through named barriers: it takes no mbarriers of its own.
  shared_smem, shared_barrier = (_mosaic.shared_scratch(plgpu, rows, NUM_STAGES) if transposed
                                 else (_mosaic.pair_scratch(plgpu, rows), None))
  vector_row = max(rows, _mosaic.MIN_VECTOR_ROW)
  smem = (
      plgpu.SMEM((2, rows, HALF), jnp.bfloat16, transforms=swizzled),
      # Transposed: the query's RoPE tile, and P^T of each stage; 64-row tiles: both
      # are among the four RoPE tiles (see consume_pairs).
      plgpu.SMEM((rows, D_ROPE), jnp.bfloat16, transforms=swizzled) if transposed else None,
      plgpu.SMEM((NUM_STAGES, 2, PAGE, HALF), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((NUM_STAGES + (0 if transposed else 2), PAGE, D_ROPE), jnp.bfloat16,
                 transforms=swizzled),
      (plgpu.SMEM((NUM_STAGES, rows, PAGE), jnp.bfloat16, transforms=swizzled)
       if transposed else None),
      plgpu.SMEM((vector_row,), jnp.float32) if transposed else None,  # the LSE
      # rows kept in a partial block; 64-row tiles: then the ring's "loaded" mbarriers
      plgpu.SMEM((_LOADED_WORD + 2 * _MBARRIERS,), jnp.int32),
      shared_smem,
  )
  parts = NUM_STAGES * (1 if transposed else 2)  # ring parts with their own barriers
  barriers = (
      plgpu.Barrier(num_arrivals=3),  # query: three TMA copies (2 NoPE halves + RoPE)
      # a part loaded (64-row tiles: the mbarriers in the kernel's words)
      plgpu.Barrier(num_arrivals=_STAGE_COPIES, num_barriers=parts) if transposed else None,
      # A part free: both consumers read a whole stage, one reads a half.
      plgpu.Barrier(num_arrivals=2 if transposed else 1, num_barriers=parts),
      plgpu.Barrier(num_arrivals=2) if transposed else None,  # both consumers done with Q
      plgpu.Barrier(num_arrivals=_STAGE_COPIES) if transposed else None,  # a partial stage
      shared_barrier,
  )
  kernel = functools.partial(
      _decode_kernel, plgpu=plgpu, s_q=s_q, h_q=h_q, tiles=tiles,
      num_blocks=num_blocks, num_splits=num_splits, causal=causal, scale=sm_scale * LOG2E,
      registers=(config.consumer_registers, config.producer_registers))

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                  barriers, collective_axes="wg")

  out_type = (jax.ShapeDtypeStruct((num_splits, b * padded, D_NOPE), jnp.bfloat16),
              jax.ShapeDtypeStruct((b, h_q, s_q) if num_splits == 1
                                   else (num_splits, b * tiles, vector_row), jnp.float32))
  out, lse = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): out_type},
      # The row tiles of one request are adjacent in launch order (the last grid axis
      # is blockIdx.x): they read the same cache blocks, which L2 then serves once.
      grid=(b, num_splits, tiles), grid_names=("b", "s", "t"), num_threads=3,
      thread_name="wg", compiler_params=plgpu.CompilerParams(
          # The 64-row loop reduces rows within warps; Pallas' 2 KiB reserve for
          # cross-warp reductions would leave no room for the four RoPE tiles.
          approx_math=True, **({} if transposed else {"reduction_scratch_bytes": 0})),
  )(cache_seqlens, block_table, q.reshape(b * padded, D_QK), kv_cache.reshape(-1, D_QK))
  if num_splits == 1:  # the LSE is FlashMLA's [b, h_q, s_q] already
    out = out[0]
  else:  # bf16 partials (they are staged in the query's SMEM), float32 merge; the
    # combine reads the padded LSE rows as they are (no slice copies between kernels)
    out, _, lse = merge_mosaic.combine(out, lse, lse, None, heads=1)
    lse = lse.reshape(b, padded)[:, :q_rows].reshape(b, s_q, h_q).transpose(0, 2, 1)
  out = out.reshape(b, padded, D_NOPE)[:, :q_rows]
  return out.reshape(b, s_q, h_q, D_NOPE), lse
