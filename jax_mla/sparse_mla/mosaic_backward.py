"""Pallas Mosaic GPU (Hopper) kernel of the sparse MLA prefill backward: ``dq`` and ``dkv``.

``dK`` rows leave a sparse backward scattered: row ``idx[t, k]`` gets ``sm_scale ds^T q +
(f p)^T dO`` from every (token, head) that picked it. The Triton kernel adds them with
float32 atomics, one per (token, key, column), and at about 1e11 a second on an H100 they
bound it (73 ms of its 98.5 at the V3.2 shape). This kernel (:func:`sparse_prefill_bwd`)
computes ``S`` and ``dP`` once per (token, head, key) for both gradients, and adds each
64-key block's ``dKV`` rows from registers with vector reds inside its key loop, while
the other warpgroup's products of the next block run (cuDNN frontend's sm90 DSA backward
splits the work the same way).

One CTA takes a token and 64 of its heads: ``Q`` and ``dO' = f dO`` (the sink factor
folded in, so ``dP' = f dP`` and ``dV = P^T dO'``) and the heads' LSE and ``b`` are
loaded once; the producer warpgroup gathers the token's 64-key blocks into one K buffer
(:func:`.mosaic_gather.gather_fn`). Per block:

- warpgroup 0: ``S = Q K^T``, ``dP' = dO' V^T``, ``P`` (masked by the keys' validity)
  and ``dS = sm_scale P (dP' + b)``, both handed over through SMEM, then ``dQ[:, :256]
  += dS K`` with ``dS`` from registers;
- warpgroup 1: ``dQ[:, 256:] += dS K``, which frees the K buffer for the next gather,
  then ``dKV`` 128 columns at a time (``dS^T Q + P^T dO'``, the RoPE 64 last), each
  chunk added at once (:func:`_add_rows`), while warpgroup 0 computes the next block.

Each (token, 64-head block) adds its own rows, so at ``h_q`` 128 a key row gets two adds
per token (38.6 GB of float32 adds at the V3.2 shape, as cuDNN's); the adds, not the
products, set the pace. Invalid or masked indices (``-1`` after
:func:`.mosaic_gather.clean_indices`) add nothing, duplicates add.

Shapes: bf16, ``d_v`` 512, ``d_qk`` 576 or 512, any ``h_q`` (padded to a multiple of 64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _inline, _mosaic
from jax_mla._common import LOG2E
from jax_mla.sparse_mla.mosaic_gather import (
  BLOCK_K,
  D_MAIN,
  HALF,
  clean_indices,
  gather_fn,
  stage_fn,
  wait_copies_fn,
)

HEADS = 64  # query heads per CTA: the wgmma M of S, dP and dQ
DKV_CHUNK = 128  # dKV columns per product and add
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40  # 2 * 232 + 40 = 3 * 168


def supported(q, d_v: int) -> bool:
  """Whether the Mosaic GPU kernel takes ``q[s_q, h_q, d_qk]`` (any ``h_q``; else the
  Triton ones)."""
  return q.dtype == jnp.bfloat16 and d_v == D_MAIN and q.shape[2] in (D_MAIN, D_MAIN + 64)


def _kernel(q_ref, do_ref, vec_ref, len_ref, idx_ref, kv_ref, dq_ref, dkv_ref, smem, barriers,
            *, plgpu, gather, h_pad, scale, sm_scale):
  (q_main, q_rope, do_s, k_main, k_rope), p_s, ds_s, vec_s, key_rows = smem
  q_bar, kv_bar, k_free, pds_ready, pds_free, done = barriers
  has_rope = q_rope is not None
  t, hb = lax.axis_index("t"), lax.axis_index("h")
  wg = lax.axis_index("wg")
  rows = pl.ds(t * h_pad + hb * HEADS, HEADS)
  steps = lax.div(len_ref[t] + BLOCK_K - 1, BLOCK_K)

  @pl.when(wg == 2)
  def _producer():
    _mosaic.set_registers(plgpu, PRODUCER_REGISTERS, 3)
    for h in range(2):
      plgpu.copy_gmem_to_smem(q_ref.at[rows, pl.ds(h * HALF, HALF)], q_main.at[h], q_bar)
      plgpu.copy_gmem_to_smem(do_ref.at[rows, pl.ds(h * HALF, HALF)], do_s.at[h], q_bar)
    if has_rope:
      plgpu.copy_gmem_to_smem(q_ref.at[rows, pl.ds(D_MAIN, q_rope.shape[-1])], q_rope, q_bar)
    plgpu.copy_gmem_to_smem(vec_ref.at[t, :, pl.ds(hb * HEADS, HEADS)], vec_s, q_bar)
    stage = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))(stage_fn)
    swizzled_ref = plgpu.RefType(_mosaic.swizzled(plgpu))
    gather_call = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(), swizzled_ref, swizzled_ref)
        + (plgpu.RefType(),) * 3)(gather)

    @pl.loop(0, steps)
    def _(i):
      slot = lax.rem(i, 2)
      pl.when(i > 0)(lambda: plgpu.barrier_wait(k_free))
      idx_block = idx_ref.at[t, pl.ds(i * BLOCK_K, BLOCK_K)]
      staged = key_rows.at[slot, 1]
      # This block's indices, staged now and not one block ahead (the gather's "next"
      # arguments restage them in place): the other slot still holds the previous
      # block's indices, which warpgroup 1's adds read after the keys are freed.
      stage(idx_block, staged)
      gather_call(idx_block, kv_ref, k_main, k_rope,
                  key_rows.at[slot, 0], staged, staged)
      plgpu.inline_mgpu()(wait_copies_fn)()
      plgpu.commit_smem()
      plgpu.barrier_arrive(kv_bar)

  @pl.when(wg < 2)
  def _consumer():
    _mosaic.set_registers(plgpu, CONSUMER_REGISTERS, 3)
    wgmma_layout = lambda x: plgpu.layout_cast(x, plgpu.Layout.WGMMA)  # noqa: E731
    zeros = lambda n: wgmma_layout(jnp.zeros((HEADS, n), jnp.float32))  # noqa: E731

    def head_vec(k):  # per-head vector as the rows of a [heads, keys] tile
      v = plgpu.load(vec_s.at[k], (), layout=_mosaic.row_layout(plgpu), optimized=False)
      return lax.broadcast_in_dim(v, (HEADS, BLOCK_K), [0])

    plgpu.barrier_wait(q_bar)

    @pl.when(wg == 0)
    def _wg0():
      def step(i, acc):
        slot = lax.rem(i, 2)
        plgpu.barrier_wait(kv_bar)
        ok = plgpu.load(key_rows.at[slot, 0], (), layout=_mosaic.col_layout(plgpu),
                        optimized=False)
        key_ok = lax.broadcast_in_dim(ok, (HEADS, BLOCK_K), [1]) != 0
        q_tiles = [q_main.at[0], q_main.at[1]] + ([q_rope] if has_rope else [])
        k_tiles = [k_main.at[0], k_main.at[1]] + ([k_rope] if has_rope else [])

        def products(s_ref, dp_ref):
          for a, b in zip(q_tiles, k_tiles, strict=True):
            plgpu.wgmma(s_ref, a, b.transpose((1, 0)))
          for h in range(2):
            plgpu.wgmma(dp_ref, do_s.at[h], k_main.at[h].transpose((1, 0)))
          return s_ref[...], dp_ref[...]

        s, dp = pl.run_scoped(products, plgpu.ACC((HEADS, BLOCK_K), jnp.float32),
                              plgpu.ACC((HEADS, BLOCK_K), jnp.float32))
        p = jnp.where(key_ok, jnp.exp2(s * scale - head_vec(0)), 0.0)
        ds = (sm_scale * p * (dp + head_vec(1))).astype(jnp.bfloat16)
        pl.when(i > 0)(lambda: plgpu.barrier_wait(pds_free))
        p_s[...] = p.astype(jnp.bfloat16)
        ds_s[...] = ds
        plgpu.commit_smem()
        plgpu.barrier_arrive(pds_ready)
        acc = _accumulate(plgpu, acc, [(ds, k_main.at[wg])])
        plgpu.barrier_arrive(k_free)
        return acc

      acc = lax.fori_loop(0, steps, step, zeros(HALF))
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)  # both are done with Q: its tiles stage dQ
      q_main.at[0][...] = acc.astype(jnp.bfloat16)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_main.at[0], dq_ref.at[rows, pl.ds(0, HALF)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _wg1():
      chunks = [(q_main.at[c * DKV_CHUNK // HALF, :, pl.ds(c * DKV_CHUNK % HALF, DKV_CHUNK)],
                 do_s.at[c * DKV_CHUNK // HALF, :, pl.ds(c * DKV_CHUNK % HALF, DKV_CHUNK)],
                 c * DKV_CHUNK) for c in range(D_MAIN // DKV_CHUNK)]
      if has_rope:
        chunks.append((q_rope, None, D_MAIN))

      def add_chunks(slot):
        """dKV[:, c] = dS^T Q[:, c] + P^T dO'[:, c] per column chunk, each added at once
        (issuing the adds after the next chunk's wgmma was slower: 43.9 against 33.1 ms
        at V3.2 with 64-column chunks)."""
        for q_tile, do_tile, col in chunks:
          pairs = [(ds_s.transpose((1, 0)), q_tile)]
          if do_tile is not None:
            pairs.append((p_s.transpose((1, 0)), do_tile))

          def run(ref, pairs=pairs):
            for a, b in pairs:
              plgpu.wgmma(ref, a, b)
            return ref[...]

          acc = pl.run_scoped(run, plgpu.ACC((BLOCK_K, q_tile.shape[-1]), jnp.float32))
          _add_rows(plgpu, acc, key_rows.at[slot, 1], dkv_ref, col)

      def step(i, accs):
        slot = lax.rem(i, 2)
        plgpu.barrier_wait(kv_bar)
        plgpu.barrier_wait(pds_ready)
        main = _accumulate(plgpu, accs[0], [(ds_s, k_main.at[wg])])
        rope = (_accumulate(plgpu, accs[1], [(ds_s, k_rope)]),) if has_rope else ()
        plgpu.barrier_arrive(k_free)
        add_chunks(slot)
        plgpu.barrier_arrive(pds_free)
        return (main, *rope)

      accs = (zeros(HALF),) + ((zeros(q_rope.shape[-1]),) if has_rope else ())
      accs = lax.fori_loop(0, steps, step, accs)
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
      q_main.at[1][...] = accs[0].astype(jnp.bfloat16)
      if has_rope:
        q_rope[...] = accs[1].astype(jnp.bfloat16)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_main.at[1], dq_ref.at[rows, pl.ds(HALF, HALF)])
      if has_rope:
        plgpu.copy_smem_to_gmem(q_rope, dq_ref.at[rows, pl.ds(D_MAIN, q_rope.shape[-1])])
      plgpu.wait_smem_to_gmem(0)


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
  staging, no wait); ``dkv``'s columns in the order of :func:`_lane_order`.

  In each group of 16 columns a lane holds four (two pairs) of each of its rows ``r``
  and ``r + 8``, and the lane four up (``lane ^ 4``) the same four of row ``r ^ 1``.
  One exchange per 32 columns gives each lane 16 bytes of the even row and 16 of the odd
  one, so that the 8 lanes of the two rows add one whole 128-byte line of each row with
  one ``red.v4`` apiece (in :func:`_lane_order` a lane's four columns of a group are
  adjacent); cuDNN's sm90 DSA backward lays its float32 scratch out the same way."""
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
    c_index, c64 = (lambda v: mgpu_utils.c(v, index)), (lambda v: mgpu_utils.c(v, i64))  # noqa: E731
    width = ir.MemRefType(dkv_ref.type).shape[1]
    base = _inline.global_ptr(dkv_ref)
    parity = arith.andi(arith.shrui(mgpu.thread_idx(), mgpu_utils.c(2, i32)),
                        mgpu_utils.c(1, i32))
    odd = arith.cmpi(arith.CmpIPredicate.ne, parity, mgpu_utils.c(0, i32))
    # Registers [column tile j, row r / r + 8]; thread_idxs gives each one's (row, col):
    # tile j holds columns 8 j + 2 (lane % 4) + (0, 1).
    regs = acc.registers.reshape(-1, 2)
    places = list(acc.layout.thread_idxs(acc.shape))
    lane_col = arith.index_cast(i64, places[0][1])  # 2 (lane % 4)
    # In a group of 16 columns this lane's four sit at 4 (lane % 4); an odd row's lane
    # adds the line's second group.
    lane_at = arith.addi(arith.addi(arith.muli(lane_col, c64(2)), c64(col)),
                         arith.muli(arith.extui(i64, parity), c64(16)))
    select = lambda x, y: [arith.select(odd, a, b) for a, b in zip(x, y, strict=True)]  # noqa: E731
    group = lambda g, i: (regs[2 * g, i], regs[2 * g + 1, i])  # noqa: E731  (16 columns)
    for i in range(2):
      row = places[i][0]
      rows = (arith.andi(row, c_index(~1)), arith.ori(row, c_index(1)))  # r and r ^ 1
      idxs = [memref.load(idx_ref, [r]) for r in rows]
      starts = [arith.addi(arith.muli(arith.extsi(i64, x), c64(width)), lane_at) for x in idxs]
      for m in range(regs.shape[0] // 4):
        keep = select(group(2 * m + 1, i), group(2 * m, i))
        sent = select(group(2 * m, i), group(2 * m + 1, i))
        got = [mgpu_utils.shfl_bfly(x, 4) for x in sent]
        for start, idx, pair in ((starts[0], idxs[0], select(got, keep)),
                                 (starts[1], idxs[1], select(keep, got))):
          values = [vector.extract(v, dynamic_position=[], static_position=[e])
                    for v in pair for e in (0, 1)]
          at = mgpu_utils.getelementptr(base, [arith.addi(start, c64(32 * m))], f32)
          llvm.inline_asm(ir.Type.parse("!llvm.void"), [at, *values, idx], _RED_V4_ASM,
                          "l,f,f,f,f,r", has_side_effects=True)

  plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()))(add)(
      acc, idx_s, dkv_ref)


