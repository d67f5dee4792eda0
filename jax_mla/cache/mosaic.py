"""Pallas Mosaic GPU cache writer (Hopper) for the fp8_ds_mla and fp8_model1 formats.

One warp per token, written inline per thread: each lane loads 16 bf16 latent values
(two 16-byte loads), the lanes of a scale tile (8 for V3.2's 128-tiles, 4 for V4's
64-tiles) take the tile's ``amax`` with butterfly shuffles, and each lane stores its
16 fp8 bytes with one 16-byte store straight into the token's slot; the tile's first
lane stores the scale (V3.2), lane 0 the token's 8 scale bytes (V4); the RoPE bytes
are copied as they are. The cache is aliased input -> output: only the new tokens'
bytes move, and with the kernel the whole op is Mosaic GPU, so the torch bridge runs
it on torch's stream, in the torch cache's own memory (``torch_bridge._direct``).

The math is the formats' (``DsMla.quantize_tiles``, ``Model1.quantize_tiles``), done
with the hardware's IEEE operations: ``amax`` with ``max.f32`` (NaN ignored, as
CUDA's ``fmaxf``), ``amax / 448`` and ``x / scale`` with ``div.rn.f32``, the V4
exponent from the float32 bits, and fp8 rounding with ``cvt.rn.satfinite.e4m3x2``
(round to nearest even, saturated to 448). Where the reference settles a value the
hardware does not (the sign of a NaN byte; an infinite value over an infinite scale,
which the reference saturates), the kernel follows the reference, so its bytes equal
the XLA writer's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jax_mla import _mosaic
from jax_mla._common import FP8_E4M3_MAX, cdiv
from jax_mla.cache.ds_mla import DsMla
from jax_mla.cache.layout import Format
from jax_mla.cache.model1 import Model1

WARPS = 4  # tokens per CTA: one warp (32 lanes x 16 values = 512 latent values) each
_VALUES = 16  # latent values per lane


def check_supported(kv_c: jax.Array, k_pe: jax.Array, fmt: Format) -> None:
  """Raises ``ValueError`` unless the kernel writes ``fmt`` from these inputs: bf16
  latents of the format's standard widths (the Triton kernel writes the rest)."""
  if not isinstance(fmt, (DsMla, Model1)) or fmt not in (DsMla(), Model1()):
    raise ValueError(f"the Mosaic GPU cache writer writes 'fp8_ds_mla' and 'fp8_model1'; "
                     f"got {fmt.name!r} (use implementation='triton')")
  if kv_c.dtype != jnp.bfloat16 or k_pe.dtype != jnp.bfloat16:
    raise ValueError(f"the Mosaic GPU cache writer takes bf16 kv_c and k_pe; got {kv_c.dtype} "
                     f"and {k_pe.dtype} (use implementation='triton')")


def write(kv_c: jax.Array, k_pe: jax.Array, kv_cache: jax.Array, slot_mapping: jax.Array, *,
          fmt: Format) -> jax.Array:
  """Writes token ``t`` (``t < S``, ``S >= 1``) into slot ``slot_mapping[t]``, in place of
  ``kv_cache`` (aliased); slots ``< 0`` or past the cache are skipped. Inputs as
  :func:`jax_mla.cache.api.concat_and_cache_mla`, which validates them
  (:func:`check_supported` passes)."""
  plgpu = _mosaic.plgpu()
  num_tokens = slot_mapping.shape[0]
  nb, bs, width = kv_cache.shape
  latent = kv_c.shape[1] == 512 and k_pe.shape[1] == 0  # V4's whole-latent form
  operands = (slot_mapping, kv_c) if latent else (slot_mapping, kv_c, k_pe)
  store = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (len(operands) + 1))(
      functools.partial(_write_tokens, fmt=fmt, num_tokens=num_tokens, block_size=bs,
                        capacity=nb * bs, latent=latent))
  # The cache goes in as a Ref: the kernel writes it in place (an aliased output).
  cache = jax.new_ref(kv_cache)
  pl.kernel(store, out_type=(), name="concat_and_cache_mla",
            mesh=plgpu.Mesh(grid=(cdiv(num_tokens, WARPS),), grid_names=("t",)))(*operands, cache)
  return jax.freeze(cache)


