"""Pallas Mosaic GPU cache writer (Hopper): ``fp8_ds_mla``, ``fp8_model1``, ``fp8_v41``,
``fp4_v41``, and the ``"auto"`` (bf16) and per-tensor ``"fp8"`` rows of DeepSeek's
512 + 64 latent.

One warp per token, written inline per thread: each lane loads 16 bf16 latent values
(two 16-byte loads), the lanes of a scale tile (8 for V3.2's 128-tiles, 4 for V4's
64-tiles, 2 for V4.1's 32-tiles) take the tile's ``amax`` with butterfly shuffles, and
each lane stores its 16 fp8 bytes with one 16-byte store straight into the token's
slot (V4.1's fp4: 8 bytes of e2m1 pairs, a lane being one 16-value tile); the tile's
first lane stores the scale (V3.2), lane 0 the token's 8 (V4) or 16 (V4.1 fp8) scale
bytes, each fp4 lane its own; the V3.2 / V4 RoPE bytes are copied as they are. ``"auto"`` rows
are copied, ``"fp8"`` rows divided by the per-tensor scale (the RoPE part too). The
cache is aliased input -> output: only the new tokens' bytes move, and with the kernel
the whole op is Mosaic GPU, so the torch bridge runs it on torch's stream, in the
torch cache's own memory (``torch_bridge._direct``).

The math is the formats' (``DsMla.quantize_tiles``, ``Model1.quantize_tiles``,
``V41Fp8.quantize_tiles``, ``e4m3.cast_fp8``), done with the hardware's IEEE
operations: ``amax`` with ``max.f32`` (NaN ignored, as CUDA's ``fmaxf``), ``amax /
448`` and ``x / scale`` with ``div.rn.f32``, the V4 / V4.1 exponents from the float32
bits, and fp8 rounding with ``cvt.rn.satfinite.e4m3x2`` (round to nearest even,
saturated to 448). Where the reference settles a value the hardware does not (the sign
of a NaN byte; an infinite value over an infinite scale, which the reference
saturates; V4.1's poisoned tiles), the kernel follows the reference, so its bytes equal
the reference writer's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jax_mla import _inline, _mosaic
from jax_mla._common import FP8_E4M3_MAX, cdiv
from jax_mla._inline import asm, at, fmax, shuffle, wide
from jax_mla.cache.auto import AUTO
from jax_mla.cache.ds_mla import DsMla
from jax_mla.cache.e2m1 import MAX as E2M1_MAX
from jax_mla.cache.fp8 import FP8_PER_TENSOR
from jax_mla.cache.layout import Format
from jax_mla.cache.model1 import Model1
from jax_mla.cache.v41_fp4 import V41_FP4, V41Fp4
from jax_mla.cache.v41_fp8 import V41_FP8, V41Fp8

WARPS = 4  # tokens per CTA: one warp (32 lanes x 16 values = 512 latent values) each
_VALUES = 16  # latent values per lane


def check_supported(kv_c: jax.Array, k_pe: jax.Array, kv_cache: jax.Array, fmt: Format) -> None:
  """Raises ``ValueError`` unless the kernel writes ``fmt`` from these inputs: bf16
  latents (of DeepSeek's ``[T, 512]`` / ``[T, 64]`` widths for ``"auto"`` and ``"fp8"``,
  into a bf16 ``"auto"`` cache); the Triton kernel or the XLA scatter writes the rest."""
  if fmt not in (DsMla(), Model1(), V41_FP8, V41_FP4, AUTO, FP8_PER_TENSOR):
    raise ValueError(f"the Mosaic GPU cache writer writes 'auto', 'fp8', 'fp8_ds_mla', "
                     f"'fp8_model1', 'fp8_v41' and 'fp4_v41'; got {fmt.name!r} (use "
                     "implementation='triton')")
  if kv_c.dtype != jnp.bfloat16 or k_pe.dtype != jnp.bfloat16:
    raise ValueError(f"the Mosaic GPU cache writer takes bf16 kv_c and k_pe; got {kv_c.dtype} "
                     f"and {k_pe.dtype} (use implementation='triton')")
  if fmt in (AUTO, FP8_PER_TENSOR) and (kv_c.shape[1], k_pe.shape[1]) != (512, 64):
    raise ValueError(f"the Mosaic GPU cache writer takes kv_c [T, 512] and k_pe [T, 64] for "
                     f"{fmt.name!r}; got {list(kv_c.shape)} and {list(k_pe.shape)}")
  if fmt == AUTO and kv_cache.dtype != jnp.bfloat16:
    raise ValueError(f"the Mosaic GPU cache writer writes a bf16 'auto' cache; got "
                     f"{kv_cache.dtype}")


def write(kv_c: jax.Array, k_pe: jax.Array, kv_cache: jax.Array, slot_mapping: jax.Array,
          scale: jax.Array, *, fmt: Format) -> jax.Array:
  """Writes token ``t`` (``t < S``, ``S >= 1``) into slot ``slot_mapping[t]``, in place of
  ``kv_cache`` (aliased); slots ``< 0`` or past the cache are skipped. Inputs as
  :func:`jax_mla.cache.api.concat_and_cache_mla`, which validates them
  (:func:`check_supported` passes); ``scale``: the float32 scalar of ``"fp8"``."""
  plgpu = _mosaic.plgpu()
  num_tokens = slot_mapping.shape[0]
  nb, bs, width = kv_cache.shape
  latent = kv_c.shape[1] == 512 and k_pe.shape[1] == 0  # V4's / V4.1's whole-latent form
  operands = (slot_mapping, kv_c) + ((k_pe,) if not latent else ()) + (
      (scale.reshape(1),) if fmt == FP8_PER_TENSOR else ())
  store = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (len(operands) + 1))(
      functools.partial(_write_tokens, fmt=fmt, num_tokens=num_tokens, block_size=bs,
                        row_bytes=width * kv_cache.dtype.itemsize, capacity=nb * bs,
                        latent=latent))
  # The cache goes in as a Ref: the kernel writes it in place (an aliased output).
  cache = jax.new_ref(kv_cache)
  pl.kernel(store, out_type=(), name="concat_and_cache_mla",
            mesh=plgpu.Mesh(grid=(cdiv(num_tokens, WARPS),), grid_names=("t",)))(*operands, cache)
  return jax.freeze(cache)


def _write_tokens(ctx, slot_ref, nope_ref, *refs, fmt, num_tokens, block_size, row_bytes,
                  capacity, latent):
  """One lane's part of its warp's token (inline Mosaic GPU): see the module."""
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith
  from jax.experimental.mosaic import gpu as mgpu

  refs = list(refs)
  cache_ref = refs.pop()
  scale_ref = refs.pop() if fmt == FP8_PER_TENSOR else None
  rope_ref = None if latent else refs.pop()
  i32, i64, f32 = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                   ir.F32Type.get())
  void = _inline.void()
  glob, store = _inline.global_ptr, _inline.store_words
  load16 = functools.partial(_inline.load_words, count=4)  # four b32 words
  c32 = lambda v: mgpu.c(v, i32)  # noqa: E731
  c64 = lambda v: mgpu.c(v, i64)  # noqa: E731
  cf = lambda v: mgpu.c(v, f32)  # noqa: E731

  def divided(values, scale):  # x / scale, IEEE; an infinite x stays infinite (saturates)
    return [asm(f32, "{.reg .pred p; div.rn.f32 $0, $1, $2; testp.infinite.f32 p, $1;"
                     " @p mov.f32 $0, $1;}", "=f,f,f", v, scale) for v in values]

  def fp8_words(quotients, pairs):
    """fp8 bytes, four per b32 word, rounded to nearest even and saturated; the sign
    comes from the bf16 value (``pairs``), so a NaN keeps its own."""
    words = []
    for k in range(0, len(quotients), 4):
      packed = asm(i32, "{.reg .b16 r_lo, r_hi; cvt.rn.satfinite.e4m3x2.f32 r_lo, $2, $1;"
                        " cvt.rn.satfinite.e4m3x2.f32 r_hi, $4, $3; mov.b32 $0, {r_lo, r_hi};}",
                   "=r,f,f,f,f", *quotients[k:k + 4])
      lo, hi = pairs[k // 2], pairs[k // 2 + 1]
      signs = arith.ori(arith.ori(arith.andi(arith.shrui(lo, c32(8)), c32(0x80)),
                                  arith.andi(arith.shrui(lo, c32(16)), c32(0x8000))),
                        arith.ori(arith.andi(arith.shli(hi, c32(8)), c32(0x800000)),
                                  arith.andi(hi, c32(-0x80000000))))
      words.append(arith.ori(arith.andi(packed, c32(0x7F7F7F7F)), signs))
    return words

  def when(ok, cond):
    return arith.andi(ok, arith.extui(i32, cond))

  lane, warp = _inline.lane_and_warp()
  token = arith.addi(arith.muli(_inline.block_x(), c32(WARPS)), warp)
  in_range = arith.cmpi(arith.CmpIPredicate.ult, token, c32(num_tokens))
  token = arith.minui(token, c32(num_tokens - 1))  # loads stay in bounds; stores check ok
  [slot] = _inline.load_words(at(glob(slot_ref), arith.muli(wide(token), c64(4))), 1)
  ok = arith.andi(in_range, arith.andi(
      arith.cmpi(arith.CmpIPredicate.sge, slot, c32(0)),
      arith.cmpi(arith.CmpIPredicate.slt, slot, c32(capacity))))
  slot = arith.select(ok, slot, c32(0))
  block, offset = wide(arith.divui(slot, c32(block_size))), wide(arith.remui(slot, c32(block_size)))
  cache = at(glob(cache_ref), arith.muli(block, c64(block_size * row_bytes)))
  ok = arith.extui(i32, ok)
  lane_bytes = arith.muli(wide(lane), c64(_VALUES))

  # The lane's 16 values: the V3.2 NoPE, or V4's / V4.1's latent (lanes 28..31: the RoPE,
  # from k_pe when it comes apart).
  one_latent = isinstance(fmt, (Model1, V41Fp8, V41Fp4))
  nope = fmt.head_size - fmt.rope if one_latent else 512  # 448 for V4 and V4.1
  row_values = nope if one_latent and not latent else 512
  src = at(glob(nope_ref), arith.addi(arith.muli(wide(token), c64(2 * row_values)),
                                      arith.muli(wide(lane), c64(2 * _VALUES))))
  is_rope = None
  if one_latent:
    is_rope = arith.cmpi(arith.CmpIPredicate.uge, lane, c32(nope // _VALUES))
    if not latent:
      src = arith.select(is_rope, at(glob(rope_ref), arith.addi(
          arith.muli(wide(token), c64(2 * fmt.rope)),
          arith.muli(wide(arith.subi(lane, c32(nope // _VALUES))), c64(2 * _VALUES)))), src)
  pairs = load16(src) + load16(at(src, c64(16)))
  # Token rows: V4's data rows sit at the front of the block, the rest one per slot.
  token_row = at(cache, arith.muli(offset, c64(fmt.data_bytes if isinstance(fmt, Model1)
                                               else row_bytes)))
  # The DeepSeek 64 RoPE values of the V3.2 row (a separate k_pe): lanes 0..7, 16 bytes each.
  rope_lane = arith.muli(wide(arith.minui(lane, c32(7))), c64(16))
  rope_lanes = when(ok, arith.cmpi(arith.CmpIPredicate.ult, lane, c32(8)))

  def rope_pairs():
    return load16(at(glob(rope_ref), arith.addi(arith.muli(wide(token), c64(128)), rope_lane)))

  if fmt == AUTO:  # bf16 rows [kv_c | k_pe], copied
    kv_at = at(token_row, arith.muli(lane_bytes, c64(2)))
    store(kv_at, pairs[:4], ok)
    store(at(kv_at, c64(16)), pairs[4:], ok)
    store(at(token_row, arith.addi(c64(1024), rope_lane)), rope_pairs(), rope_lanes)
    return
  if fmt == FP8_PER_TENSOR:  # fp8 rows [kv_c | k_pe] / scale
    scale = _inline.load_f32(glob(scale_ref))
    store(at(token_row, lane_bytes),
          fp8_words(divided(_inline.bf16_floats(pairs), scale), pairs), ok)
    rope = rope_pairs()
    store(at(token_row, arith.addi(c64(512), arith.divui(rope_lane, c64(2)))),
          fp8_words(divided(_inline.bf16_floats(rope), scale), rope), rope_lanes)
    return

  values = _inline.bf16_floats(pairs)
  if isinstance(fmt, V41Fp4):
    # A lane holds one 16-value tile. Its scale: e4m3 of float32(amax / 6), at least
    # code 1 (2**-9); amax takes an infinity as FLT_MAX; a NaN poisons the tile (scale
    # byte 0x7F, codes 0). Codes: e2m1 of float32(x / scale), nearest, ties to even,
    # saturated at 6 (sm_90 has no e2m1 cvt: the quotient is placed among the midpoints).
    amax, has_nan = cf(0.0), c32(0)
    for v in values:
      amax = fmax(amax, asm(f32, "min.f32 $0, $1, $2;", "=f,f,f",
                            asm(f32, "abs.f32 $0, $1;", "=f,f", v),
                            cf(float(np.finfo(np.float32).max))))
      has_nan = arith.ori(has_nan, arith.extui(i32, arith.cmpf(arith.CmpFPredicate.UNO, v, v)))
    code = asm(i32, "{.reg .b16 r; cvt.rn.satfinite.e4m3x2.f32 r, $2, $1; cvt.u32.u16 $0, r;}",
               "=r,f,f", asm(f32, "div.rn.f32 $0, $1, $2;", "=f,f,f", amax, cf(E2M1_MAX)),
               cf(0.0))
    code = arith.maxui(arith.andi(code, c32(0x7F)), c32(1))
    exp = arith.shrui(code, c32(3))  # the e4m3 code's value, from its bits
    significand = arith.ori(arith.andi(code, c32(7)), arith.select(
        arith.cmpi(arith.CmpIPredicate.ugt, exp, c32(0)), c32(8), c32(0)))
    scale = arith.mulf(arith.sitofp(f32, significand), arith.bitcast(f32, arith.shli(
        arith.addi(arith.maxui(exp, c32(1)), c32(127 - 10)), c32(23))))
    nibbles = []
    for v in values:
      q = asm(f32, "div.rn.f32 $0, $1, $2;", "=f,f,f", asm(f32, "abs.f32 $0, $1;", "=f,f", v),
              scale)
      n = c32(0)
      for j, m in enumerate((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)):
        past = arith.cmpf(arith.CmpFPredicate.OGT if j % 2 == 0 else arith.CmpFPredicate.OGE,
                          q, cf(m))  # a tie at an odd midpoint goes up, to the even code
        n = arith.addi(n, arith.extui(i32, past))
      negative = arith.cmpi(arith.CmpIPredicate.slt, arith.bitcast(i32, v), c32(0))
      nibbles.append(arith.ori(n, arith.select(negative, c32(8), c32(0))))
    poisoned = arith.cmpi(arith.CmpIPredicate.ne, has_nan, c32(0))
    words = []
    for w in range(2):
      word = c32(0)
      for b in range(8):
        word = arith.ori(word, arith.shli(nibbles[8 * w + b], c32(4 * b)))
      words.append(arith.select(poisoned, c32(0), word))
    store(at(token_row, arith.muli(wide(lane), c64(8))), words, ok)
    asm(void, "{.reg .pred p; .reg .b16 r; setp.ne.b32 p, $2, 0; cvt.u16.u32 r, $1;"
              " @p st.global.u8 [$0], r;}", "l,r,r",
        at(token_row, arith.addi(c64(fmt.data_bytes), wide(lane))),
        arith.select(poisoned, c32(0x7F), code), ok, effects=True)
    return
  amax = cf(0.0)
  for v in values:
    amax = fmax(amax, asm(f32, "abs.f32 $0, $1;", "=f,f", v))
  lanes_per_tile = fmt.tile // _VALUES
  for k in range(lanes_per_tile.bit_length() - 1):  # butterfly over the tile's lanes
    amax = fmax(amax, arith.bitcast(f32, shuffle(arith.bitcast(i32, amax), c32(1 << k), "bfly")))

  def exponent(floor):  # ceil(log2(max(amax, floor) / 448)) from the float32 bits
    bits = arith.bitcast(i32, fmax(amax, cf(floor)))
    return arith.addi(arith.subi(arith.shrui(bits, c32(23)), c32(127 + 8)), arith.extui(
        i32, arith.cmpi(arith.CmpIPredicate.ugt, arith.andi(bits, c32(0x7FFFFF)),
                        c32(0x600000))))

  def scaled(e):  # x * 2**-e, exact
    inverse = arith.bitcast(f32, arith.shli(arith.subi(c32(127), e), c32(23)))
    return [asm(f32, "mul.rn.f32 $0, $1, $2;", "=f,f,f", v, inverse) for v in values]

  def scale_bytes_of(code, tiles):  # lane 0's words of the tiles' scale bytes, in order
    codes = [shuffle(code, c32(g * lanes_per_tile), "idx") for g in range(tiles)]
    codes += [c32(0)] * (-len(codes) % 4)  # V4: a zero pad after its 7 bytes
    words = []
    for w in range(len(codes) // 4):
      word = c32(0)
      for b in range(4):
        word = arith.ori(word, arith.shli(arith.andi(codes[4 * w + b], c32(0xFF)), c32(8 * b)))
      words.append(word)
    return words

  lane0 = when(ok, arith.cmpi(arith.CmpIPredicate.eq, lane, c32(0)))

  if isinstance(fmt, DsMla):
    # scale = max(amax / 448, FLT_MIN); values x / scale; the tile's first lane stores
    # the scale; lanes 0..7 copy the RoPE bytes.
    scale = fmax(asm(f32, "div.rn.f32 $0, $1, $2;", "=f,f,f", amax, cf(FP8_E4M3_MAX)),
                 cf(float(np.finfo(np.float32).tiny)))
    store(at(token_row, lane_bytes), fp8_words(divided(values, scale), pairs), ok)
    first = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(lane, c32(lanes_per_tile)), c32(0))
    asm(void, "{.reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.f32 [$0], $1;}", "l,f,r",
        at(token_row, arith.addi(c64(fmt.scale_offset),
                                 wide(arith.muli(arith.divui(lane, c32(lanes_per_tile)), c32(4))))),
        scale, when(ok, first), effects=True)
    store(at(token_row, arith.addi(c64(fmt.rope_offset), rope_lane)), rope_pairs(), rope_lanes)
    return

  if isinstance(fmt, V41Fp8):
    # e = max(ceil(log2(amax / 448)), -13); values x * 2**-e; a tile with a NaN or an
    # infinity is poisoned: scale byte 0xFF, NaN (0x7F) for a NaN, an infinity or any
    # value of a tile holding a NaN, +-0 for the rest (the reference's rule).
    e = arith.maxsi(exponent(0.0), c32(fmt.min_exponent))
    isnan = [arith.cmpf(arith.CmpFPredicate.UNO, v, v) for v in values]
    infinite = [arith.cmpf(arith.CmpFPredicate.OEQ, asm(f32, "abs.f32 $0, $1;", "=f,f", v),
                           cf(float("inf"))) for v in values]
    has_nan = c32(0)
    for n in isnan:
      has_nan = arith.ori(has_nan, arith.extui(i32, n))
    has_nan = arith.ori(has_nan, shuffle(has_nan, c32(1), "bfly"))  # the tile's two lanes
    poisoned = arith.ori(has_nan, arith.extui(i32, arith.cmpf(
        arith.CmpFPredicate.OEQ, amax, cf(float("inf")))))
    poisoned = arith.cmpi(arith.CmpIPredicate.ne, poisoned, c32(0))
    words = fp8_words(scaled(e), pairs)
    for k in range(len(words)):
      word = c32(0)
      for b in range(4):
        v = 4 * k + b
        nan_out = arith.ori(arith.cmpi(arith.CmpIPredicate.ne, has_nan, c32(0)),
                            arith.ori(isnan[v], infinite[v]))
        sign = arith.select(arith.cmpi(arith.CmpIPredicate.slt, arith.bitcast(i32, values[v]),
                                       c32(0)), c32(0x80), c32(0))
        word = arith.ori(word, arith.shli(arith.select(nan_out, c32(0x7F), sign), c32(8 * b)))
      words[k] = arith.select(poisoned, word, words[k])
    store(at(token_row, lane_bytes), words, ok)
    code = arith.select(poisoned, c32(0xFF), arith.addi(e, c32(127)))
    store(at(token_row, c64(fmt.data_bytes)), scale_bytes_of(code, fmt.num_tiles), lane0)
    return

  # V4: e = ceil(log2(max(amax, 1e-4) / 448)); values x * 2**-e.
  e = exponent(float(np.float32(fmt.min_amax)))
  words = fp8_words(scaled(e), pairs)
  # Lanes 0..27 store fp8 bytes; lanes 28..31 their RoPE values as they are.
  rope_byte = arith.addi(c64(nope), arith.muli(wide(arith.subi(lane, c32(nope // _VALUES))),
                                               c64(2 * _VALUES)))
  data_at = arith.select(is_rope, rope_byte, lane_bytes)
  store(at(token_row, data_at), [arith.select(is_rope, p, w)
                                 for p, w in zip(pairs[:4], words, strict=True)], ok)
  store(at(token_row, arith.addi(data_at, c64(16))), pairs[4:], when(ok, is_rope))
  # The scale row: code e + 127 of tiles 0..6, then a zero pad; lane 0 stores it.
  scale_at = at(cache, arith.addi(c64(fmt.scale_region(block_size)),
                                  arith.muli(offset, c64(fmt.scale_bytes))))
  store(scale_at, scale_bytes_of(arith.addi(e, c32(fmt.exponent_bias)), fmt.num_tiles), lane0)
