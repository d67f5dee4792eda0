"""Shared pieces of the Pallas Mosaic GPU (Hopper) kernels.

The Mosaic GPU modules import absl and only lower for CUDA, so they are imported
on use, never at package import.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _inline, _softmax
from jax_mla._common import LN2, LOG2E, cdiv, num_sms, runs_on_gpu

# The transposed kernels (keys on wgmma's M side, query rows on N): the rows of a CTA.
TRANSPOSED_MAX_ROWS = 32  # each consumer's accumulator is 256 x rows float32
TRANSPOSED_ROW_ALIGN = 16  # rows per CTA are a multiple of this (wgmma N)
# Per-row float32 vectors cross between SMEM and GMEM in rows of at least 32 (TMA copies
# by a warpgroup move a multiple of 128 bytes).
MIN_VECTOR_ROW = 32


def plgpu():
  """``jax.experimental.pallas.mosaic_gpu``, imported on use."""
  from jax.experimental.pallas import mosaic_gpu
  return mosaic_gpu


def swizzled(plgpu_mod):
  """The transforms of a 2-byte (bf16/fp16) SMEM tile in the 128-byte-swizzled wgmma
  layout: 8-row x 64-column (128-byte) tiles."""
  return (plgpu_mod.TilingTransform((8, 64)), plgpu_mod.SwizzleTransform(128))


def row_layout(plgpu_mod):
  """Layout of a per-row vector reduced from a WGMMA-layout tile (name varies by jax)."""
  wgmma = plgpu_mod.Layout.WGMMA
  return wgmma.reduce(1) if hasattr(wgmma, "reduce") else plgpu_mod.Layout.WGMMA_ROW


def col_layout(plgpu_mod):
  """Layout of a per-column vector of a WGMMA-layout tile (name varies by jax)."""
  wgmma = plgpu_mod.Layout.WGMMA
  return wgmma.reduce(0) if hasattr(wgmma, "reduce") else plgpu_mod.Layout.WGMMA_COL


def out_type_kwarg(plgpu_mod) -> str:
  """``plgpu.kernel``'s output-shape keyword (renamed across jax versions)."""
  params = inspect.signature(plgpu_mod.kernel).parameters
  return "out_type" if "out_type" in params else "out_shape"


def register_share(warpgroups: int) -> int:
  """Registers per thread each warpgroup starts with: an equal share of the SM's 64K
  (168 with three warpgroups, 128 with four); ``setmaxnreg`` then moves registers
  between them: a target above the share increases, below it decreases."""
  return 65536 // (128 * warpgroups) // 8 * 8


def register_budget(warpgroups: int) -> int:
  """The registers per thread that the ``setmaxnreg`` targets of a kernel's
  ``warpgroups`` must total: each starts with :func:`register_share` and setmaxnreg only
  moves registers between them, so an increase that the decreases do not cover waits
  forever (the kernel hangs)."""
  return warpgroups * register_share(warpgroups)


def check_register_split(consumer: int, producer: int) -> None:
  """Raises ``ValueError`` unless ``consumer`` and ``producer`` registers a thread suit a
  kernel of two consumer warpgroups and one producer: multiples of 8 with ``24 <=
  producer <= consumer <= 256`` and ``2 * consumer + producer ==``
  :func:`register_budget` of three warpgroups."""
  budget = register_budget(3)
  c, p = consumer, producer
  if c % 8 or p % 8 or not 24 <= p <= c <= 256 or 2 * c + p != budget:
    raise ValueError("Config register split must be multiples of 8 with 24 <= producer <= "
                     f"consumer <= 256 and 2 * consumer + producer == {budget} (or the "
                     f"kernel hangs); got {c}, {p}")


def set_registers(plgpu_mod, registers: int, warpgroups: int) -> None:
  """``setmaxnreg`` to ``registers`` in a kernel of ``warpgroups`` (the direction is
  relative to :func:`register_share`; ptxas rejects a "decrease" that increases)."""
  share = register_share(warpgroups)
  if registers != share:
    plgpu_mod.set_max_registers(registers, action="increase" if registers > share else "decrease")


def cluster_sync(plgpu_mod) -> None:
  """Every thread of every CTA of the cluster waits here for all the others (call
  where all of a kernel's warpgroups run, e.g. its end: a CTA must not exit while a
  peer may still store into its shared memory or arrive on its barriers)."""
  plgpu_mod.inline_mgpu()(_cluster_sync)()


def _cluster_sync(ctx):
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  llvm.inline_asm(ir.Type.parse("!llvm.void"), [],
                  "barrier.cluster.arrive; barrier.cluster.wait;", "",
                  has_side_effects=True)


def scalar_arg(plgpu_mod):
  """The ``inline_mgpu`` argument type of a traced int32 scalar (read in the body as
  ``arg.registers.item()``)."""
  return plgpu_mod.Layout.WG_SPLAT(shape=())


def init_mbarriers(plgpu_mod, ref, count: int, arrivals: int) -> None:
  """Initialises ``count`` hand-rolled mbarriers (8 bytes each from ``ref``'s first, in
  SMEM, ``arrivals`` arrivals a phase) from the CTA's first thread, then waits for every
  thread (call in every warpgroup, before the roles split). Kernels keep them in spare
  words of an SMEM allocation they have anyway (each allocation takes a 1 KiB block)."""

  def body(ctx, bar_ref):
    del ctx
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    inits = " ".join(f"@p mbarrier.init.shared::cta.b64 [$0+{8 * k}], {arrivals};"
                     for k in range(count))
    _inline.asm(_inline.void(), "{.reg .pred p; setp.eq.u32 p, $1, 0; " + inits +
                " fence.mbarrier_init.release.cluster;}", "r,r", mgpu_utils.memref_ptr(bar_ref),
                mgpu.thread_idx(), effects=True)

  plgpu_mod.inline_mgpu(arg_types=(plgpu_mod.RefType(),))(body)(ref)
  cluster_sync(plgpu_mod)


