"""Pallas Mosaic GPU (Hopper) kernels of the sparse MLA prefill backward: ``dkv`` and ``dq``.

The ``dq`` kernel (:func:`sparse_prefill_dq`) is the transposed forward's machine with
the backward's math. The ``dkv`` kernel (:func:`sparse_prefill_dkv`): ``dK`` rows leave
a sparse backward scattered: row ``idx[t, k]`` gets ``sm_scale ds^T q + (f p)^T dO`` from
every (token, head) that picked it. The Triton kernel adds them with float32 atomics,
one per (token, key, column), and at about 1e11 a second on an H100 they bound it (73 ms
of its 98.5 at the V3.2 shape). This kernel sums a token's heads in registers and then
adds each gathered row straight from them with vector reds (``red.global.add.v4.f32``,
16 bytes a lane, L2 ``evict_last``): 25.2 ms at V3.2, against 28.0 with the earlier SMEM
staging and TMA bulk reduce-adds (``cp.reduce.async.bulk``), which held the CTA's SMEM
until the reduce had read it. The adds still cost 9.1 ms of the 25.1 (16.0 with them
predicated off): a CTA's warps hold the SM until they have issued all of them, so they
overlap little of the next CTA's work.

One CTA takes 64 of one token's keys (``idx[t, 64 j : 64 j + 64]``, gathered once into
SMEM by the producer warpgroup with :func:`.mosaic_gather.gather_fn`) and streams the
token's heads, ``HEADS`` at a time (``Q``, ``dO`` and the heads' LSE, ``f`` and ``b``;
one buffer: with the keys, 64-head blocks of ``Q`` and ``dO`` fill the SMEM). The keys
sit on the wgmma M side (``S^T = K Q^T``, 64 x ``HEADS``), and the two consumer
warpgroups split each block's work evenly:

- warpgroup 0: ``S^T``, ``P^T = exp2(S^T - lse)`` (masked by the keys' validity) handed
  over through SMEM, then ``dKV[:, :256] += (f P^T) dO[:, :256] + dS^T Q[:, :256]``;
- warpgroup 1: ``dP^T = V dO^T``, ``dS^T = sm_scale P^T (f dP^T + b)`` handed back,
  then ``dKV[:, 256:] += dS^T Q[:, 256:] + (f P^T) dO[:, 256:512]``.

``P^T`` and ``dS^T`` enter the ``dKV`` products from registers. At the end each
warpgroup adds its float32 accumulators into ``dkv[idx]`` (:func:`_add_rows`); invalid
or masked indices (``-1`` after :func:`.mosaic_gather.clean_indices`) add nothing,
duplicates add.

Shapes: bf16, ``d_v`` 512, ``d_qk`` 576 or 512, any ``h_q`` (padded to a multiple of
``HEADS``; at ``h_q`` 16, padded to 64, the kernel takes 18.9 ms at the V3.2 shape
against 25.2 at 128 heads: half the products, the same row adds).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _mosaic
from jax_mla._common import LOG2E
from jax_mla.sparse_mla.mosaic_gather import (
  BLOCK_K,
  D_MAIN,
  HALF,
  clean_indices,
  first_steps,
  gather_fn,
  kernel_inputs,
  produce,
  stage_fn,
  swizzled,
  wait_copies_fn,
)
from jax_mla.sparse_mla.mosaic_transposed import MIN_ROW, head_blocks

HEADS = 64  # query heads per streamed block: S^T's wgmma N, the dKV products' K
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40  # 2 * 232 + 40 = 3 * 168


def supported(q, d_v: int) -> bool:
  """Whether the Mosaic GPU kernels take ``q[s_q, h_q, d_qk]`` (any ``h_q``; else the
  Triton ones)."""
  return q.dtype == jnp.bfloat16 and d_v == D_MAIN and q.shape[2] in (D_MAIN, D_MAIN + 64)


def _dkv_kernel(q_ref, do_ref, vec_ref, len_ref, idx_ref, kv_ref, dkv_ref, smem, barriers,
                *, plgpu, gather, num_blocks, h_q, scale, sm_scale):
  (k_main, k_rope, q_main, q_rope, do_s), p_s, ds_s, vec_s, key_rows = smem
  valid, staged = key_rows.at[pl.ds(0, 1)], key_rows.at[pl.ds(1, 1)]  # validity, index
  kv_bar, q_bar, free, p_ready, ds_ready = barriers
  has_rope = k_rope is not None
  pid = lax.axis_index("b")
  t, j = lax.div(pid, num_blocks), lax.rem(pid, num_blocks)
  wg = lax.axis_index("wg")
  num_heads = h_q // HEADS
  active = j * BLOCK_K < len_ref[t]  # a block past the token's keys adds nothing

  @pl.when(active & (wg == 2))
  def _producer():
    _mosaic.set_registers(plgpu, PRODUCER_REGISTERS, 3)
    idx_block = idx_ref.at[t, pl.ds(j * BLOCK_K, BLOCK_K)]
    stage = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))(stage_fn)
    stage(idx_block, staged.at[0])
    swizzled_ref = plgpu.RefType(swizzled(plgpu))
    plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), swizzled_ref, swizzled_ref)
                      + (plgpu.RefType(),) * 3)(gather)(
        idx_block, kv_ref, k_main, k_rope if has_rope else q_rope, valid.at[0],
        staged.at[0], staged.at[0])  # no next block: restages the same indices
    plgpu.inline_mgpu()(wait_copies_fn)()
    plgpu.commit_smem()
    plgpu.barrier_arrive(kv_bar)

    @pl.loop(0, num_heads)
    def _(i):
      pl.when(i > 0)(lambda: plgpu.barrier_wait(free))
      rows = pl.ds(t * h_q + i * HEADS, HEADS)
      for h in range(2):
        plgpu.copy_gmem_to_smem(q_ref.at[rows, pl.ds(h * HALF, HALF)], q_main.at[h], q_bar)
        plgpu.copy_gmem_to_smem(do_ref.at[rows, pl.ds(h * HALF, HALF)], do_s.at[h], q_bar)
      if has_rope:
        plgpu.copy_gmem_to_smem(q_ref.at[rows, pl.ds(D_MAIN, q_rope.shape[-1])], q_rope,
                                q_bar)
      plgpu.copy_gmem_to_smem(vec_ref.at[t, :, pl.ds(i * HEADS, HEADS)], vec_s, q_bar)

  @pl.when(active & (wg < 2))
  def _consumer():
    _mosaic.set_registers(plgpu, CONSUMER_REGISTERS, 3)
    wgmma_layout = lambda x: plgpu.layout_cast(x, plgpu.Layout.WGMMA)  # noqa: E731
    head_vec = lambda k: _head_vec(plgpu, vec_s.at[k], HEADS)  # noqa: E731
    plgpu.barrier_wait(kv_bar)
    ok = plgpu.load(valid.at[0], (), layout=_mosaic.row_layout(plgpu), optimized=False)
    key_ok = lax.broadcast_in_dim(ok, (BLOCK_K, HEADS), [0]) != 0

    @pl.when(wg == 0)
    def _wg0():
      def step(i, acc):
        del i
        plgpu.barrier_wait(q_bar)
        k_tiles = [k_main.at[0], k_main.at[1]] + ([k_rope] if has_rope else [])
        q_tiles = [q_main.at[0], q_main.at[1]] + ([q_rope] if has_rope else [])
        s_t = _keys_by_heads(plgpu, k_tiles, q_tiles, HEADS)
        p_t = jnp.where(key_ok, jnp.exp2(s_t * scale - head_vec(0)), 0.0)
        p_s[...] = p_t.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
        fp_t = (p_t * head_vec(1)).astype(jnp.bfloat16)
        acc = _accumulate(plgpu, acc, [(fp_t, do_s.at[wg])])
        plgpu.barrier_wait(ds_ready)
        ds_t = ds_s[...]
        acc = _accumulate(plgpu, acc, [(ds_t, q_main.at[wg])])
        plgpu.barrier_arrive(free)
        return acc

      acc = lax.fori_loop(0, num_heads, step, wgmma_layout(jnp.zeros((BLOCK_K, HALF),
                                                                     jnp.float32)))
      _add_rows(plgpu, acc, staged.at[0], dkv_ref, 0)

    @pl.when(wg == 1)
    def _wg1():
      def step(i, accs):
        del i
        plgpu.barrier_wait(q_bar)
        dp_t = _keys_by_heads(plgpu, [k_main.at[0], k_main.at[1]], [do_s.at[0], do_s.at[1]],
                              HEADS)
        plgpu.barrier_wait(p_ready)
        p_t = p_s[...].astype(jnp.float32)
        ds_t = (sm_scale * p_t * (head_vec(1) * dp_t + head_vec(2))).astype(jnp.bfloat16)
        ds_s[...] = ds_t
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_ready)
        fp_t = (p_t * head_vec(1)).astype(jnp.bfloat16)
        main = _accumulate(plgpu, accs[0], [(ds_t, q_main.at[wg]), (fp_t, do_s.at[wg])])
        rope = (_accumulate(plgpu, accs[1], [(ds_t, q_rope)]),) if has_rope else ()
        plgpu.barrier_arrive(free)
        return (main, *rope)

      zeros = lambda cols: wgmma_layout(jnp.zeros((BLOCK_K, cols), jnp.float32))  # noqa: E731
      accs = (zeros(HALF),) + ((zeros(q_rope.shape[-1]),) if has_rope else ())
      accs = lax.fori_loop(0, num_heads, step, accs)
      _add_rows(plgpu, accs[0], staged.at[0], dkv_ref, HALF)
      if has_rope:
        _add_rows(plgpu, accs[1], staged.at[0], dkv_ref, D_MAIN)


def _head_vec(plgpu, vec, heads: int):
  """A per-head float32 SMEM vector ``[heads]`` as the columns of a ``[64 keys, heads]``
  tile (WGMMA layout)."""
  v = plgpu.load(vec, (), layout=_mosaic.col_layout(plgpu), optimized=False)
  return lax.broadcast_in_dim(v, (BLOCK_K, heads), [1])


def _keys_by_heads(plgpu, k_tiles, q_tiles, heads: int):
  """float32 ``[64 keys, heads] = sum_i k_tiles[i] q_tiles[i]^T`` (``S^T = K Q^T`` and
  ``dP^T = V dO^T`` over the column tiles)."""
  def run(ref):
    for k_tile, q_tile in zip(k_tiles, q_tiles, strict=True):
      plgpu.wgmma(ref, k_tile, q_tile.transpose((1, 0)))
    return ref[...]
  return pl.run_scoped(run, plgpu.ACC((BLOCK_K, heads), jnp.float32))


def _accumulate(plgpu, acc, products):
  """``acc + sum a @ b`` over ``(a, b)`` in ``products`` (wgmma; ``a`` in registers or
  SMEM). The operands must index their tiles with traced values only: jax 0.11's
  lowering of this ``run_state`` rejects a constant index (a Python int, a folded
  ``lax.rem(i, 1)``), so a warpgroup's half of the columns is ``.at[wg]``."""
  def run(ref):
    for a, b in products:
      plgpu.wgmma(ref, a, b)
  return pl.run_state(run)(plgpu.ACC.init(acc))