def _lane_order(dkv):
  """``dkv[..., d]`` with its columns back in order from the one :func:`_add_rows`
  writes: in each group of 16, real column ``8 t + 2 k + e`` sits at ``4 k + 2 t + e``
  (one copy of ``dkv``: 75 MB at s_kv 32768, about 0.05 ms at 3 TB/s)."""
  *lead, d = dkv.shape
  return dkv.reshape(*lead, d // 16, 4, 2, 2).swapaxes(-3, -2).reshape(*lead, d)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def sparse_prefill_bwd(q, kv, indices, lengths, d_out, lse, coef, bias, *, sm_scale: float):
  """``(dq, dkv)`` of sparse prefill: bf16 ``dq[s_q, h_q, d_qk]`` and float32
  ``dkv[s_kv, d_qk]`` (:func:`supported` shapes).

  Args as :func:`jax_mla.sparse_mla.triton_backward.sparse_prefill_bwd`'s: ``q[s_q, h_q,
  d_qk]``, ``kv[s_kv, d_qk]``, ``indices[s_q, topk]``, ``lengths[s_q]``, bf16
  ``d_out[s_q, h_q, 512]``, and per (token, head) the natural-log ``lse``, the sink
  factor ``coef`` (``f``) and ``bias`` (``b``, so ``dS = sm_scale P (f dP + b)``).
  Under ``jax.vmap`` one call takes the whole batch (:func:`fold_batch`).
  """
  return fold_batch(functools.partial(_call, sm_scale=sm_scale))(
      q, kv, indices, lengths, d_out, lse, coef, bias)


def _call(q, kv, indices, lengths, d_out, lse, coef, bias, *, sm_scale: float):
  plgpu = _mosaic.plgpu()
  h_q = q.shape[1]
  q, d_out, vec = _padded_heads(-(-h_q // HEADS) * HEADS, q, d_out, lse, coef, bias)
  s_q, h_pad, d_qk = q.shape
  s_kv = kv.shape[0]
  lengths = jnp.clip(lengths, 0, indices.shape[1])
  idx = clean_indices(indices, lengths, s_kv)
  rope = d_qk - D_MAIN
  gather = gather_fn(fmt=None, num_slots=s_kv, block_size=1, row_bytes=d_qk * 2, d_qk=d_qk)

  tiles = lambda *shape: plgpu.SMEM(shape, jnp.bfloat16, transforms=_mosaic.swizzled(plgpu))  # noqa: E731
  # The swizzled tiles first: each is 1024-byte aligned. 230,656 of the 232,448 bytes.
  compute = (tiles(2, HEADS, HALF), tiles(HEADS, rope) if rope else None,
             tiles(2, HEADS, HALF), tiles(2, BLOCK_K, HALF),
             tiles(BLOCK_K, rope if rope else 64))  # 512: the gather's RoPE stand-in
  smem = (compute, tiles(HEADS, BLOCK_K), tiles(HEADS, BLOCK_K),
          plgpu.SMEM((2, HEADS), jnp.float32), plgpu.SMEM((2, 2, BLOCK_K), jnp.int32))
  barriers = (
      plgpu.Barrier(num_arrivals=4 + (rope > 0) + 1),  # Q, dO' and the vectors loaded
      plgpu.Barrier(num_arrivals=1),  # keys gathered
      plgpu.Barrier(num_arrivals=2),  # keys free: both dQ products done
      plgpu.Barrier(num_arrivals=1),  # P and dS handed over
      plgpu.Barrier(num_arrivals=1),  # P and dS free: the dKV products done
      plgpu.Barrier(num_arrivals=2),  # both done with Q (its tiles stage dQ)
  )
  kernel = functools.partial(_kernel, plgpu=plgpu, gather=gather, h_pad=h_pad,
                             scale=float(sm_scale) * LOG2E, sm_scale=float(sm_scale))

  def body(refs):
    def entry():
      pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                    barriers, collective_axes="wg")

    mesh = plgpu.Mesh(grid=(s_q, h_pad // HEADS), grid_names=("t", "h"), num_threads=3,
                      thread_name="wg")
    pl.kernel(entry, (), mesh=mesh, compiler_params=plgpu.CompilerParams(approx_math=True))()

  operands = (q.reshape(s_q * h_pad, d_qk), d_out.reshape(s_q * h_pad, D_MAIN), vec, lengths,
              idx, kv, jnp.zeros((s_q * h_pad, d_qk), jnp.bfloat16),
              jnp.zeros((s_kv, d_qk), jnp.float32))
  dq, dkv = pl.run_state(body)(operands)[-2:]
  return dq.reshape(s_q, h_pad, d_qk)[:, :h_q], _lane_order(dkv)


def fold_batch(bwd_fn):
  """``bwd_fn(q, kv, indices, lengths, *per_token) -> (per-token [s_q, ...], dkv[s_kv,
  d])`` for tokens ``[s_q, ...]`` attending rows of ``kv[s_kv, d]``, batched under
  ``jax.vmap`` by one call over the batch's tokens and rows laid end to end: element
  ``b``'s indices move by ``b * s_kv`` (unusable ones stay ``-1``, never reaching
  another element's rows)."""
  fn = jax.custom_batching.custom_vmap(bwd_fn)

  @fn.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched, strict=True)]
    q, kv, indices, lengths, *per_token = args
    s_kv = kv.shape[1]
    usable = (indices >= 0) & (indices < s_kv)
    indices = jnp.where(usable, indices + (jnp.arange(axis_size) * s_kv)[:, None, None], -1)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    tokens, dkv = fn(*map(flat, (q, kv, indices, lengths, *per_token)))
    return ((tokens.reshape(axis_size, -1, *tokens.shape[1:]),
             dkv.reshape(axis_size, s_kv, -1)), (True, True))

  return fn


def _padded_heads(h_pad: int, q, d_out, lse, coef, bias):
  """``(q, dO' = f dO bf16, vec float32 [s_q, 2, h_pad])`` with the heads padded to
  ``h_pad``: padding heads have zero queries and ``lse = +inf`` (so ``p = 0``: they add
  nothing); ``vec`` stacks each head's ``lse`` (base 2) and ``b``."""
  pad = lambda x, fill=0: jnp.pad(  # noqa: E731
      x, [(0, 0), (0, h_pad - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
  d_out = (d_out.astype(jnp.float32) * coef[..., None]).astype(jnp.bfloat16)
  vec = jnp.stack([pad(lse * LOG2E, jnp.inf), pad(bias)], axis=1)
  return pad(q), pad(d_out), vec.astype(jnp.float32)