def wait_parity(plgpu_mod, bar_ref, parity) -> None:
  """Every thread of the warpgroup waits for phase ``parity`` (0 or 1: a Python int, or a
  traced int32) of the hand-rolled mbarrier at ``bar_ref``'s first byte
  (:func:`init_mbarriers`)."""
  static = isinstance(parity, int)

  def body(ctx, ref, *traced):
    del ctx
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    operand, constraints, args = ((parity, "r", ()) if static else
                                  ("$1", "r,r", (traced[0].registers.item(),)))
    _inline.asm(_inline.void(), "{.reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64"
                f" done, [$0], {operand}; @!done bra WAIT;}}", constraints,
                mgpu_utils.memref_ptr(ref), *args, effects=True)

  arg_types = (plgpu_mod.RefType(),) + (() if static else (scalar_arg(plgpu_mod),))
  plgpu_mod.inline_mgpu(arg_types=arg_types)(body)(bar_ref, *(() if static else (parity,)))


def transposed_tiles(rows: int) -> tuple[int, int]:
  """``(tiles, rows_per_tile)`` of a transposed kernel: the fewest tiles of at most 32
  rows covering ``rows``, each a multiple of 16 (the last tile's padding rows are zero
  queries)."""
  tiles = cdiv(rows, TRANSPOSED_MAX_ROWS)
  return tiles, cdiv(cdiv(rows, tiles), TRANSPOSED_ROW_ALIGN) * TRANSPOSED_ROW_ALIGN


def on_hopper() -> bool:
  """Whether ``implementation=None`` may pick a Mosaic GPU kernel: a Hopper GPU, a jax
  the kernels were checked on (0.11), and Mosaic GPU importable."""
  if jax.__version_info__ < (0, 11) or jax.default_backend() != "gpu":
    return False
  if getattr(jax.devices()[0], "compute_capability", "").split(".")[0] != "9":
    return False
  try:
    plgpu()
  except ImportError:
    return False
  return True


def default_for(check, *args, **kwargs) -> bool:
  """Whether ``implementation=None`` runs a Mosaic GPU kernel: :func:`on_hopper`, the
  first of ``args`` (the op's first array) lives on the GPU, and ``check(*args,
  **kwargs)`` (the kernel's ``ValueError``-raising shape check) passes."""
  if not on_hopper() or (args and not runs_on_gpu(args[0])):
    return False
  try:
    check(*args, **kwargs)
  except ValueError:
    return False
  return True


def shared_scratch(plgpu_mod, rows: int, num_stages: int):
  """What :func:`consume_stages` passes between its two warpgroups besides ``P``, for a
  kernel's ``run_scoped``: float32 ``[num_stages + 6, rows]`` SMEM (each ring slot's
  rescale factor; the running row max each warpgroup published last; each warpgroup's
  partial row sum and the max it is relative to) and ``num_stages + 4`` barriers (one
  "``P`` ready" per slot, one "max published" per warpgroup, then one per warpgroup
  that orders its own first stores before its loads)."""
  return (plgpu_mod.SMEM((num_stages + 6, rows), jnp.float32),
          plgpu_mod.Barrier(num_arrivals=1, num_barriers=num_stages + 4))


# A CTA's fixed cost (query load, pipeline fill, epilogue, its share of the combine) in
# cache blocks, as FlashMLA's scheduler charges it (``fixed_overhead_num_blocks``).
SPLIT_OVERHEAD_BLOCKS = 5