# Four float32 adds into global memory, skipped for a row index < 0 (operands: address,
# the four values, the row index). A red: fire and forget, so the warp moves on (or
# exits) while the L2 drains it; evict_last keeps the accumulated rows in L2 before the
# gathered rows and the streamed queries.
_RED_V4_ASM = ("{.reg .pred p; .reg .b64 pol; setp.ge.s32 p, $5, 0; "
               "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
               "@p red.relaxed.gpu.global.add.L2::cache_hint.v4.f32 [$0], {$1, $2, $3, $4}, "
               "pol;}")


def _add_rows(plgpu, acc, idx_s, dkv_ref, col: int):
  """``dkv[idx_s[r], col + c] += acc[r, c]`` for the float32 ``acc[64, w]`` (WGMMA
  layout) of a warpgroup, rows with ``idx_s[r] < 0`` skipped, from registers (no SMEM
  staging, no wait).

  In the WGMMA layout a lane holds two columns of rows ``r`` and ``r + 8`` for each
  8-column tile, and its neighbour (lane ^ 1) the next two: one exchange gives the even
  lane four columns of row ``r`` and the odd lane four of row ``r + 8``, so each lane
  adds 16 bytes with one ``red.v4``."""
  def add(ctx, acc, idx_ref, dkv_ref):
    del ctx
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    assert acc.layout == mgpu.WGMMA_LAYOUT and acc.registers.shape[4] == 2, acc.layout
    i32, i64, f32 = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                     ir.F32Type.get())
    index = ir.IndexType.get()
    width = ir.MemRefType(dkv_ref.type).shape[1]
    base = llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                              mgpu_utils.memref_ptr(dkv_ref))
    odd = arith.cmpi(arith.CmpIPredicate.ne,
                     arith.andi(mgpu.thread_idx(), mgpu_utils.c(1, i32)), mgpu_utils.c(0, i32))
    first_of = lambda v: vector.extract(v, dynamic_position=[], static_position=[0])  # noqa: E731
    second_of = lambda v: vector.extract(v, dynamic_position=[], static_position=[1])  # noqa: E731
    # Registers [column tile j, row r / r + 8]; thread_idxs gives each one's (row, col).
    regs = acc.registers.reshape(-1, 2)
    places = list(acc.layout.thread_idxs(acc.shape))[::2]
    for (a, b), (row, c) in zip(regs, places, strict=True):
      other = mgpu_utils.shfl_bfly(arith.select(odd, a, b), 1)
      lo, hi = arith.select(odd, other, a), arith.select(odd, b, other)
      row = arith.select(odd, arith.addi(row, mgpu_utils.c(8, index)), row)
      c = arith.select(odd, arith.subi(c, mgpu_utils.c(2, index)), c)
      idx = memref.load(idx_ref, [row])
      off = arith.addi(arith.muli(arith.extsi(i64, idx), mgpu_utils.c(width, i64)),
                       arith.index_cast(i64, arith.addi(c, mgpu_utils.c(col, index))))
      llvm.inline_asm(ir.Type.parse("!llvm.void"),
                      [mgpu_utils.getelementptr(base, [off], f32), first_of(lo), second_of(lo),
                       first_of(hi), second_of(hi), idx],
                      _RED_V4_ASM, "l,f,f,f,f,r", has_side_effects=True)

  plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()))(add)(
      acc, idx_s, dkv_ref)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def sparse_prefill_dkv(q, kv, indices, lengths, d_out, lse, coef, bias, *, sm_scale: float):
  """float32 ``dkv[s_kv, d_qk]`` of sparse prefill (shapes and terms as
  :func:`jax_mla.sparse_mla.triton_backward.sparse_prefill_bwd`'s; :func:`supported`).
  Under ``jax.vmap`` one call takes the whole batch (:func:`fold_batch`)."""
  dkv = fold_batch(functools.partial(_dkv_call, sm_scale=sm_scale))
  return dkv(q, kv, indices, lengths, d_out, lse, coef, bias)