def _write_tokens(ctx, slot_ref, nope_ref, *refs, fmt, num_tokens, block_size, capacity,
                  latent):
  """One lane's part of its warp's token (inline Mosaic GPU): see the module."""
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, gpu, llvm
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  rope_ref, cache_ref = (None, refs[0]) if latent else refs
  i32, i64, f32 = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                   ir.F32Type.get())
  i8 = ir.IntegerType.get_signless(8)
  void = ir.Type.parse("!llvm.void")
  v4 = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
  c32 = lambda v: mgpu.c(v, i32)  # noqa: E731
  c64 = lambda v: mgpu.c(v, i64)  # noqa: E731
  cf = lambda v: mgpu.c(v, f32)  # noqa: E731

  def glob(ref):
    return llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                              mgpu_utils.memref_ptr(ref))

  def at(base, offset):  # byte address base + offset (i64)
    return mgpu_utils.getelementptr(base, [offset], i8)

  def wide(v):
    return arith.extui(i64, v)

  def asm(ty, text, constraints, *args, effects=False):
    return llvm.inline_asm(ty, list(args), text, constraints, has_side_effects=effects)

  def load16(ptr):  # 16 bytes: four b32 words
    words = asm(v4, "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", ptr)
    return [llvm.extractvalue(i32, words, [k]) for k in range(4)]

  def store16(ptr, words, ok):
    asm(void, "{.reg .pred p; setp.ne.b32 p, $5, 0; @p st.global.v4.b32 [$0], {$1, $2, $3, $4};}",
        "l,r,r,r,r,r", ptr, *words, ok, effects=True)

  def shuffle(v, lane_or_mask, mode):  # every lane of the warp takes part
    return asm(i32, f"shfl.sync.{mode}.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r", v,
               lane_or_mask)

  def fmax(a, b):  # max.f32: a NaN operand gives the other (CUDA's fmaxf)
    return asm(f32, "max.f32 $0, $1, $2;", "=f,f,f", a, b)

  tid = arith.remui(mgpu.thread_idx(), c32(128))
  lane = arith.remui(tid, c32(32))
  token = arith.addi(arith.muli(arith.index_cast(i32, gpu.block_id(gpu.Dimension.x)), c32(WARPS)),
                     arith.divui(tid, c32(32)))
  in_range = arith.cmpi(arith.CmpIPredicate.ult, token, c32(num_tokens))
  token = arith.minui(token, c32(num_tokens - 1))  # loads stay in bounds; stores check ok
  slot = asm(i32, "ld.global.nc.b32 $0, [$1];", "=r,l",
             at(glob(slot_ref), arith.muli(wide(token), c64(4))))
  ok = arith.andi(in_range, arith.andi(
      arith.cmpi(arith.CmpIPredicate.sge, slot, c32(0)),
      arith.cmpi(arith.CmpIPredicate.slt, slot, c32(capacity))))
  slot = arith.select(ok, slot, c32(0))
  block, offset = wide(arith.divui(slot, c32(block_size))), wide(arith.remui(slot, c32(block_size)))
  cache = at(glob(cache_ref), arith.muli(block, c64(block_size * fmt.row_width(
      block_size, fmt.head_size))))
  ok = arith.extui(i32, ok)

  # The lane's 16 values: NoPE, or (V4, lanes 28..31) RoPE, stored as they are.
  row_values = 512 if latent or isinstance(fmt, DsMla) else fmt.nope
  nope = glob(nope_ref)
  src = at(nope, arith.addi(arith.muli(wide(token), c64(2 * row_values)),
                            arith.muli(wide(lane), c64(2 * _VALUES))))
  is_rope = None
  if isinstance(fmt, Model1) and not latent:
    is_rope = arith.cmpi(arith.CmpIPredicate.uge, lane, c32(fmt.nope // _VALUES))
    rope_src = at(glob(rope_ref), arith.addi(
        arith.muli(wide(token), c64(2 * fmt.rope)),
        arith.muli(wide(arith.subi(lane, c32(fmt.nope // _VALUES))), c64(2 * _VALUES))))
    src = arith.select(is_rope, rope_src, src)
  pairs = load16(src) + load16(at(src, c64(16)))  # b32 word k: values 2k (low), 2k + 1

  values = []
  for p in pairs:
    values += [arith.bitcast(f32, arith.shli(p, c32(16))),
               arith.bitcast(f32, arith.andi(p, c32(-65536)))]
  amax = cf(0.0)
  for v in values:
    amax = fmax(amax, asm(f32, "abs.f32 $0, $1;", "=f,f", v))
  lanes_per_tile = fmt.tile // _VALUES
  for k in range(lanes_per_tile.bit_length() - 1):  # butterfly over the tile's lanes
    amax = fmax(amax, arith.bitcast(f32, shuffle(arith.bitcast(i32, amax), c32(1 << k), "bfly")))

  if isinstance(fmt, DsMla):
    # scale = max(amax / 448, FLT_MIN); values x / scale.
    scale = fmax(asm(f32, "div.rn.f32 $0, $1, $2;", "=f,f,f", amax, cf(FP8_E4M3_MAX)),
                 cf(float(np.finfo(np.float32).tiny)))
    quotients = [asm(f32, "{.reg .pred p; div.rn.f32 $0, $1, $2; testp.infinite.f32 p, $1;"
                          " @p mov.f32 $0, $1;}", "=f,f,f", v, scale) for v in values]
    row = arith.muli(offset, c64(fmt.token_bytes))
  else:
    # e = ceil(log2(max(amax, 1e-4) / 448)) from the float32 bits; values x * 2**-e.
    bits = arith.bitcast(i32, fmax(amax, cf(float(np.float32(fmt.min_amax)))))
    e = arith.addi(arith.subi(arith.shrui(bits, c32(23)), c32(127 + 8)), arith.extui(
        i32, arith.cmpi(arith.CmpIPredicate.ugt, arith.andi(bits, c32(0x7FFFFF)),
                        c32(0x600000))))
    inverse = arith.bitcast(f32, arith.shli(arith.subi(c32(127), e), c32(23)))
    quotients = [asm(f32, "mul.rn.f32 $0, $1, $2;", "=f,f,f", v, inverse) for v in values]
    row = arith.muli(offset, c64(fmt.data_bytes))

  # fp8 bytes, four per b32 word; the sign comes from the value (a NaN keeps its own).
  words = []
  for k in range(0, _VALUES, 4):
    packed = asm(i32, "{.reg .b16 r_lo, r_hi; cvt.rn.satfinite.e4m3x2.f32 r_lo, $2, $1;"
                      " cvt.rn.satfinite.e4m3x2.f32 r_hi, $4, $3; mov.b32 $0, {r_lo, r_hi};}",
                 "=r,f,f,f,f", *quotients[k:k + 4])
    lo, hi = pairs[k // 2], pairs[k // 2 + 1]
    signs = arith.ori(arith.ori(arith.andi(arith.shrui(lo, c32(8)), c32(0x80)),
                                arith.andi(arith.shrui(lo, c32(16)), c32(0x8000))),
                      arith.ori(arith.andi(arith.shli(hi, c32(8)), c32(0x800000)),
                                arith.andi(hi, c32(-0x80000000))))
    words.append(arith.ori(arith.andi(packed, c32(0x7F7F7F7F)), signs))

  token_row = at(cache, row)
  lane_bytes = arith.muli(wide(lane), c64(_VALUES))
  if isinstance(fmt, DsMla):
    store16(at(token_row, lane_bytes), words, ok)
    first = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(lane, c32(lanes_per_tile)), c32(0))
    asm(void, "{.reg .pred p; setp.ne.b32 p, $2, 0; @p st.global.f32 [$0], $1;}", "l,f,r",
        at(token_row, arith.addi(c64(fmt.scale_offset),
                                 wide(arith.muli(arith.divui(lane, c32(lanes_per_tile)), c32(4))))),
        scale, arith.andi(ok, arith.extui(i32, first)), effects=True)
    # RoPE: lanes 0..7 copy its 128 bytes.
    rope_lane = arith.minui(lane, c32(7))
    rope_at = arith.muli(wide(rope_lane), c64(16))
    rope = load16(at(glob(rope_ref), arith.addi(arith.muli(wide(token), c64(2 * fmt.rope)),
                                                rope_at)))
    store16(at(token_row, arith.addi(c64(fmt.rope_offset), rope_at)), rope,
            arith.andi(ok, arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, lane, c32(8)))))
    return

  # V4: lanes 0..27 store fp8 bytes; lanes 28..31 their RoPE values as they are.
  if is_rope is None:
    is_rope = arith.cmpi(arith.CmpIPredicate.uge, lane, c32(fmt.nope // _VALUES))
  rope_byte = arith.addi(c64(fmt.nope), arith.muli(
      wide(arith.subi(lane, c32(fmt.nope // _VALUES))), c64(2 * _VALUES)))
  data_at = arith.select(is_rope, rope_byte, lane_bytes)
  out_words = [arith.select(is_rope, p, w) for p, w in zip(pairs[:4], words, strict=True)]
  store16(at(token_row, data_at), out_words, ok)
  store16(at(token_row, arith.addi(data_at, c64(16))), pairs[4:],
          arith.andi(ok, arith.extui(i32, is_rope)))
  # The scale row: code e + 127 of tiles 0..6, then a zero pad; lane 0 stores it.
  code = arith.addi(e, c32(fmt.exponent_bias))
  codes = [shuffle(code, c32(g * lanes_per_tile), "idx") for g in range(fmt.num_tiles)]
  codes.append(c32(0))
  scale_words = []
  for w in range(2):
    word = c32(0)
    for b in range(4):
      word = arith.ori(word, arith.shli(arith.andi(codes[4 * w + b], c32(0xFF)), c32(8 * b)))
    scale_words.append(word)
  scale_at = at(cache, arith.addi(c64(fmt.scale_region(block_size)),
                                  arith.muli(offset, c64(fmt.scale_bytes))))
  lane0 = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, lane, c32(0)))
  asm(void, "{.reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.v2.b32 [$0], {$1, $2};}",
      "l,r,r,r", scale_at, *scale_words, arith.andi(ok, lane0), effects=True)