def default_num_splits(num_tiles: int, max_blocks: int, min_blocks: int = 4) -> int:
  """KV splits for ``num_tiles`` CTAs' worth of rows over ``max_blocks`` key blocks (the
  split-KV decode kernels: dense cache blocks, sparse 64-key steps): the count
  that minimises waves x (blocks per split + a CTA's fixed cost), one CTA per SM, each
  split keeping >= ``min_blocks`` blocks; the fewest on a tie. (64 tiles on 132 SMs: 2
  splits, one wave, where filling the SMs with 3 took two.)"""
  sms = num_sms()
  if num_tiles >= sms:
    return 1
  limit = max(1, min(max_blocks // min_blocks, 64))
  return min(range(1, limit + 1), key=lambda s: (
      cdiv(num_tiles * s, sms) * (max_blocks / s + SPLIT_OVERHEAD_BLOCKS), s))


def opaque_zero(i):
  """0 for every int32 ``i`` (``i (i + 1)`` is even, wrapped or not), in a form the
  compiler does not fold here: an offset that keeps a loop-invariant address inside the
  loop. Not everywhere: with ``consume_pairs`` inside a persistent CTA's items loop, LLVM
  folded it and built every wgmma descriptor before that loop (1000 bytes of spills;
  RESULTS.md, session 30), where an offset loaded from shared memory held."""
  return lax.bitwise_and(i * (i + 1), 1)


def stage_barriers(plgpu_mod, kv_bar, free_bar):
  """``(wait_loaded, release)`` for :func:`consume_stages` over one barrier per slot
  each: the stage loaded, and the stage free (both consumers arrive)."""
  return (lambda slot: plgpu_mod.barrier_wait(kv_bar.at[slot]),
          lambda slot: plgpu_mod.barrier_arrive(free_bar.at[slot]))


def consume_stages(plgpu_mod, *, wg, q_main, q_rope, k_main, k_rope, steps, barriers, shared,
                   mask, scale: float, p_t=None, ring_start=0, persistent=False):
  """The attention loop of a consumer warpgroup in the warp-specialised MLA kernels
  (dense decode and sparse MLA; call after ``set_max_registers``).

  A producer warpgroup fills a ring of key stages in SMEM; the two consumers (``wg``
  0 and 1) each own 256 of the 512 output columns. The consumers take turns: stage
  ``i``'s ``S = Q K^T`` (over the two 256-wide halves of the 512 main columns plus the
  RoPE columns), mask and online softmax (base 2) run in warpgroup ``i % 2``, which
  hands ``P`` (bf16) and the rows' rescale factor to both through SMEM; both multiply
  ``P`` by their half of ``V`` (the main columns of the same key rows). ``S`` is
  computed once per stage (computing it in both warpgroups cost a third of the
  tensor-core work), both warpgroups do the same tensor-core work, and one's softmax
  runs while the other's matmuls keep the tensor cores busy. Only the row max chains
  the stages: warpgroup ``i % 2`` takes the max published after stage ``i - 1`` by the
  other one, publishes the new one as soon as it has the scores' row max, and keeps
  its own partial row sum (relative to its last max; summed at the end). ``P`` goes
  into the stage's RoPE tile, dead once ``S`` is computed (``V`` is the main columns),
  and the rescale factor into the slot's row of ``stats``: both are free again when
  the stage is.

  The softmax leaves the tensor cores idle; hiding it needs a third 72 KiB stage, which
  does not fit beside the query. The dense decode's 64-row tiles use
  :func:`consume_pairs` instead (FlashMLA's split, 4-7% faster there on the H100), and
  so does the bf16 sparse prefill with ``Config.half_stages`` (11-12% on the 128-head
  rows; benchmarks/RESULTS.md, session 26); computing ``S`` a stage ahead was slower
  (session 20).

  Transposed (``p_t`` given; the sparse kernel for head counts that are not a multiple
  of 64): the keys are wgmma's M side, ``S^T = K Q^T`` ``[keys, heads]``, the softmax
  runs down the columns and ``O^T += V^T P^T``. ``P^T`` goes to ``p_t``'s slot, stored
  transposed (wgmma wants both operands in the ring's 128-byte swizzle). The column
  reductions cross warps through Pallas' one SMEM reduction scratch, which both
  warpgroups would share: a warpgroup waits for the other's max before its own
  reductions and publishes its max only after its sums, so they never overlap.

  Args:
    wg: this consumer's index (``lax.axis_index("wg")``).
    q_main, q_rope: SMEM ``[2, rows, 256]`` and ``[rows, rope]`` queries (``q_rope``
      None: no RoPE columns); ``rows`` are heads.
    k_main, k_rope: SMEM rings ``[stages, 2, keys, 256]`` and ``[stages, keys, rope]``;
      ``k_rope`` holds ``P`` after ``S`` (``rope == rows``), also when ``q_rope`` is None
      (not when transposed).
    steps: key stages to consume (traced).
    barriers: ``(q_bar, wait_loaded, release, done_bar)``: the query-loaded barrier;
      ``wait_loaded(slot)`` waits until the stage in ``slot`` is loaded, and
      ``release(slot)`` (called by each consumer once it is done with the stage)
      frees it; both consumers done with the query.
    shared: ``(stats, ready)`` from :func:`shared_scratch`.
    mask: ``mask(i, slot)`` runs (in the warpgroup computing stage ``i``, ring slot
      ``slot``) before the stage is waited for, so work that does not read the stage
      overlaps the wait; it returns the function that sets the float32 scores of absent
      keys to ``-inf``.
    scale: the softmax scale times ``log2(e)``.
    p_t: None, or (transposed) the SMEM ``[stages, rows, keys]`` tiles of ``P``.
    ring_start: the ring steps the CTA consumed before (a persistent CTA's ring runs on
      from one token into the next: stage ``i`` is in slot ``(ring_start + i) %
      stages``).
    persistent: the CTA calls this again for its next item. The call then leaves the
      max hand-off barriers balanced and both warpgroups past their reads of the shared
      scratch, and takes the query's wgmma descriptors afresh each step: LLVM would
      hoist them (36 at d 576) out of the CTA's items loop, and ptxas then spills
      them (216-296 bytes a thread, 25-35% slower; RESULTS.md, session 25).

  Returns:
    ``(acc, m, l)`` in both warpgroups once both are done with the query, whose SMEM
    may then stage the output: the float32 accumulator ``[rows, 256]`` (transposed:
    ``[256, rows]``), the row max (scaled base-2 units) and sum (per head, in the
    layout of a reduced axis of ``acc``). Finish with :func:`empty_rows`.
  """
  plgpu = plgpu_mod
  transposed = p_t is not None
  q_bar, wait_loaded, release, done_bar = barriers
  stats, ready = shared
  num_stages, _, keys, half = k_main.shape
  rows = q_main.shape[1]
  p_ready = lambda slot: ready.at[slot]  # noqa: E731
  m_ready = lambda w: ready.at[num_stages + w]  # noqa: E731
  own_ready = lambda w: ready.at[num_stages + 2 + w]  # noqa: E731
  m_at = lambda w: stats.at[num_stages + w]  # noqa: E731  max published last by w
  l_at = lambda w: stats.at[num_stages + 2 + w]  # noqa: E731  w's partial sum ...
  u_at = lambda w: stats.at[num_stages + 4 + w]  # noqa: E731  ... relative to this max
  # Per-head vectors: reduced over the keys, axis 0 of S^T or axis 1 of S.
  row = (col_layout if transposed else row_layout)(plgpu)
  keys_axis, heads_dim = (0, 1) if transposed else (1, 0)
  load = lambda ref: plgpu.load(ref, (), layout=row, optimized=False)  # noqa: E731
  acc_shape = (half, rows) if transposed else (rows, half)
  acc = plgpu.layout_cast(jnp.zeros(acc_shape, jnp.float32), plgpu.Layout.WGMMA)
  minus_inf = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row)

  # Stage 0's computing warpgroup (0) reads the max "published by 1 before it": -inf.
  # Each warpgroup's partial sum starts at 0 relative to -inf; its own barrier orders
  # these stores (by whichever threads hold a row) before its loads. Later, "P ready"
  # (arrived and waited by the computing warpgroup) orders each stage's stores.
  l_at(wg)[...] = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row)
  u_at(wg)[...] = minus_inf
  plgpu.barrier_arrive(own_ready(wg))
  plgpu.barrier_wait(own_ready(wg))

  @pl.when(wg == 1)
  def _():
    m_at(1)[...] = minus_inf
    plgpu.barrier_arrive(m_ready(1))

  plgpu.barrier_wait(q_bar)

  q_halves = q_main

  def step(i, acc):
    slot = lax.rem(ring_start + i, num_stages)
    mine = lax.rem(i, 2)
    q_main = q_halves.at[pl.ds(opaque_zero(i), 2)] if persistent else q_halves

    @pl.when(wg == mine)
    def _scores():
      apply_mask = mask(i, slot)
      wait_loaded(slot)

      def qk(s_ref):
        for h in range(2):
          if transposed:
            plgpu.wgmma(s_ref, k_main.at[slot, h], q_main.at[h].transpose((1, 0)))
          else:
            plgpu.wgmma(s_ref, q_main.at[h], k_main.at[slot, h].transpose((1, 0)))
        if q_rope is not None:
          if transposed:
            plgpu.wgmma(s_ref, k_rope.at[slot], q_rope.transpose((1, 0)))
          else:
            plgpu.wgmma(s_ref, q_rope, k_rope.at[slot].transpose((1, 0)))
        return s_ref[...]

      s_shape = (keys, rows) if transposed else (rows, keys)
      s = apply_mask(pl.run_scoped(qk, plgpu.ACC(s_shape, jnp.float32)))
      if not transposed:
        row_max = s.max(axis=keys_axis) * scale  # the scale folds into the exp2's FMA
      plgpu.barrier_wait(m_ready(1 - mine))
      m_prev = load(m_at(1 - mine))
      if transposed:  # the other warpgroup is done with the reduction scratch
        row_max = s.max(axis=keys_axis) * scale
      m_new = jnp.maximum(m_prev, row_max)
      if not transposed:
        m_at(mine)[...] = m_new
        plgpu.barrier_arrive(m_ready(mine))  # the next stage's softmax may start
      m_use = _softmax.safe_max(m_new)
      p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [heads_dim]))
      l_at(mine)[...] = (load(l_at(mine)) * jnp.exp2(load(u_at(mine)) - m_use)
                         + p.sum(axis=keys_axis))
      u_at(mine)[...] = m_use
      if transposed:  # stored as P [rows, keys]
        p_t.at[slot].transpose((1, 0))[...] = plgpu.layout_cast(
            p.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
      else:
        k_rope.at[slot][...] = p.astype(jnp.bfloat16)  # S is done: the RoPE tile is dead
      stats.at[slot][...] = jnp.exp2(m_prev - m_use)
      if transposed:
        m_at(mine)[...] = m_new
      plgpu.commit_smem()  # P is read by wgmma (the async proxy)
      if transposed:
        plgpu.barrier_arrive(m_ready(mine))
      plgpu.barrier_arrive(p_ready(slot))

    pl.when(wg != mine)(lambda: wait_loaded(slot))

    plgpu.barrier_wait(p_ready(slot))
    alpha = load(stats.at[slot])
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [heads_dim])

    def pv(acc_ref):
      if transposed:
        plgpu.wgmma(acc_ref, k_main.at[slot, wg].transpose((1, 0)),
                    p_t.at[slot].transpose((1, 0)))
      else:
        plgpu.wgmma(acc_ref, k_rope.at[slot], k_main.at[slot, wg])

    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    release(slot)
    return acc

  acc = lax.fori_loop(0, steps, step, acc)
  plgpu.barrier_arrive(done_bar)
  plgpu.barrier_wait(done_bar)
  # The final max is the one published for the last stage (-inf with no stage); each
  # partial sum is brought to it (a warpgroup that computed no stage has 0 at -inf).
  last = lax.rem(steps + 1, 2)
  m = load(m_at(last))
  m_use = _softmax.safe_max(m)
  l = sum(load(l_at(w)) * jnp.exp2(load(u_at(w)) - m_use) for w in range(2))
  if persistent:
    # That last max's arrival is the one nobody waited for: the other warpgroup takes
    # it, and neither starts the next token's stores before both are done reading.
    pl.when(wg != last)(lambda: plgpu.barrier_wait(m_ready(last)))
    plgpu.barrier_arrive(done_bar)
    plgpu.barrier_wait(done_bar)
  return acc, m, l


