"""Pallas Mosaic GPU kernel (Hopper wgmma) for sparse MLA prefill.

The second backend of :func:`jax_mla.sparse_mla.sparse_mla_prefill`
(``implementation="mosaic"``, and the default on Hopper GPUs for the shapes it
takes). One CTA takes one query token and 64 of its heads, and three warpgroups:

- a producer warpgroup loads the 64-head query tile once with TMA, then gathers
  the token's key rows, 64 per step, into a two-stage shared-memory ring. Hopper
  has no gather TMA, so every thread issues 16-byte ``cp.async`` copies straight
  into the swizzled wgmma layout (8 threads per 128-byte tile row, FlashMLA's
  split); an invalid index copies zero bytes, which zero-fills its row, so NaN in
  unused slots never reaches the arithmetic. It also writes each row's validity
  next to the stage;
- two consumer warpgroups each own 256 of the 512 output columns; both compute
  the same ``S = Q K^T`` (64 x 64 over the 512 + 64 RoPE or 512 columns), mask the
  invalid columns to ``-inf``, run the online softmax in base 2, and multiply
  ``P`` by their half of ``V`` (the first 512 columns of the same rows).

The wrapper folds ``topk_length`` and out-of-range indices into ``-1`` and pads
``topk`` to a multiple of 64, so the kernel only tests ``index >= 0``.

Shapes: ``h_q`` a multiple of 64, ``d_qk`` 576 or 512, bf16. Other head counts
belong to the Triton kernel (``implementation="pallas"``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _mosaic
from jax_mla._common import LN2, LOG2E, cdiv

BLOCK_H = 64  # query heads per CTA: one wgmma M
BLOCK_K = 64  # gathered key rows per pipeline step
HALF = 256  # output columns per consumer warpgroup (wgmma N <= 256)
D_MAIN = 512  # columns held as two 256-wide halves: V, and K's NoPE part
NUM_STAGES = 2  # 72 KiB query + 2 x 72 KiB key stages fill the 227 KiB of SMEM
TILE = 64  # bf16 columns in one 128-byte swizzled tile row
THREADS_PER_ROW = TILE * 2 // 16  # 16-byte copies per tile row


def check_supported(q) -> None:
  """Raises ``ValueError`` for shapes this kernel does not take (the Triton one does)."""
  h_q = q.shape[1]
  if h_q % BLOCK_H:
    raise ValueError(f"the Mosaic GPU sparse-prefill kernel needs h_q a multiple of {BLOCK_H} "
                     f"(got {h_q}); use implementation='pallas' (Triton) for this shape")


def default_for(q) -> bool:
  """Whether ``implementation=None`` runs this kernel: Hopper and a supported shape."""
  if not _mosaic.on_hopper():
    return False
  try:
    check_supported(q)
  except ValueError:
    return False
  return True


def _gather_fn(*, s_kv: int, d_qk: int):
  """Per-thread ``cp.async`` gather of 64 key rows into one swizzled stage (inline Mosaic GPU)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  has_rope = d_qk > D_MAIN

  def gather(ctx, idx_ref, kv_ref, main_ref, rope_ref, valid_ref):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    bf16 = ir.BF16Type.get()
    c32 = lambda v: mgpu.c(v, i32)  # noqa: E731
    tid = arith.remui(mgpu.thread_idx(), c32(128))
    lane = arith.andi(tid, c32(THREADS_PER_ROW - 1))  # 16-byte chunk of a tile row
    group = arith.shrui(tid, c32(3))  # rows group, group + 16, ...
    kv_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                                 mgpu_utils.memref_ptr(kv_ref))
    main_base = mgpu_utils.memref_ptr(main_ref)
    rope_base = mgpu_utils.memref_ptr(rope_ref) if has_rope else None
    void = ir.Type.parse("!llvm.void")
    groups = 128 // THREADS_PER_ROW
    for local_row in range(BLOCK_K // groups):
      row = arith.addi(group, c32(local_row * groups))
      idx = memref.load(idx_ref, [arith.index_cast(ir.IndexType.get(), row)])
      ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, idx, c32(0)),
                      arith.cmpi(arith.CmpIPredicate.slt, idx, c32(s_kv)))
      src_row = arith.extui(i64, arith.select(ok, idx, c32(0)))
      src_off = arith.addi(arith.muli(src_row, mgpu.c(d_qk, i64)),
                           arith.extui(i64, arith.muli(lane, c32(8))))
      src = mgpu_utils.getelementptr(kv_base, [src_off], bf16)
      nbytes = arith.select(ok, c32(16), c32(0))  # 0: zero-fill, nothing read
      # 128-byte swizzle: chunk c of a tile row r lands at chunk c ^ (r % 8).
      in_tile = arith.addi(arith.muli(arith.andi(row, c32(7)), c32(TILE)),
                           arith.muli(arith.xori(lane, arith.andi(row, c32(7))), c32(8)))
      row_tile = arith.shrui(row, c32(3))
      for tile in range(d_qk // TILE):
        if tile < D_MAIN // TILE:  # main_ref: [2 halves][8 row tiles][4 col tiles][8][64]
          half, col_tile = divmod(tile, HALF // TILE)
          base = arith.addi(arith.muli(row_tile, c32(HALF // TILE * 8 * TILE)),
                            c32(half * BLOCK_K * HALF + col_tile * 8 * TILE))
          dst = mgpu_utils.getelementptr(main_base, [arith.addi(base, in_tile)], bf16)
        else:  # rope_ref: [8 row tiles][1][8][64]
          dst = mgpu_utils.getelementptr(
              rope_base, [arith.addi(arith.muli(row_tile, c32(8 * TILE)), in_tile)], bf16)
        llvm.inline_asm(
            void, [dst, mgpu_utils.getelementptr(src, [tile * TILE], bf16), nbytes],
            "cp.async.cg.shared.global.L2::256B [$0], [$1], 16, $2;", "r,l,r",
            has_side_effects=True)
      memref.store(arith.extui(i32, ok), valid_ref, [arith.index_cast(ir.IndexType.get(), row)])
    llvm.inline_asm(void, [], "cp.async.commit_group;", "", has_side_effects=True)

  return gather


def _wait_copies(ctx):
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "cp.async.wait_all;", "",
                  has_side_effects=True)


def _prefill_kernel(len_ref, idx_ref, q_ref, kv_ref, sink_ref, o_ref, ml_ref, lse_ref, smem,
                    barriers, *, plgpu, h_q, s_kv, d_qk, scale):
  q_main, q_rope, kv_main, kv_rope, valid, sink_smem, stats = smem
  q_bar, kv_bar, free_bar, done_bar = barriers
  t = lax.axis_index("t")
  h0 = lax.axis_index("h") * BLOCK_H
  wg = lax.axis_index("wg")
  r0 = t * h_q + h0
  steps = lax.div(len_ref[t] + (BLOCK_K - 1), BLOCK_K)
  has_rope = d_qk > D_MAIN

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    row = _mosaic.row_layout(plgpu)
    acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, HALF), jnp.float32), plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row)
    l = plgpu.layout_cast(jnp.zeros((BLOCK_H,), jnp.float32), row)
    plgpu.barrier_wait(q_bar)

    def step(i, carry):
      acc, m, l = carry
      slot = lax.rem(i, NUM_STAGES)
      plgpu.barrier_wait(kv_bar.at[slot])

      def qk(s_ref):
        for h in range(2):
          plgpu.wgmma(s_ref, q_main.at[h], kv_main.at[slot, h].transpose((1, 0)))
        if has_rope:
          plgpu.wgmma(s_ref, q_rope, kv_rope.at[slot].transpose((1, 0)))
        return s_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_K), jnp.float32))
      ok = plgpu.load(valid.at[slot], (), layout=_mosaic.col_layout(plgpu), optimized=False)
      s = jnp.where(lax.broadcast_in_dim(ok, s.shape, [1]) != 0, s, -jnp.inf)
      # m is kept in scaled base-2 units; the scale folds into the exp2's FMA.
      m_new = jnp.maximum(m, s.max(axis=1) * scale)
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
      alpha = jnp.exp2(m - m_use)
      p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p16 = p.astype(jnp.bfloat16)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, kv_main.at[slot, wg])

      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(free_bar.at[slot])
      return acc, m_new, l

    acc, m, l = lax.fori_loop(0, steps, step, (acc, m, l))

    # Both consumers are done with Q: its halves become the output staging.
    plgpu.barrier_arrive(done_bar)
    plgpu.barrier_wait(done_bar)
    live = l > 0  # a valid key adds exp2(0) = 1 at the row max
    l_safe = jnp.where(live, l, 1.0)
    lse2 = m + jnp.log2(l_safe)
    sink = plgpu.load(sink_smem, (), layout=row, optimized=False)
    # out *= exp(lse) / (exp(lse) + exp(sink)); sink +inf -> 0, -inf (or none) -> 1.
    inv = jnp.where(live, 1.0 / (l_safe * (1.0 + jnp.exp2(sink * LOG2E - lse2))), 0.0)
    q_main.at[wg][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(q_main.dtype)

    @pl.when(wg == 0)
    def _():
      stats.at[0][...] = jnp.where(live, m * LN2, -jnp.inf)

    @pl.when(wg == 1)
    def _():
      stats.at[1][...] = jnp.where(live, lse2 * LN2, jnp.inf)

    plgpu.commit_smem()
    rows = pl.ds(r0, BLOCK_H)
    plgpu.copy_smem_to_gmem(q_main.at[wg], o_ref.at[rows, pl.ds(wg * HALF, HALF)])

    @pl.when(wg == 0)
    def _():
      plgpu.copy_smem_to_gmem(stats.at[0], ml_ref.at[rows])

    @pl.when(wg == 1)
    def _():
      plgpu.copy_smem_to_gmem(stats.at[1], lse_ref.at[rows])

    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")
    rows = pl.ds(r0, BLOCK_H)
    for h in range(2):
      plgpu.copy_gmem_to_smem(q_ref.at[rows, pl.ds(h * HALF, HALF)], q_main.at[h], q_bar)
    if has_rope:
      plgpu.copy_gmem_to_smem(q_ref.at[rows, pl.ds(D_MAIN, d_qk - D_MAIN)], q_rope, q_bar)
    plgpu.copy_gmem_to_smem(sink_ref.at[pl.ds(h0, BLOCK_H)], sink_smem, q_bar)

    swizzled = plgpu.RefType(_swizzled(plgpu))
    gather = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(), swizzled, swizzled, plgpu.RefType()),
    )(_gather_fn(s_kv=s_kv, d_qk=d_qk))
    wait_copies = plgpu.inline_mgpu()(_wait_copies)

    def ready(i):
      # Each thread waits for its own copies; the fence orders them before wgmma's
      # (async-proxy) reads; the arrival (all 128 threads count as one) publishes them.
      wait_copies()
      plgpu.commit_smem()
      plgpu.barrier_arrive(kv_bar.at[lax.rem(i, NUM_STAGES)])

    @pl.loop(0, steps)
    def _(i):
      slot = lax.rem(i, NUM_STAGES)

      # Stage i - 1 landed while the consumers worked on i - 2: publish it before
      # waiting for slot i's previous reader, so the consumers never wait on an issue.
      @pl.when(i >= 1)
      def _():
        ready(i - 1)

      @pl.when(i >= NUM_STAGES)
      def _():
        plgpu.barrier_wait(free_bar.at[slot])

      gather(idx_ref.at[t, pl.ds(i * BLOCK_K, BLOCK_K)], kv_ref, kv_main.at[slot],
             kv_rope.at[slot], valid.at[slot])

    @pl.when(steps >= 1)
    def _():
      ready(steps - 1)