def fold_batch(dkv_fn):
  """``dkv_fn(q, kv, indices, lengths, *per_token)`` (``dkv[s_kv, d]`` from tokens
  ``[s_q, ...]`` attending rows of ``kv[s_kv, d]``), batched under ``jax.vmap`` by one
  call over the batch's tokens and rows laid end to end: element ``b``'s indices move
  by ``b * s_kv`` (unusable ones stay ``-1``, never reaching another element's rows)."""
  fn = jax.custom_batching.custom_vmap(dkv_fn)

  @fn.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched, strict=True)]
    q, kv, indices, lengths, *per_token = args
    s_kv = kv.shape[1]
    usable = (indices >= 0) & (indices < s_kv)
    indices = jnp.where(usable, indices + (jnp.arange(axis_size) * s_kv)[:, None, None], -1)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    out = fn(*map(flat, (q, kv, indices, lengths, *per_token)))
    return out.reshape(axis_size, s_kv, -1), True

  return fn


def _padded_heads(h_pad: int, q, d_out, lse, coef, bias):
  """``(q, d_out bf16, vec float32 [s_q, 3, h_pad])`` with the heads padded to ``h_pad``:
  padding heads have zero queries and ``lse = +inf`` (so ``p = 0``: they add nothing);
  ``vec`` stacks each head's ``lse`` (base 2), ``f`` and ``b``."""
  pad = lambda x, fill=0: jnp.pad(  # noqa: E731
      x, [(0, 0), (0, h_pad - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
  vec = jnp.stack([pad(lse * LOG2E, jnp.inf), pad(coef), pad(bias)], axis=1)
  return pad(q), pad(d_out.astype(jnp.bfloat16)), vec.astype(jnp.float32)


def _dkv_call(q, kv, indices, lengths, d_out, lse, coef, bias, *, sm_scale: float):
  plgpu = _mosaic.plgpu()
  q, d_out, vec = _padded_heads(-(-q.shape[1] // HEADS) * HEADS, q, d_out, lse, coef, bias)
  s_q, h_q, d_qk = q.shape
  s_kv = kv.shape[0]
  lengths = jnp.clip(lengths, 0, indices.shape[1])
  idx = clean_indices(indices, lengths, s_kv)
  num_blocks = idx.shape[1] // BLOCK_K
  rope = d_qk - D_MAIN
  gather = gather_fn(fmt=None, num_slots=s_kv, block_size=1, row_bytes=d_qk * 2, d_qk=d_qk)

  tiles = lambda *shape: plgpu.SMEM(shape, jnp.bfloat16, transforms=swizzled(plgpu))  # noqa: E731
  exchange = tiles(BLOCK_K, HEADS)
  compute = (tiles(2, BLOCK_K, HALF), tiles(BLOCK_K, rope) if rope else None,
             tiles(2, HEADS, HALF), tiles(HEADS, rope if rope else 64),  # 512: a stand-in
             tiles(2, HEADS, HALF))
  # The swizzled tiles first: each is 1024-byte aligned.
  smem = (compute, exchange, exchange,
          plgpu.SMEM((3, HEADS), jnp.float32), plgpu.SMEM((2, BLOCK_K), jnp.int32))
  copies = 4 + (rope > 0) + 1  # Q and dO halves, Q's RoPE, the vectors
  barriers = (
      plgpu.Barrier(num_arrivals=1),  # the keys gathered
      plgpu.Barrier(num_arrivals=copies),  # a head block loaded
      plgpu.Barrier(num_arrivals=2),  # its buffers free
      plgpu.Barrier(num_arrivals=1),  # P^T handed over
      plgpu.Barrier(num_arrivals=1),  # dS^T handed back
  )
  kernel = functools.partial(_dkv_kernel, plgpu=plgpu, gather=gather, num_blocks=num_blocks,
                             h_q=h_q, scale=float(sm_scale) * LOG2E, sm_scale=float(sm_scale))

  def body(refs):
    def entry():
      pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                    barriers, collective_axes="wg")

    mesh = plgpu.Mesh(grid=(s_q * num_blocks,), grid_names=("b",), num_threads=3,
                      thread_name="wg")
    pl.kernel(entry, (), mesh=mesh, compiler_params=plgpu.CompilerParams(approx_math=True))()

  operands = (q.reshape(s_q * h_q, d_qk), d_out.reshape(s_q * h_q, D_MAIN), vec, lengths, idx,
              kv, jnp.zeros((s_kv, d_qk), jnp.float32))
  return pl.run_state(body)(operands)[-1]


DQ_STAGES = 2  # gathered key stages of the dq kernel


def _dq_kernel(len_ref, q_ref, do_ref, vec_ref, idx_ref, kv_ref, dq_ref, smem, barriers, *,
               plgpu, gather, heads, h_pad, scale, sm_scale):
  q_main, q_rope, do_s, kv_main, kv_rope, valid, vec_s, p_x, ds_s = smem
  q_bar, kv_bar, free, p_ready, ds_ready, done = barriers
  has_rope = q_rope is not None
  t, hb = lax.axis_index("t"), lax.axis_index("h")
  wg = lax.axis_index("wg")
  r0 = t * h_pad + hb * heads
  first = first_steps(len_ref, t, 1)
  rows = pl.ds(r0, heads)

  @pl.when(wg == 2)
  def _producer():
    _mosaic.set_registers(plgpu, PRODUCER_REGISTERS, 3)
    q_copies = [(q_ref.at[rows, pl.ds(h * HALF, HALF)], q_main.at[h]) for h in range(2)]
    q_copies += [(do_ref.at[rows, pl.ds(h * HALF, HALF)], do_s.at[h]) for h in range(2)]
    if has_rope:
      q_copies.append((q_ref.at[rows, pl.ds(D_MAIN, q_rope.shape[-1])], q_rope))
    q_copies.append((vec_ref.at[t * lax.axis_size("h") + hb], vec_s))
    produce(plgpu, t=t, q_copies=q_copies, gathers=(gather,), idx_refs=(idx_ref,),
            kv_refs=(kv_ref,), kv_main=kv_main, kv_rope=kv_rope, valid=valid,
            barriers=(q_bar, kv_bar, free), first=first)

  @pl.when(wg < 2)
  def _consumer():
    _mosaic.set_registers(plgpu, CONSUMER_REGISTERS, 3)
    shape = (BLOCK_K, heads)
    head_vec = lambda k: _head_vec(plgpu, vec_s.at[k, pl.ds(0, heads)], heads)  # noqa: E731

    def add_dq(acc, k_tile):  # dQ^T += K^T dS^T
      return _accumulate(plgpu, acc, [(k_tile.transpose((1, 0)), ds_s.transpose((1, 0)))])

    plgpu.barrier_wait(q_bar)
    zeros = lambda n: plgpu.layout_cast(jnp.zeros((n, heads), jnp.float32),  # noqa: E731
                                        plgpu.Layout.WGMMA)

    @pl.when(wg == 0)
    def _wg0():
      def step(i, acc):
        slot = lax.rem(i, DQ_STAGES)
        plgpu.barrier_wait(kv_bar.at[slot])
        ok = plgpu.load(valid.at[slot], (), layout=_mosaic.row_layout(plgpu), optimized=False)
        k_tiles = [kv_main.at[slot, 0], kv_main.at[slot, 1]] + (
            [kv_rope.at[slot]] if has_rope else [])
        q_tiles = [q_main.at[0], q_main.at[1]] + ([q_rope] if has_rope else [])
        s_t = _keys_by_heads(plgpu, k_tiles, q_tiles, heads)
        p_t = jnp.where(lax.broadcast_in_dim(ok, shape, [0]) != 0,
                        jnp.exp2(s_t * scale - head_vec(0)), 0.0)
        p_x[...] = p_t.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready)
        plgpu.barrier_wait(ds_ready)
        acc = add_dq(acc, kv_main.at[slot, wg])
        plgpu.barrier_arrive(free.at[slot])
        return acc

      acc = lax.fori_loop(0, first[-1], step, zeros(HALF))
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)  # both are done with Q: its tiles stage dQ
      _store_transposed(plgpu, q_main.at[wg], acc)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_main.at[wg], dq_ref.at[rows, pl.ds(wg * HALF, HALF)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _wg1():
      def step(i, accs):
        slot = lax.rem(i, DQ_STAGES)
        plgpu.barrier_wait(kv_bar.at[slot])
        dp_t = _keys_by_heads(plgpu, [kv_main.at[slot, 0], kv_main.at[slot, 1]],
                              [do_s.at[0], do_s.at[1]], heads)
        plgpu.barrier_wait(p_ready)
        p_t = p_x[...].astype(jnp.float32)
        ds_t = sm_scale * p_t * (head_vec(1) * dp_t + head_vec(2))
        _store_transposed(plgpu, ds_s, ds_t)
        plgpu.commit_smem()
        plgpu.barrier_arrive(ds_ready)
        main = add_dq(accs[0], kv_main.at[slot, wg])
        rope = (add_dq(accs[1], kv_rope.at[slot]),) if has_rope else ()
        plgpu.barrier_arrive(free.at[slot])
        return (main, *rope)

      accs = (zeros(HALF),) + ((zeros(q_rope.shape[-1]),) if has_rope else ())
      accs = lax.fori_loop(0, first[-1], step, accs)
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
      _store_transposed(plgpu, q_main.at[wg], accs[0])
      if has_rope:
        _store_transposed(plgpu, q_rope, accs[1])
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_main.at[wg], dq_ref.at[rows, pl.ds(wg * HALF, HALF)])
      if has_rope:
        plgpu.copy_smem_to_gmem(q_rope, dq_ref.at[rows, pl.ds(D_MAIN, q_rope.shape[-1])])
      plgpu.wait_smem_to_gmem(0)


def _store_transposed(plgpu, tile, x):
  """``tile[heads, n] = x^T`` for a float32 ``x[n, heads]`` in the WGMMA layout (bf16)."""
  tile.transpose((1, 0))[...] = plgpu.layout_cast(x.astype(jnp.bfloat16),
                                                  plgpu.Layout.WGMMA_TRANSPOSED)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def sparse_prefill_dq(q, kv, indices, lengths, d_out, lse, coef, bias, *, sm_scale: float):
  """bf16 ``dq[s_q, h_q, d_qk]`` of sparse prefill (arguments as :func:`sparse_prefill_dkv`;
  :func:`supported`).

  One CTA takes a token and a block of at most 32 of its heads (the transposed forward's
  :func:`.mosaic_transposed.head_blocks`) and consumes the token's gathered key stages
  (:func:`.mosaic_gather.produce`, two stages) with the keys on the wgmma M side:
  warpgroup 0 computes ``S^T = K Q^T`` and ``P^T`` (handed over through SMEM),
  warpgroup 1 ``dP^T = V dO^T`` and ``dS^T`` (handed back, transposed); each adds ``K^T
  dS^T`` into its rows of ``dQ^T`` (0-255; 256-511 and the RoPE 64).
  """
  plgpu = _mosaic.plgpu()
  s_q, h_q, d_qk = q.shape
  blocks, heads = head_blocks(h_q)
  h_pad = blocks * heads
  row = max(heads, MIN_ROW)
  gathers, lens, (idx,), (rows,) = kernel_inputs([(kv[:, None], indices, lengths)], (None,),
                                                 d_qk)
  q, d_out, vec = _padded_heads(h_pad, q, d_out, lse, coef, bias)
  # Per (token, head block): the block's [3, heads] vectors, rows padded to `row`.
  vec = vec.reshape(s_q, 3, blocks, heads).transpose(0, 2, 1, 3)
  vec = jnp.pad(vec, ((0, 0), (0, 0), (0, 0), (0, row - heads))).reshape(s_q * blocks, 3, row)

  tiles = lambda *shape: plgpu.SMEM(shape, jnp.bfloat16, transforms=swizzled(plgpu))  # noqa: E731
  rope = d_qk - D_MAIN
  exchange = plgpu.SMEM((BLOCK_K, heads), jnp.bfloat16,
                        transforms=(plgpu.TilingTransform((8, heads)),
                                    plgpu.SwizzleTransform(2 * heads)))
  smem = (tiles(2, heads, HALF), tiles(heads, rope) if rope else None, tiles(2, heads, HALF),
          tiles(DQ_STAGES, 2, BLOCK_K, HALF), tiles(DQ_STAGES, BLOCK_K, max(rope, 64)),
          plgpu.SMEM((DQ_STAGES + 2, BLOCK_K), jnp.int32), plgpu.SMEM((3, row), jnp.float32),
          exchange, tiles(heads, BLOCK_K))
  barriers = (
      plgpu.Barrier(num_arrivals=4 + (rope > 0) + 1),  # Q, dO and the vectors loaded
      plgpu.Barrier(num_arrivals=1, num_barriers=DQ_STAGES),  # stage gathered
      plgpu.Barrier(num_arrivals=2, num_barriers=DQ_STAGES),  # stage free: both consumers
      plgpu.Barrier(num_arrivals=1),  # P^T handed over
      plgpu.Barrier(num_arrivals=1),  # dS^T handed back
      plgpu.Barrier(num_arrivals=2),  # both consumers done with Q
  )
  kernel = functools.partial(_dq_kernel, plgpu=plgpu, gather=gathers[0], heads=heads,
                             h_pad=h_pad, scale=float(sm_scale) * LOG2E,
                             sm_scale=float(sm_scale))

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                  barriers, collective_axes="wg")

  dq = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): jax.ShapeDtypeStruct((s_q * h_pad, d_qk),
                                                                   jnp.bfloat16)},
      grid=(s_q, blocks), grid_names=("t", "h"), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lens, q.reshape(s_q * h_pad, d_qk), d_out.reshape(s_q * h_pad, D_MAIN), vec, idx, rows)
  return dq.reshape(s_q, h_pad, d_qk)[:, :h_q]