def store_lse_rows(plgpu_mod, src_ref, dst_ref, first_row, *, count: int) -> None:
  """Per-row float32 results in a decode's LSE layout: ``dst_ref`` is one request's
  ``[heads, query_len]`` (FlashMLA's ``[b, h_q, s_q]`` LSE at ``b``), and thread ``i`` of
  the warpgroup below ``count`` copies ``src_ref[i]`` (SMEM, written before a
  ``commit_smem``) of query row ``first_row + i = token * heads + head`` (traced int32)
  to ``dst_ref[head, token]``; rows past ``heads * query_len`` (a tile's padding) are
  not stored. A TMA cannot: its rows there would be 4 bytes."""
  heads, query_len = dst_ref.shape

  def body(ctx, src, dst, first):
    del ctx
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    c = _inline.const
    tid = _inline.warpgroup_thread()
    row = arith.addi(first.registers.item(), tid)
    element = arith.addi(arith.muli(arith.remui(row, c(heads)), c(query_len)),
                         arith.divui(row, c(heads)))
    src_at = _inline.at(mgpu_utils.memref_ptr(src), arith.muli(tid, c(4)))
    dst_at = _inline.at(_inline.global_ptr(dst),
                        arith.extui(_inline.int_type(64), arith.muli(element, c(4))))
    llvm.inline_asm(_inline.void(), [src_at, dst_at, tid, row],
                    "{.reg .pred p; .reg .f32 v; setp.lt.u32 p, $2, "
                    f"{count}; setp.lt.and.u32 p, $3, {heads * query_len}, p; "
                    "@p ld.shared.f32 v, [$0]; @p st.global.f32 [$1], v;}",
                    "r,l,r,r", has_side_effects=True)

  plgpu_mod.inline_mgpu(arg_types=(plgpu_mod.RefType(), plgpu_mod.RefType(),
                                   scalar_arg(plgpu_mod)))(body)(src_ref, dst_ref, first_row)


