"""Pallas Mosaic GPU sparse MLA decode for up to 16 heads on ``fp8_ds_mla``, lane by lane.

Tensor parallelism leaves a GPU 8 or 16 of DeepSeek's 128 query heads. Then a token's
decode is a gather of its ``topk`` 656-byte rows with little math per byte, and the
kernel is built around the loads (as :mod:`jax_mla.paged.mosaic` is):

- One CTA per (query token, split of its ``topk``): four warps, warp ``w`` owning the
  128-value NoPE tile ``w`` of every row (its fp8 bytes, its float32 scale) and the
  output columns ``128 w .. 128 w + 127``; warps 0 and 1 also take half of the RoPE.
- A step is 16 of the token's indices. Each lane loads 16-byte runs of its rows
  straight into ``mma.sync.m16n8k16`` B operands (the query's A operand in the same
  order; fp8 widened exactly to fp16, the RoPE in bf16), so the heads sit on the mma's
  16 rows and the tokens on its columns. A warp's partial scores are scaled by its
  tile's scale per token; the four partials meet in shared memory (one barrier a step)
  and every warp sums them in the same order, so all four run the same softmax.
- ``P V`` reuses the NoPE words already in registers: ``movmatrix.trans`` turns a
  key B operand (a token's 8 values per 4 lanes) into a value B operand (8 tokens of
  one column per 4 lanes). ``P`` is scaled per token by the tile's scale over the
  step's largest (so it stays in ``[0, 1]`` in fp16), and that largest scale moves
  into the accumulator's running factor.
- Positions past the token's length, indices outside the cache and their rows' value
  words are masked (rows that are never written may hold NaN); splits of a token's
  steps are combined by :func:`jax_mla.merge_mosaic.combine`, which applies the sinks,
  else the kernel does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_mla import _inline, _mosaic, merge_mosaic
from jax_mla._common import LN2, LOG2E
from jax_mla._inline import at, const, fconst, fmax, pack, shuffle, wide
from jax_mla.cache.ds_mla import DsMla

STEP = 16  # indices per step: the k side of the P V mma
HEADS = 16  # the mma's rows
WARPS = 4  # one per 128-value NoPE tile
_ROW = DsMla()  # the fp8_ds_mla row: 512 fp8, 4 float32 scales, 64 bf16 RoPE values


def takes(h_q: int, d_qk: int, fmts, topk: int, extra: bool) -> bool:
  """Whether this kernel runs the decode: ``fp8_ds_mla`` rows, one key set, up to 16
  heads, ``topk`` a multiple of 16."""
  return (h_q <= HEADS and d_qk == _ROW.head_size and not extra and len(fmts) == 1
          and isinstance(fmts[0], DsMla) and fmts[0] == _ROW and topk % STEP == 0)


def attend(q, cache, indices, lengths, attn_sink, *, sm_scale, num_splits: int):
  """``q[T, h_q, 576]`` bf16 over ``cache[num_blocks, block_size, 656]`` uint8 rows at
  ``indices[T, topk]`` (global slots; outside the cache: masked), ``lengths[T]`` int32
  or None (all of ``topk``). Returns ``(out bf16[T, h_q, 512], max_logits f32[T, h_q],
  lse f32[T, h_q])`` as :func:`jax_mla.sparse_mla.mosaic.attend`."""
  plgpu = _mosaic.plgpu()
  tokens, h_q, _ = q.shape
  num_blocks, block_size, width = cache.shape
  topk = indices.shape[1]
  if lengths is None:
    lengths = jnp.full((tokens,), topk, jnp.int32)
  sink = (jnp.full((HEADS,), -jnp.inf, jnp.float32) if attn_sink is None or num_splits > 1
          else jnp.pad(attn_sink.astype(jnp.float32), (0, HEADS - h_q),
                       constant_values=-jnp.inf))
  q = jnp.pad(q, ((0, 0), (0, HEADS - h_q), (0, 0)))
  rows = tokens * HEADS
  body = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 9)(functools.partial(
      _attend, h_q=h_q, tokens=tokens, topk=topk, num_slots=num_blocks * block_size,
      row_bytes=width * cache.dtype.itemsize, splits=num_splits,
      scale=float(sm_scale) * LOG2E))

  def kernel(*refs):  # shared memory: the warps' partial scores, double-buffered
    pl.run_scoped(lambda smem: body(*refs, smem), plgpu.SMEM((2, WARPS, 32, 8), jnp.float32))

  out, max_logits, lse = pl.kernel(
      kernel, name="sparse_mla_decode_lanes",
      out_type=(jax.ShapeDtypeStruct((num_splits * rows, _ROW.nope), jnp.bfloat16),
                jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32),
                jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32)),
      mesh=plgpu.Mesh(grid=(tokens * num_splits,), grid_names=("t",)),
  )(lengths.astype(jnp.int32), q.reshape(rows, -1), sink, indices,
    cache.reshape(num_blocks * block_size, width))
  if num_splits > 1:
    out, max_logits, lse = merge_mosaic.combine(
        out.reshape(num_splits, rows, _ROW.nope), lse.reshape(num_splits, rows),
        max_logits.reshape(num_splits, rows), attn_sink, heads=HEADS)
  return (out.reshape(tokens, HEADS, -1)[:, :h_q], max_logits.reshape(tokens, HEADS)[:, :h_q],
          lse.reshape(tokens, HEADS)[:, :h_q])


def _attend(ctx, len_ref, q_ref, sink_ref, idx_ref, kv_ref, o_ref, ml_ref, lse_ref, smem_ref,
            *, h_q, tokens, topk, num_slots, row_bytes, splits, scale):
  """One warp's tile of one (token, split): see the module. Lane ``(r, c) = (lane // 4,
  lane % 4)`` holds the scores of heads ``r`` and ``r + 8`` for the step's positions
  ``4c .. 4c + 3``."""
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, scf
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  i32, f32 = _inline.int_type(), _inline.f32_type()
  c64 = functools.partial(const, bits=64)
  lt = functools.partial(arith.cmpi, arith.CmpIPredicate.slt)
  two_halves = h_q > 8  # heads r + 8 exist
  neg_inf, zero_f, zero = fconst(float("-inf")), fconst(0.0), const(0)
  mma16, mma_bf16 = (functools.partial(_inline.mma_16816, dtype=d) for d in ("f16", "bf16"))

  lane, w = _inline.lane_and_warp()
  r, c = arith.divui(lane, const(4)), arith.remui(lane, const(4))
  cta = _inline.block_x()
  split, tok = arith.remui(cta, const(splits)), arith.divui(cta, const(splits))

  def load_i32(ref, index):
    return _inline.load_words(at(_inline.global_ptr(ref), arith.muli(wide(index), c64(4))), 1)[0]

  length = arith.minsi(arith.maxsi(load_i32(len_ref, tok), zero), const(topk))
  num_steps = arith.divui(arith.addi(length, const(STEP - 1)), const(STEP))
  per_split = arith.divui(arith.addi(num_steps, const(splits - 1)), const(splits))
  lo = arith.minsi(arith.muli(split, per_split), num_steps)
  hi = arith.minsi(arith.addi(lo, per_split), num_steps)

  # The query: heads r and r + 8 (rows past h_q are the wrapper's zero padding), as
  # fp16 pairs of this warp's NoPE runs 4i + c (i = 2w, 2w + 1: 16 values each, the
  # order of the key loads) and, in warps 0 and 1, bf16 pairs of RoPE run 4w + c.
  q_base = _inline.global_ptr(q_ref)
  heads = [r, arith.addi(r, const(8))]
  nope_runs = [arith.addi(arith.muli(arith.addi(arith.muli(w, const(2)), const(i)), const(4)), c)
               for i in range(2)]
  rope_run = arith.addi(arith.muli(arith.minui(w, const(1)), const(4)), c)
  has_rope = lt(w, const(2))

  def query_pairs(x):
    row = at(q_base, arith.muli(wide(heads[x]), c64(_ROW.head_size * 2)))
    row = at(row, arith.muli(wide(tok), c64(HEADS * _ROW.head_size * 2)))
    nope = []
    for run in nope_runs:
      words = [w_ for k in range(2) for w_ in _inline.load_words(
          at(row, arith.addi(arith.muli(wide(run), c64(32)), c64(16 * k))), 4)]
      values = _inline.bf16_floats(words)
      nope += [pack(_inline.clamp(values[k], 65504.0), _inline.clamp(values[k + 1], 65504.0),
                    "f16") for k in range(0, 16, 2)]
    rope = _inline.load_words(at(row, arith.addi(c64(2 * _ROW.nope),
                                                 arith.muli(wide(rope_run), c64(16)))), 4)
    return nope, rope

  qa_nope, qa_rope = query_pairs(0)
  qb_nope, qb_rope = query_pairs(1) if two_halves else ([zero] * 16, [zero] * 4)

  idx_row = at(_inline.global_ptr(idx_ref), arith.muli(wide(tok), c64(topk * 4)))
  kv_base = _inline.global_ptr(kv_ref)
  # Lane (r, c)'s key rows: column r of the step's two 8-position mma tiles, positions
  # 4 (r // 2) + r % 2 + 2j; its scores' positions: 4c + u.
  k_pos = [arith.addi(arith.addi(arith.muli(arith.divui(r, const(2)), const(4)),
                                 arith.remui(r, const(2))), const(2 * j)) for j in range(2)]
  s_pos = [arith.addi(arith.muli(c, const(4)), const(u)) for u in range(4)]

  def slots_of(step):
    """The step's slots of the key rows and of the score positions (clamped to the topk
    row; their validity is settled where they are used)."""
    base = arith.muli(step, const(STEP))
    return [load_i32_at(idx_row, arith.minsi(arith.addi(base, p), const(topk - 1)))
            for p in k_pos + s_pos]

  def load_i32_at(ptr, index):
    return _inline.load_words(at(ptr, arith.muli(wide(index), c64(4))), 1)[0]

  def row_at(slot):  # a slot's row, or row 0 for a slot outside the cache
    ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, slot, zero), lt(slot, const(num_slots)))
    return at(kv_base, arith.muli(wide(arith.select(ok, slot, zero)), c64(row_bytes))), ok

  # Shared memory: [2 buffers][4 warps][32 lanes][8 partial scores].
  smem = llvm.addrspacecast(llvm.PointerType.get(), mgpu_utils.memref_ptr(smem_ref))
  mine = [at(smem, wide(arith.muli(arith.addi(arith.muli(arith.addi(
      arith.muli(const(b), const(WARPS)), w), const(32)), lane), const(32)))) for b in range(2)]

  def lane_slot(b, warp):
    return at(smem, c64(((b * WARPS + warp) * 32) * 32))

  lane_bytes = wide(arith.muli(lane, const(32)))
  scale_off = arith.addi(c64(_ROW.scale_offset), wide(arith.muli(w, const(4))))

  per = 4 if two_halves else 2  # accumulator fields a lane keeps per output tile
  # (m, l) of heads r and r + 8, the accumulator's factor g, the accumulator.
  state0 = [neg_inf, neg_inf, zero_f, zero_f, fconst(1.0)] + [zero_f] * (16 * per)
  def load(slots):
    """A step's loads: its key rows' NoPE runs and RoPE run, its score positions' scales
    (28 words, in this order)."""
    k_rows = [row_at(slots[j])[0] for j in range(2)]
    nope = [wd for j in range(2) for run in nope_runs
            for wd in _inline.load_words(at(k_rows[j], arith.muli(wide(run), c64(16))), 4)]
    rope = [wd for j in range(2) for wd in _inline.load_words(at(k_rows[j], arith.addi(
        c64(_ROW.rope_offset), arith.muli(wide(rope_run), c64(16)))), 4)]
    scales = [_inline.load_words(at(row_at(slots[2 + u])[0], scale_off), 1)[0] for u in range(4)]
    return nope + rope + scales

  # The loop loads a step ahead: iteration s computes step s from the words it carries,
  # while the loads of step s + 1 and the slots of step s + 2 are in flight.
  first_slots = slots_of(lo)
  carry0 = first_slots + slots_of(arith.addi(lo, const(1))) + load(first_slots) + state0
  loop = scf.ForOp(lo, hi, const(1), carry0)
  with ir.InsertionPoint(loop.body):
    step = loop.induction_variable
    args = list(loop.inner_iter_args)
    slots, next_slots, words, state = args[:6], args[6:12], args[12:40], args[40:]
    m_a, m_b, l_a, l_b, g, *acc = state
    carried = next_slots + slots_of(arith.addi(step, const(2))) + load(next_slots)
    pos0 = arith.muli(step, const(STEP))
    nope, rope = [words[:8], words[8:16]], [words[16:20], words[20:24]]
    valid = [arith.andi(row_at(slots[2 + u])[1], lt(arith.addi(pos0, s_pos[u]), length))
             for u in range(4)]
    scales = [arith.select(valid[u], arith.bitcast(f32, words[24 + u]), zero_f)
              for u in range(4)]

    # This warp's partial scores: its NoPE tile (fp16 mma, times the tile's scale per
    # position) and its RoPE half (bf16 mma).
    keys = [[p for wd in nope[j] for p in _inline.fp8_pairs(wd, "e4m3")] for j in range(2)]
    partial = []
    for j in range(2):
      s = [zero_f] * 4
      for k in range(8):  # k-step k: pairs 2k, 2k + 1 of the two runs
        s = mma16(s, (qa_nope[2 * k], qb_nope[2 * k], qa_nope[2 * k + 1], qb_nope[2 * k + 1]),
                  (keys[j][2 * k], keys[j][2 * k + 1]))
      s = [arith.mulf(v, scales[2 * j + f % 2]) for f, v in enumerate(s)]
      rs = [zero_f] * 4
      for k in range(2):
        rs = mma_bf16(rs, (qa_rope[2 * k], qb_rope[2 * k], qa_rope[2 * k + 1],
                           qb_rope[2 * k + 1]), (rope[j][2 * k], rope[j][2 * k + 1]))
      partial += [arith.select(has_rope, arith.addf(v, x), v) for v, x in zip(s, rs, strict=True)]

    # The four warps' partials, summed in warp order by each (the same scores in all).
    buf = arith.remui(step, const(2))
    mine_at = arith.select(arith.cmpi(arith.CmpIPredicate.eq, buf, zero), mine[0], mine[1])
    for k in range(2):
      _st_shared(at(mine_at, c64(16 * k)),
                 [arith.bitcast(i32, v) for v in partial[4 * k:4 * k + 4]])
    _bar_sync()
    buf_base = arith.muli(wide(buf), c64(WARPS * 32 * 32))
    total = [zero_f] * 8
    for warp in range(WARPS):
      words = [x for k in range(2) for x in _ld_shared(
          at(at(lane_slot(0, warp), buf_base), arith.addi(lane_bytes, c64(16 * k))))]
      total = [arith.addf(t, arith.bitcast(f32, x)) for t, x in zip(total, words, strict=True)]

    def row_scores(x):  # head r (x 0) or r + 8: positions 4c + u
      return [arith.select(valid[u], arith.mulf(total[4 * (u // 2) + 2 * x + u % 2],
                                                fconst(scale)), neg_inf) for u in range(4)]

    m_a, l_a, alpha_a, p_a = _inline.softmax_step(row_scores(0), m_a, l_a)
    if two_halves:
      m_b, l_b, alpha_b, p_b = _inline.softmax_step(row_scores(1), m_b, l_b)
    else:
      alpha_b, p_b = None, None
    # P times the tile's scale over the step's largest (<= 1); that largest joins g,
    # the accumulator's running factor (out = acc * g / l).
    top = fmax(fmax(scales[0], scales[1]), fmax(scales[2], scales[3]))
    for mask in (1, 2):
      top = fmax(top, arith.bitcast(f32, shuffle(arith.bitcast(i32, top), const(mask), "bfly")))
    top = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, top, zero_f), top, g)
    ratio = [arith.divf(v, top) for v in scales]
    grow = arith.divf(g, top)

    def p_words(p):
      if p is None:
        return [zero, zero]
      v = [arith.mulf(p[u], ratio[u]) for u in range(4)]
      return [pack(v[0], v[1], "f16"), pack(v[2], v[3], "f16")]

    pa, pb = p_words(p_a), p_words(p_b)
    a = (pa[0], pb[0], pa[1], pb[1])
    masks = [arith.ori(arith.select(valid[2 * k], const(0xFFFF), zero),
                       arith.select(valid[2 * k + 1], const(-65536), zero)) for k in range(2)]
    factors = [arith.mulf(alpha_a, grow)] + ([arith.mulf(alpha_b, grow)] if two_halves else [])
    new_acc = []
    for n in range(16):  # output tile n: pairs n of the two position tiles, transposed
      b = [arith.andi(_movmatrix(keys[j][n]), masks[j]) for j in range(2)]
      part = [arith.mulf(acc[per * n + f], factors[f // 2]) for f in range(per)]
      new_acc += mma16(part + [zero_f] * (4 - per), a, b)[:per]
    scf.YieldOp(carried + [m_a, m_b, l_a, l_b, top] + new_acc)

  m_a, m_b, l_a, l_b, g, *acc = loop.results[40:]
  # Part rows: (split * T + tok) * 16 + head (one split: the output's rows).
  rows0 = arith.muli(arith.addi(arith.muli(split, const(tokens)), tok), const(HEADS))
  o_base, ml_base, lse_base = (_inline.global_ptr(x) for x in (o_ref, ml_ref, lse_ref))
  first_lane = arith.andi(arith.cmpi(arith.CmpIPredicate.eq, w, zero),
                          arith.cmpi(arith.CmpIPredicate.eq, c, zero))
  for x, (m, l) in enumerate(((m_a, l_a), (m_b, l_b))):
    if x and not two_halves:
      break
    for mask in (1, 2):  # the row sum over its four lanes
      l = arith.addf(l, arith.bitcast(f32, shuffle(arith.bitcast(i32, l), const(mask), "bfly")))
    empty = arith.cmpf(arith.CmpFPredicate.OEQ, l, zero_f)
    l_safe = arith.select(empty, fconst(1.0), l)
    lse2 = arith.addf(m, _inline.log2(l_safe))
    denominator = l_safe
    if splits == 1:  # the sink: out *= exp(lse) / (exp(lse) + exp(sink))
      sink = arith.bitcast(f32, load_i32(sink_ref, heads[x]))
      denominator = arith.mulf(l_safe, arith.addf(fconst(1.0), _inline.exp2(
          arith.subf(arith.mulf(sink, fconst(LOG2E)), lse2))))
    inv = arith.select(empty, zero_f, arith.divf(g, denominator))
    row = arith.addi(rows0, heads[x])
    row_at = at(o_base, arith.muli(wide(row), c64(2 * _ROW.nope)))
    for ii, run in enumerate(nope_runs):  # 16 columns from 16 (4i + c), as bf16
      words = [pack(arith.mulf(acc[per * (8 * ii + q) + 2 * x], inv),
                    arith.mulf(acc[per * (8 * ii + q) + 2 * x + 1], inv), "bf16")
               for q in range(8)]
      for k in range(2):
        _inline.store_words(at(row_at, arith.addi(arith.muli(wide(run), c64(32)), c64(16 * k))),
                            words[4 * k:4 * k + 4], const(1))
    max_logits = arith.select(empty, neg_inf, arith.mulf(m, fconst(LN2)))
    lse = arith.select(empty, fconst(float("inf")), arith.mulf(lse2, fconst(LN2)))
    ok = arith.extui(i32, first_lane)
    for ref_base, v in ((ml_base, max_logits), (lse_base, lse)):
      _inline.store_words(at(ref_base, arith.muli(wide(row), c64(4))), [arith.bitcast(i32, v)],
                          ok)


def _movmatrix(word):
  return _inline.asm(_inline.int_type(), "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
                     "=r,r", word)


def _bar_sync():
  _inline.asm(_inline.void(), "bar.sync 1, 128;", "", effects=True)


def _st_shared(ptr, words):
  _inline.asm(_inline.void(), "st.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", ptr, *words,
              effects=True)


def _ld_shared(ptr):
  out = _inline.asm(_inline.struct("i32", "i32", "i32", "i32"),
                    "ld.volatile.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", ptr,
                    effects=True)
  return _inline.fields(out, _inline.int_type(), 4)