def _swizzled(plgpu):
  return (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(128))


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def sparse_prefill(q, kv, indices, attn_sink, topk_length, *, sm_scale):
  """Runs the kernel; inputs validated by :func:`jax_mla.sparse_mla.sparse_mla_prefill`
  and :func:`check_supported`. Same results as that function.

  ``q[s_q, h_q, d_qk]``, ``kv[s_kv, d_qk]``, ``indices[s_q, topk]``, ``attn_sink``
  ``[h_q]`` float32 or None, ``topk_length`` ``[s_q]`` int32 or None.
  """
  plgpu = _mosaic.plgpu()
  s_q, h_q, d_qk = q.shape
  s_kv, topk = kv.shape[0], indices.shape[1]
  padded = cdiv(topk, BLOCK_K) * BLOCK_K
  pos = jnp.arange(padded, dtype=jnp.int32)
  lengths = (jnp.full((s_q,), topk, jnp.int32) if topk_length is None
             else jnp.clip(topk_length, 0, topk))
  indices = jnp.pad(indices, ((0, 0), (0, padded - topk)), constant_values=-1)
  keep = (pos[None, :] < lengths[:, None]) & (indices >= 0) & (indices < s_kv)
  indices = jnp.where(keep, indices, -1)
  sink = (jnp.full((h_q,), -jnp.inf, jnp.float32) if attn_sink is None
          else attn_sink.astype(jnp.float32))

  swizzled = _swizzled(plgpu)
  rope = max(d_qk - D_MAIN, TILE)  # d_qk 512: an unused 64-column stand-in
  smem = (
      plgpu.SMEM((2, BLOCK_H, HALF), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((BLOCK_H, rope), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((NUM_STAGES, 2, BLOCK_K, HALF), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((NUM_STAGES, BLOCK_K, rope), jnp.bfloat16, transforms=swizzled),
      plgpu.SMEM((NUM_STAGES, BLOCK_K), jnp.int32),
      plgpu.SMEM((BLOCK_H,), jnp.float32),
      plgpu.SMEM((2, BLOCK_H), jnp.float32),
  )
  q_copies = 2 + (d_qk > D_MAIN) + 1  # NoPE halves, RoPE, sink
  barriers = (
      plgpu.Barrier(num_arrivals=q_copies),
      plgpu.Barrier(num_arrivals=1, num_barriers=NUM_STAGES),  # stage gathered (producer)
      plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),  # stage free: both consumers
      plgpu.Barrier(num_arrivals=2),  # both consumers done with the query
  )
  kernel = functools.partial(_prefill_kernel, plgpu=plgpu, h_q=h_q, s_kv=s_kv, d_qk=d_qk,
                             scale=sm_scale * LOG2E)

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                  barriers, collective_axes="wg")

  rows = s_q * h_q
  out_type = (jax.ShapeDtypeStruct((rows, D_MAIN), jnp.bfloat16),
              jax.ShapeDtypeStruct((rows,), jnp.float32),
              jax.ShapeDtypeStruct((rows,), jnp.float32))
  out, max_logits, lse = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): out_type},
      # The head blocks of one token are adjacent in launch order (the last grid axis
      # is blockIdx.x): they gather the same rows, which L2 then serves once.
      grid=(s_q, h_q // BLOCK_H), grid_names=("t", "h"), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lengths, indices, q.reshape(rows, d_qk), kv, sink)
  return (out.reshape(s_q, h_q, D_MAIN), max_logits.reshape(s_q, h_q),
          lse.reshape(s_q, h_q))