# consume_pairs' hand-offs between its two warpgroups are PTX named barriers over both
# warpgroups' 256 threads: "max published" by warpgroup w (8 + w), "P stored" by w
# (10 + w), both done (12), as FlashMLA's: the other warpgroup's ``bar.sync`` returns
# once the ``bar.arrive`` lands, where an mbarrier took an elected arrive and a polling
# wait. With :func:`store_unsynced`, 1.5-2.6% on the bf16 prefill and 0.9% on the
# dense decode (RESULTS.md, session 32). Mosaic GPU takes barrier 0 for the CTA and
# 1 + i for warpgroup i's own.
_PUBLISHED, _STORED, _BOTH_DONE = 8, 10, 12


def named_barrier(plgpu_mod, op: str, barrier: int, *, fence: bool = False) -> None:
  """``bar.<op> barrier, 256`` in every thread of the warpgroup, for two warpgroups:
  ``arrive`` signals (after the thread's shared memory writes; with ``fence`` made
  visible to the async proxy first) without waiting, ``sync`` waits until the other
  warpgroup has arrived or synced too. Each arrive must meet one sync of the other
  warpgroup before the next arrive on that barrier."""
  text = ("fence.proxy.async.shared::cta; " if fence else "") + f"bar.{op} {barrier}, 256;"

  def body(ctx):
    del ctx
    _inline.asm(_inline.void(), text, "", effects=True)

  plgpu_mod.inline_mgpu()(body)()


def store_unsynced(plgpu_mod, value, ref, layout, *, tiled: bool = False) -> None:
  """``ref[...] = value`` (``layout``; ``tiled``: ``ref`` is in :func:`swizzled` tiles,
  else untransformed) without the warpgroup barriers Pallas puts on both sides of an
  SMEM store. For :func:`consume_pairs`' hand-offs, where the named barrier
  after the store orders it for its reader, and the hand-off protocol orders the
  previous reads before it (a caller that reads those rows, or lets a TMA read them,
  syncs its warpgroup before the next call)."""

  def body(ctx, value, ref):
    del ctx
    if tiled:
      value.store_tiled(ref, swizzle=128)  # swizzled()'s
    else:
      value.store_untiled(ref, optimized=False)

  ref_type = plgpu_mod.RefType(swizzled(plgpu_mod) if tiled else ())
  plgpu_mod.inline_mgpu(arg_types=(layout, ref_type))(body)(value, ref)


def pair_scratch(plgpu_mod, rows: int):
  """What :func:`consume_pairs` passes between its two warpgroups besides ``P``, for a
  kernel's ``run_scoped``: float32 ``[4, rows]`` SMEM (each warpgroup's row max of its
  stage, then its row sum)."""
  return plgpu_mod.SMEM((4, rows), jnp.float32)


def half_part(slot, half):
  """Index of half ``half`` of ring slot ``slot`` in :func:`consume_pairs`' per-half
  barriers (half 0: main columns 0-255; half 1: main columns 256-511 and the RoPE tile)."""
  return slot * 2 + half


# The order in which consume_pairs frees the halves of a pair of stages, and so the
# order its producer refills them in: (stage of the pair, half). Each stage's owner
# frees its own half first (warpgroup w owns stage w of the pair and half w).
PAIR_FILL_ORDER = ((0, 0), (1, 1), (0, 1), (1, 0))


def consume_pairs(plgpu_mod, *, wg, q_main, k_main, rope, steps, barriers, shared, mask,
                  scale: float, has_rope: bool = True, zero_ref=None, query_done=None):
  """The attention loop of a consumer warpgroup in the warp-specialised MLA kernels
  with 64-row tiles (call after ``set_max_registers``).

  A producer warpgroup fills a two-slot ring with key stages (stage ``i`` in slot ``i %
  2``), each in two halves with their own barriers (:func:`half_part`); the two
  consumers (``wg`` 0 and 1) each own 256 of the 512 output columns and take the
  stages in pairs, FlashMLA's split: warpgroup ``w`` computes ``S = Q K^T`` of the
  pair's stage in slot ``w`` (64 x 64 over the two 256-wide halves of the main columns
  plus the 64 RoPE columns), and both multiply both stages' ``P`` by their half of ``V``
  (the main columns of the same key rows): their own ``P`` from registers, the other's
  from SMEM.

  The two warpgroups are staggered, FlashMLA's schedule, so that one's softmax runs
  while the other's products keep the tensor cores busy. Warpgroup 0 leads: it issues
  ``S`` of its next stage right behind its last product of the pair (slot 1's ``P``),
  takes the softmax at its own running max and publishes that max; warpgroup 1 takes
  it in, publishes the pair's max and multiplies; warpgroup 0 then brings its float32
  ``P`` (rounded to bf16 once), its accumulator and its sum to the pair's max before it
  stores that ``P`` for warpgroup 1. Without the lead (a staggered softmax alone) it
  was no faster (RESULTS.md, session 27); with ``S`` carried across the loop boundary,
  both warpgroups ahead, it spilled 240 bytes a thread and ran 17-40% slower
  (session 27). Here no value is in flight across the loop boundary: warpgroup 0's
  iteration starts with the last pair's product.

  Warpgroup ``h`` frees half ``h`` of a slot as soon as it has multiplied by it: its
  own slot's half right after its own product, so the producer refills it while the
  pair finishes, and ``S`` of the next stage starts on that half. ``P`` of slot 0 goes
  into the slot's RoPE tile (dead once ``S`` is computed; freed with half 1 by
  warpgroup 1, its reader), ``P`` of slot 1 into a tile of its own (slot 1's RoPE tile
  is freed by warpgroup 1, not by its reader). FlashMLA puts it in the query's RoPE
  tile and keeps the query's RoPE columns in registers; here those 16 registers a
  thread were spilled (76 against 12 bytes, 1.5-2.5% slower: RESULTS.md, session 26).
  An odd last stage is warpgroup 0's alone; warpgroup 1 takes its max and multiplies
  by its ``P``.

  Every wgmma operand is viewed at an :func:`opaque_zero` offset of the loop index:
  the ring slots are static per code path here, so LLVM would hoist all the
  descriptors out of the loop and ptxas would spill them (480 bytes a thread, 1.55x
  slower; with the offsets 12 bytes: RESULTS.md, sessions 20 and 26). In a persistent
  kernel's item loop LLVM folded those offsets and built every descriptor before the
  loop (1000 bytes of spills, 1.5-1.9x slower: session 30); there ``zero_ref`` gives
  the offset as a load from SMEM, which it cannot fold.

  Args:
    wg: this consumer's index (``lax.axis_index("wg")``).
    q_main: SMEM ``[2, 64, 256]``, the query's main columns in two halves.
    k_main: SMEM ``[2, 2, 64, 256]``, the ring's main columns (slot, half).
    rope: SMEM ``[4, 64, 64]``: the two slots' RoPE key tiles, the query's RoPE tile,
      and slot 1's ``P``.
    has_rope: whether ``S`` takes the RoPE columns (else those tiles are only ``P``'s).
    steps: key stages to consume (traced).
    barriers: ``(q_bar, wait_loaded, release)``: the query-loaded barrier;
      ``wait_loaded(i, slot, half)`` waits until that half of stage ``i`` (in ``slot``)
      is loaded, ``release(slot, half)`` frees it (its one reader is done); one
      barrier each per half (:func:`half_part`).
    shared: the ``stats`` SMEM from :func:`pair_scratch`; the warpgroups hand off
      through named barriers 8-12 (:func:`named_barrier`), which the caller leaves
      alone.
    mask: ``mask(i, slot)`` runs (in the warpgroup computing stage ``i``) before the
      stage is waited for, so work that does not read the stage overlaps the wait; it
      returns the function that sets the float32 scores of absent keys to ``-inf``.
    scale: the softmax scale times ``log2(e)``.
    zero_ref: None, or a one-element int32 SMEM ref holding 0: the wgmma offset.
    query_done: None, or a function each warpgroup calls once it has computed its last
      ``S`` (at once with no stage of its own): it then no longer reads the query's
      SMEM, and keeps its half of the last stage's slot unreleased, for the caller
      to stage its output in and free (a persistent kernel loads the next query
      meanwhile).

  Returns:
    ``(acc, m, l)`` in both warpgroups once both are done with the query, whose SMEM
    may then stage the output (without ``query_done``), as may rows 0-1 of ``stats``:
    the float32 accumulator ``[64, 256]``, the row max (scaled base-2 units) and sum.
    A caller that calls again after staging in ``stats`` first syncs each warpgroup
    past those reads (the hand-offs store there without Pallas' barriers).
    Finish with :func:`empty_rows`.
  """
  plgpu = plgpu_mod
  q_bar, wait_loaded, release = barriers
  stats = shared
  if zero_ref is None:
    zero = opaque_zero
  else:
    zero = lambda i: zero_ref[0]  # noqa: E731
  hold = query_done is not None

  def done_with_query(when):
    """Calls ``query_done`` where ``when`` (pass ``hold and ...``: nothing without it)."""
    if when is not False:
      pl.when(when)(query_done)

  def holds_last_stage(k):
    """Whether pair ``k`` holds the last stage (an even count of stages)."""
    return (k == pairs - 1) & jnp.logical_not(odd)

  rows, keys, half = q_main.shape[1], k_main.shape[2], k_main.shape[3]
  # Refs are indexed where used: a view made outside a loop or ``run_state`` passes its
  # index in as a constant, which jax 0.11's Mosaic GPU lowering does not take.
  published = lambda w: _PUBLISHED + w  # noqa: E731  warpgroup 0: its max; 1: the pair's
  stored = lambda w: _STORED + w  # noqa: E731
  p_index = lambda slot: slot * 3  # noqa: E731  P of slot ``slot``
  row = row_layout(plgpu)
  load = lambda ref: plgpu.load(ref, (), layout=row, optimized=False)  # noqa: E731
  bcast = lambda v, shape: lax.broadcast_in_dim(v, shape, [0])  # noqa: E731
  wgmma_zeros = lambda shape: plgpu.layout_cast(  # noqa: E731
      jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

  def issue_scores(i, w, s_ref, z, after_own_half=lambda: None):
    """Issues ``S += Q K^T`` of stage ``i`` (slot ``w``), own half first (freed first,
    so loaded first); ``after_own_half`` runs once that half's product is issued."""
    for j in range(2):
      h = w if j == 0 else 1 - w
      wait_loaded(i, w, h)
      plgpu.wgmma(s_ref, q_main.at[h + z], k_main.at[w + z, h].transpose((1, 0)))
      if j == 0:
        after_own_half()
    if has_rope:
      plgpu.wgmma(s_ref, rope.at[2 + z], rope.at[w + z].transpose((1, 0)))

  def unmasked_scores(i, w, z):
    """``S`` of stage ``i`` in slot ``w``, its products issued alone and waited for."""
    def qk(s_ref):
      issue_scores(i, w, s_ref, z)
      return s_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((rows, keys), jnp.float32))

  def scores(i, w):
    """The masked ``S`` of stage ``i`` in slot ``w``."""
    apply_mask = mask(i, w)
    # descriptors derived in the loop (no hoisting, no spills)
    return apply_mask(unmasked_scores(i, w, zero(i)))

  def multiply(acc, w, slot, p=None, after_issue=lambda: None, z=0, held=False):
    """``acc + P @ V`` over warpgroup ``w``'s half of slot ``slot``, then frees that
    half unless ``held`` (True, or traced: where true; the last stage's half, kept for
    the caller with ``query_done``); ``p``: bf16 registers, or None: the ``P`` stored
    for the slot; ``after_issue`` runs while the product is in flight."""
    def pv(acc_ref):
      plgpu.wgmma(acc_ref, rope.at[p_index(slot) + z] if p is None else p,
                  k_main.at[slot + z, w])
      after_issue()

    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    release_unless(held, slot, w)
    return acc

  def release_unless(held, slot, w):
    if held is False:
      release(slot, w)
    elif held is not True:
      pl.when(jnp.logical_not(held))(lambda: release(slot, w))

  def rescaled(m_use, m_run, acc, l_run):
    """``(acc, l)`` brought from max ``m_run`` to ``m_use`` (the new max through
    :func:`jax_mla._softmax.safe_max`)."""
    alpha = jnp.exp2(m_run - m_use)
    return acc * bcast(alpha, acc.shape), l_run * alpha

  def softmax(s, m_new, carry):
    """``P`` (float32) of scores ``s`` at max ``m_new``, and the carry ``(acc, m, l)``
    brought to it, ``P``'s sum added."""
    acc, m_run, l_run = carry
    m_use = _softmax.safe_max(m_new)
    p = jnp.exp2(s * scale - bcast(m_use, s.shape))
    acc, l_run = rescaled(m_use, m_run, acc, l_run)
    return p, (acc, m_new, l_run + p.sum(axis=1))

  def publish(w, m):
    store_unsynced(plgpu, m, stats.at[w], row)
    named_barrier(plgpu, "arrive", published(w))

  def store_p(w, p):
    store_unsynced(plgpu, p, rope.at[p_index(w)], plgpu.Layout.WGMMA, tiled=True)
    # P is read by wgmma (the async proxy)
    named_barrier(plgpu, "arrive", stored(w), fence=True)

  def lead_scores(k, acc):
    """Warpgroup 0, pair ``k``: ``(acc, masked S of stage 2k)``, the product by slot 1's
    ``P`` of pair ``k - 1`` (``k > 0``) issued first and its half freed once done."""
    apply_mask = mask(2 * k, 0)
    z = zero(k)

    def alone(acc):
      return acc, unmasked_scores(2 * k, 0, z)

    def behind_product(acc):
      def products(refs):
        acc_ref, s_ref = refs
        named_barrier(plgpu, "sync", stored(1))
        plgpu.wgmma(acc_ref, rope.at[p_index(1) + z], k_main.at[1 + z, 0])

        def free_half():
          plgpu.wgmma_wait(1)  # the product is done; S's first half may be in flight
          release(1, 0)

        issue_scores(2 * k, 0, s_ref, z, free_half)

      return pl.run_state(products)(
          (plgpu.ACC.init(acc), plgpu.ACC.init(wgmma_zeros((rows, keys)))))

    acc, s = lax.cond(k == 0, alone, behind_product, acc)
    return acc, apply_mask(s)

  def lead_pair(k, carry):
    """Warpgroup 0, pair ``k``: stage ``2k`` up to its ``P`` stored at the pair's max."""
    acc, s = lead_scores(k, carry[0])
    done_with_query(hold and holds_last_stage(k))
    m_own = jnp.maximum(carry[1], s.max(axis=1) * scale)
    publish(0, m_own)
    p, (acc, _, l_run) = softmax(s, m_own, (acc, *carry[1:]))
    acc = multiply(acc, 0, 0, p.astype(jnp.bfloat16), z=zero(k))
    named_barrier(plgpu, "sync", published(1))
    m_pair = load(stats.at[1])
    factor = jnp.exp2(m_own - _softmax.safe_max(m_pair))  # 0 while m_own is -inf
    store_p(0, (p * bcast(factor, p.shape)).astype(jnp.bfloat16))
    return acc * bcast(factor, acc.shape), m_pair, l_run * factor

  def follow_pair(k, carry):
    """Warpgroup 1, pair ``k``: stage ``2k + 1`` at the pair's max, then both products."""
    s = scores(2 * k + 1, 1)
    done_with_query(hold and k == pairs - 1)
    row_max = s.max(axis=1) * scale
    named_barrier(plgpu, "sync", published(0))
    m_pair = jnp.maximum(load(stats.at[0]), row_max)  # warpgroup 0's is past carry's
    publish(1, m_pair)
    p, carry = softmax(s, m_pair, carry)
    p = p.astype(jnp.bfloat16)
    z = zero(k)

    def products(acc_ref):
      plgpu.wgmma(acc_ref, p, k_main.at[1 + z, 1])
      store_p(1, p)  # while the product runs
      named_barrier(plgpu, "sync", stored(0))
      plgpu.wgmma(acc_ref, rope.at[p_index(0) + z], k_main.at[z, 1])
      plgpu.wgmma_wait(1)
      release_unless(hold and holds_last_stage(k), 1, 1)

    acc = pl.run_state(products)(plgpu.ACC.init(carry[0]))
    release(0, 1)
    return acc, *carry[1:]

  def lead_tail(carry):
    """Warpgroup 0 after the pairs: the last pair's product by slot 1's ``P``, then an
    odd last stage (its alone)."""
    def last_product(acc):
      named_barrier(plgpu, "sync", stored(1))
      return multiply(acc, 0, 1, z=zero(steps), held=hold and jnp.logical_not(odd))

    def last_alone(carry):
      s = scores(steps - 1, 0)
      done_with_query(hold)
      m_new = jnp.maximum(carry[1], s.max(axis=1) * scale)
      publish(0, m_new)
      p, (acc, m, l_run) = softmax(s, m_new, carry)
      p = p.astype(jnp.bfloat16)
      return (multiply(acc, 0, 0, p, lambda: store_p(0, p), z=zero(steps), held=hold), m,
              l_run)

    carry = (lax.cond(steps >= 2, last_product, lambda a: a, carry[0]), *carry[1:])
    return lax.cond(odd, last_alone, lambda c: c, carry)

  def follow_tail(carry):
    """Warpgroup 1 after the pairs: an odd last stage's max and ``P``."""
    def last_other(carry):
      acc, m_run, l_run = carry
      named_barrier(plgpu, "sync", published(0))
      m_new = jnp.maximum(m_run, load(stats.at[0]))
      acc, l_run = rescaled(_softmax.safe_max(m_new), m_run, acc, l_run)
      named_barrier(plgpu, "sync", stored(0))
      return multiply(acc, 1, 0, z=zero(steps), held=hold), m_new, l_run

    done_with_query(hold and steps == 1)  # warpgroup 1 computed no S
    return lax.cond(odd, last_other, lambda c: c, carry)

  plgpu.barrier_wait(q_bar)
  carry = (wgmma_zeros((rows, half)),
           plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row),
           plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row))
  pairs, odd = lax.div(steps, 2), lax.rem(steps, 2) == 1
  carry = lax.fori_loop(0, pairs, lambda k, c: lax.cond(
      wg == 0, functools.partial(lead_pair, k), functools.partial(follow_pair, k), c), carry)
  acc, m, l_own = lax.cond(wg == 0, lead_tail, follow_tail, carry)
  # Both warpgroups end at the same max (-inf with no stage); their sums add.
  stats.at[2 + wg][...] = l_own
  named_barrier(plgpu, "sync", _BOTH_DONE)
  return acc, m, load(stats.at[2]) + load(stats.at[3])


def sink_epilogue(m, l, sink):
  """The sparse kernels' per-head results from :func:`consume_stages`' ``m`` and ``l``
  and the attention sink (natural-log units; ``-inf`` or None: none): ``(inv,
  max_logits, lse)``. ``inv`` scales the accumulator: ``1 / l`` times ``exp(lse) /
  (exp(lse) + exp(sink))`` (sink ``+inf``: 0, ``-inf``: 1), 0 for an empty row; ``max_logits`` and
  ``lse`` are natural-log, ``-inf`` and ``+inf`` for an empty row (:func:`empty_rows`),
  NaN where ``l`` is."""
  empty, l_safe = empty_rows(l)
  lse2 = m + jnp.log2(l_safe)
  share = l_safe if sink is None else l_safe * (1.0 + jnp.exp2(sink * LOG2E - lse2))
  inv = jnp.where(empty, 0.0, 1.0 / share)
  max_logits = jnp.where(empty, -jnp.inf, jnp.where(jnp.isnan(l), jnp.nan, m * LN2))
  return inv, max_logits, jnp.where(empty, jnp.inf, lse2 * LN2)


def empty_rows(l):
  """``(empty, l_safe)`` after the last stage: rows with no key, and ``l`` with 1 there.

  A row is empty iff ``l == 0`` (a key adds ``exp2(0) = 1`` at the row max). A NaN
  score (a NaN query, say) makes ``l`` NaN, which is not empty: the row's output and
  LSE come out NaN, as the references give.
  """
  empty = l == 0.0
  return empty, jnp.where(empty, 1.0, l)
