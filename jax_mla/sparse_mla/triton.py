"""Pallas Triton sparse MLA kernel: gathered keys, one online softmax.

MLA has a single latent KV head shared by every query head, so one program owns
one query token and a block of ``block_h`` heads, gathers ``block_k`` key rows per
step by index (``ref[idx, cols]``, masked so invalid slots are never read), and
serves all of its heads from that one gather: ``S = Q K^T`` (fp32 accumulation),
an online base-2 softmax, ``acc += P V`` with V the first ``d_v`` columns of the
same rows. Key sets ("sources") are looped one after another with the same
softmax state, which is how decode attends to a main and an extra cache at once.

Triton arrays need power-of-two sizes, so every row is handled as a list of
column pieces (576 = 512 NoPE + 64 RoPE; the fp8 formats split the NoPE further
at their scale tiles). The score is the sum of one dot per piece, and V is the
pieces that lie inside the first ``d_v`` columns.

Key sources: bf16 rows (prefill's ``kv``, and decode's ``"auto"`` cache) and the
fp8 cache formats of :mod:`jax_mla.cache`, read at the offsets of their layout
objects. The cache is handed to the kernel as zero-copy views of its bytes
(reshapes and bitcasts, no dequantized copy); each gathered row is dequantized in
registers, one scale tile at a time, to bf16 for the dots:

* ``"fp8_ds_mla"`` (V3.2, 656 B/token): 4 NoPE tiles of 128 fp8 values, each times
  its float32 scale, then the 64 bf16 RoPE values. V = the 4 NoPE tiles.
* ``"fp8_model1"`` (V4): 7 NoPE tiles of 64 fp8 values times ``2**(e - 127)``
  (UE8M0 byte ``e`` from the block's scale region), then 64 bf16 RoPE values.
  V = all 8 pieces (d_v 512 = 448 NoPE + 64 RoPE).
* ``"fp8_v41"`` / ``"fp4_v41"`` (V4.1, 528 / 288 B/token): 8 pieces of 64 values
  (fp8, or e2m1 nibbles decoded with integer bit arithmetic: no fp4 hardware
  needed), each column times its tile's scale (UE8M0 per 32 / e4m3 per 16). Both
  give the same pieces, so an fp8_v41 main set and an fp4_v41 extra set share
  one softmax.

Pallas Triton computes gather offsets in int32 for arrays of at most 4 GiB, which
wraps once an element offset passes 2**31: byte views of caches between 2 and
4 GiB are therefore read as uint16 pairs and split into bytes in registers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla import _softmax
from jax_mla._common import LN2, LOG2E, cdiv, next_pow2
from jax_mla.cache.ds_mla import DsMla
from jax_mla.cache.e4m3 import FP8
from jax_mla.cache.layout import Format, TileScaled
from jax_mla.cache.model1 import Model1

MIN_TILE = 16  # smallest Triton dot tile
TILE_SCALED_PIECE = 64  # columns per dequantized piece of a V4.1 row (as fp8_model1's tiles)
# Byte views larger than this (and at most 4 GiB) are read as uint16 (see the module doc).
I32_SAFE_BYTES = 2**31


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Triton sparse MLA kernel (results do not depend on it).

  ``block_h`` query heads per program (the fp32 accumulator ``[block_h, 512]``
  must fit in registers: 64 with 8 warps), ``block_k`` gathered rows per step.
  """
  block_h: int = 64
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 2


def default_config(*, decode: bool) -> Config:
  """Best measured on an H100 (benchmarks/bench_sparse_mla.py). Prefill: 3 stages,
  217 TFLOP/s on the V3.2 row vs 208 with 2; 16 warps, block_k 32 and block_h 128
  were slower or did not fit. Decode: 145 TFLOP/s on the fp8_ds_mla b128 row; 3
  stages with block_k 32, 16 warps and scaling P instead of K were slower."""
  return Config() if decode else Config(num_stages=3)


@dataclasses.dataclass(frozen=True)
class KVSource:
  """One gathered key set, as the kernel sees it.

  Attributes:
    pieces: ``(col, width)`` column pieces of a row (powers of two); q is split the
      same way and the score is the sum of one dot per piece.
    num_slots: indices outside ``[0, num_slots)`` are invalid (masked, never read).
    load: ``load(kv_refs, slots, valid) -> [bf16 [block_k, width] per piece]``;
      ``slots`` are in range (0 where invalid) and rows where ``valid`` is False
      must come back as zeros without being read.
    num_refs: how many arrays (views of the cache) ``load`` reads.
  """
  pieces: tuple[tuple[int, int], ...]
  num_slots: int
  load: Callable
  num_refs: int


def col_iota(col: int, width: int) -> jax.Array:
  """``[1, width]`` column indices ``col .. col + width - 1`` for a 2-D gather."""
  return col + lax.broadcasted_iota(jnp.int32, (1, width), 1)


def gather_rows(ref, rows, valid, col, width):
  """Loads ``ref[rows, col:col + width]``; rows where ``valid`` is False read nothing, give 0."""
  return plgpu.load(ref.at[rows[:, None], col_iota(col, width)], mask=valid[:, None], other=0)


def bf16_pieces(d_qk: int) -> tuple[tuple[int, int], ...]:
  """576 -> NoPE 512 + RoPE 64; 512 -> one piece."""
  if d_qk == 576:
    return ((0, 512), (512, 64))
  if d_qk == 512:
    return ((0, 512),)
  raise ValueError(f"d_qk must be 576 or 512; got {d_qk}")


def bf16_source(num_slots: int, d_qk: int) -> KVSource:
  """Rows of a bf16 ``[num_slots, d_qk]`` array (prefill kv, or a flattened bf16 cache)."""
  pieces = bf16_pieces(d_qk)

  def load(kv_refs, slots, valid):
    (kv_ref,) = kv_refs
    return [gather_rows(kv_ref, slots, valid, c, w) for c, w in pieces]

  return KVSource(pieces=pieces, num_slots=num_slots, load=load, num_refs=1)


def _byte_view(rows: jax.Array) -> tuple[jax.Array, bool]:
  """uint8 ``[R, W]`` -> (the view the kernel reads, whether it is uint16 ``[R, W/2]``)."""
  if I32_SAFE_BYTES < rows.size <= 2**32:
    r, w = rows.shape
    return lax.bitcast_convert_type(rows.reshape(r, w // 2, 2), jnp.uint16), True
  return rows, False


def _load_bytes(ref, rows, valid, col: int, width: int, wide: bool) -> jax.Array:
  """uint8 ``[K, width]`` at byte column ``col`` of the gathered rows (0 where invalid)."""
  if not wide:
    return gather_rows(ref, rows, valid, col, width)
  pairs = gather_rows(ref, rows, valid, col // 2, width // 2).astype(jnp.int32)
  lo = (pairs & 0xFF).astype(jnp.uint8)  # little endian: the even byte is the low half
  hi = lax.shift_right_logical(pairs, 8).astype(jnp.uint8)
  return jnp.stack([lo, hi], axis=-1).reshape(rows.shape[0], width)


def _load_byte(ref, rows, valid, col: int, wide: bool) -> jax.Array:
  """int32 ``[K]``: byte ``col`` of each gathered row (0 where invalid)."""
  if not wide:
    return plgpu.load(ref.at[rows, col], mask=valid, other=0).astype(jnp.int32)
  pair = plgpu.load(ref.at[rows, col // 2], mask=valid, other=0).astype(jnp.int32)
  return lax.shift_right_logical(pair, 8 * (col % 2)) & 0xFF


def _fp8_tile(byte_tile: jax.Array, scale: jax.Array, *, exact_bf16: bool) -> jax.Array:
  """uint8 fp8 bytes ``[K, w]`` times a per-row float32 ``scale[K]`` -> bf16 ``[K, w]``.

  Multiplies in bf16 when the scale is a power of two (``exact_bf16``: the product
  is exact), else in float32 with one rounding, as the XLA codec does.
  """
  vals = lax.bitcast_convert_type(byte_tile, FP8)
  if exact_bf16:
    return vals.astype(jnp.bfloat16) * scale.astype(jnp.bfloat16)[:, None]
  return (vals.astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)


def ds_mla_source(kv_cache: jax.Array, fmt: DsMla) -> tuple[KVSource, tuple[jax.Array, ...]]:
  """fp8_ds_mla cache ``uint8[nb, bs, 656]`` -> (source, views: bytes, f32 scales, bf16 RoPE)."""
  n = kv_cache.shape[0] * kv_cache.shape[1]
  row = fmt.token_bytes
  byte_view, wide = _byte_view(kv_cache.reshape(n, row))
  views = (byte_view,
           lax.bitcast_convert_type(kv_cache.reshape(n, row // 4, 4), jnp.float32),
           lax.bitcast_convert_type(kv_cache.reshape(n, row // 2, 2), jnp.bfloat16))
  pieces = tuple((g * fmt.tile, fmt.tile) for g in range(fmt.num_tiles)) + (
      (fmt.nope, fmt.rope),)

  def load(kv_refs, slots, valid):
    byte_ref, scale_ref, rope_ref = kv_refs
    out = []
    for g in range(fmt.num_tiles):
      scale = plgpu.load(scale_ref.at[slots, fmt.scale_offset // 4 + g], mask=valid, other=0.0)
      out.append(_fp8_tile(
          _load_bytes(byte_ref, slots, valid, g * fmt.tile, fmt.tile, wide), scale,
          exact_bf16=False))
    out.append(gather_rows(rope_ref, slots, valid, fmt.rope_offset // 2, fmt.rope))
    return out

  return KVSource(pieces=pieces, num_slots=n, load=load, num_refs=3), views


def model1_source(kv_cache: jax.Array, fmt: Model1) -> tuple[KVSource, tuple[jax.Array, ...]]:
  """fp8_model1 cache ``uint8[nb, bs, w]`` -> (source, views: token rows, bf16 RoPE, scale rows).

  A block is ``bs * w`` bytes, a multiple of 576: viewed as 576-byte rows, token
  ``j`` of block ``b`` is row ``b * (bs*w/576) + j``; viewed as 8-byte rows, its
  scales are row ``b * (bs*w/8) + bs*72 + j``.
  """
  nb, bs, width = kv_cache.shape
  block_bytes = bs * width
  flat = kv_cache.reshape(-1)
  data = flat.reshape(-1, fmt.data_bytes)
  data_view, wide = _byte_view(data)
  scale_view, _ = _byte_view(flat.reshape(-1, fmt.scale_bytes))
  views = (data_view,
           lax.bitcast_convert_type(data.reshape(data.shape[0], fmt.data_bytes // 2, 2),
                                    jnp.bfloat16),
           scale_view)
  rows_per_block = block_bytes // fmt.data_bytes
  scale_rows_per_block = block_bytes // fmt.scale_bytes
  scale_row0 = fmt.scale_region(bs) // fmt.scale_bytes
  pieces = tuple((g * fmt.tile, fmt.tile) for g in range(fmt.num_tiles)) + (
      (fmt.nope, fmt.rope),)

  def load(kv_refs, slots, valid):
    data_ref, rope_ref, scale_ref = kv_refs
    block, offset = slots // bs, slots % bs
    rows = block * rows_per_block + offset
    scale_rows = block * scale_rows_per_block + scale_row0 + offset
    out = []
    for g in range(fmt.num_tiles):
      # Masked rows read code 0: scale 0.0.
      scale = fmt.decode_scales(_load_byte(scale_ref, scale_rows, valid, g, wide))
      out.append(_fp8_tile(
          _load_bytes(data_ref, rows, valid, g * fmt.tile, fmt.tile, wide), scale,
          exact_bf16=True))
    out.append(gather_rows(rope_ref, rows, valid, fmt.nope // 2, fmt.rope))
    return out

  return KVSource(pieces=pieces, num_slots=nb * bs, load=load, num_refs=3), views


def _gather_scale_bytes(ref, rows, valid, cols: jax.Array, wide: bool) -> jax.Array:
  """int32 ``[K, w]``: byte ``cols[0, j]`` of each gathered row (0 where invalid)."""
  if not wide:
    return plgpu.load(ref.at[rows[:, None], cols], mask=valid[:, None],
                      other=0).astype(jnp.int32)
  pairs = plgpu.load(ref.at[rows[:, None], cols // 2], mask=valid[:, None],
                     other=0).astype(jnp.int32)
  return lax.shift_right_logical(pairs, 8 * (cols % 2)) & 0xFF


def tile_scaled_source(kv_cache: jax.Array,
                       fmt: TileScaled) -> tuple[KVSource, tuple[jax.Array, ...]]:
  """V4.1 cache ``uint8[nb, bs, token_bytes]`` -> (source, views: the token rows).

  Pieces of ``TILE_SCALED_PIECE`` columns: their value bytes (64 fp8, or 32 bytes of
  e2m1 pairs split into nibbles and interleaved), times each column's scale,
  gathered straight into ``[K, 64]`` (a tile's byte repeated over its columns).
  """
  n = kv_cache.shape[0] * kv_cache.shape[1]
  view, wide = _byte_view(kv_cache.reshape(n, fmt.token_bytes))
  width = TILE_SCALED_PIECE
  pieces = tuple((c, width) for c in range(0, fmt.head_size, width))
  piece_bytes = width * fmt.bits // 8

  def load(kv_refs, slots, valid):
    (ref,) = kv_refs
    out = []
    for c, _ in pieces:
      raw = _load_bytes(ref, slots, valid, c * fmt.bits // 8, piece_bytes, wide)
      if fmt.bits == 8:  # straight fp8 -> bf16, as the other fp8 sources
        vals = lax.bitcast_convert_type(raw, FP8).astype(jnp.bfloat16)
      else:
        vals = fmt.decode_values(fmt.unpack(raw)).astype(jnp.bfloat16)
      cols = fmt.data_bytes + col_iota(c, width) // fmt.tile
      scale = fmt.decode_scales(_gather_scale_bytes(ref, slots, valid, cols, wide))
      # Exact in bf16: a power of two (fp8) or 4 bits (fp4) times a short value.
      out.append(vals * scale.astype(jnp.bfloat16))
    return out

  return KVSource(pieces=pieces, num_slots=n, load=load, num_refs=1), (view,)


def cache_source(kv_cache: jax.Array, fmt: Format):
  """(source, views) for a cache in ``"fp8_ds_mla"``, ``"fp8_model1"``, ``"fp8_v41"``,
  ``"fp4_v41"`` or ``"auto"`` (bf16)."""
  if isinstance(fmt, DsMla):
    return ds_mla_source(kv_cache, fmt)
  if isinstance(fmt, Model1):
    return model1_source(kv_cache, fmt)
  if isinstance(fmt, TileScaled):
    return tile_scaled_source(kv_cache, fmt)
  nb, bs, d = kv_cache.shape
  return bf16_source(nb * bs, d), (kv_cache.reshape(nb * bs, d),)


def _sparse_mla_kernel(*refs, sources: Sequence[KVSource], topks: Sequence[int], h_q: int,
                       block_h: int, block_k: int, num_h_blocks: int, d_v: int,
                       scale_log2: float, has_sink: bool):
  q_ref = refs[0]
  o_ref, ml_ref, lse_ref = refs[-3:]
  pos = 1
  sets = []
  for src in sources:
    sets.append((src, refs[pos], refs[pos + 1], refs[pos + 2:pos + 2 + src.num_refs]))
    pos += 2 + src.num_refs
  sink_ref = refs[pos] if has_sink else None

  pid = pl.program_id(0)
  t = pid // num_h_blocks  # head blocks of one token run side by side: they share the gathers
  h0 = (pid % num_h_blocks) * block_h
  head_ok = h0 + jnp.arange(block_h, dtype=jnp.int32) < h_q
  pieces = sources[0].pieces
  qs = [plgpu.load(q_ref.at[t, pl.ds(h0, block_h), pl.ds(c, w)], mask=head_ok[:, None], other=0)
        for c, w in pieces]
  v_ids = [i for i, (c, w) in enumerate(pieces) if c + w <= d_v]

  m, l = _softmax.init(block_h)
  accs = tuple(jnp.zeros((block_h, pieces[i][1]), jnp.float32) for i in v_ids)
  carry = (m, l, accs)
  for (src, idx_ref, len_ref, kv_refs), topk in zip(sets, topks, strict=True):
    length = jnp.clip(len_ref[t], 0, topk)

    def body(i, carry, src=src, idx_ref=idx_ref, kv_refs=kv_refs, length=length):
      m, l, accs = carry
      start = i * block_k
      in_range = start + jnp.arange(block_k, dtype=jnp.int32) < length
      idx = plgpu.load(idx_ref.at[t, pl.ds(start, block_k)], mask=in_range, other=-1)
      valid = in_range & (idx >= 0) & (idx < src.num_slots)
      ks = src.load(kv_refs, jnp.where(valid, idx, 0), valid)
      s = None
      for qp, kp in zip(qs, ks, strict=True):
        d = lax.dot_general(qp, kp, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = d if s is None else s + d
      m, l, alpha, p = _softmax.step(m, l, s * scale_log2, valid[None, :])
      pb = p.astype(jnp.bfloat16)
      accs = tuple(
          a * alpha[:, None] + jnp.dot(pb, ks[j], preferred_element_type=jnp.float32)
          for a, j in zip(accs, v_ids, strict=True))
      return m, l, accs

    carry = lax.fori_loop(0, (length + block_k - 1) // block_k, body, carry)
  m, l, accs = carry

  sink = (plgpu.load(sink_ref.at[pl.ds(h0, block_h)], mask=head_ok, other=-jnp.inf)
          if has_sink else None)
  inv, lse = _softmax.finish(m, l, sink=sink)
  for a, j in zip(accs, v_ids, strict=True):
    c, w = pieces[j]
    plgpu.store(o_ref.at[t, pl.ds(h0, block_h), pl.ds(c, w)],
                (a * inv[:, None]).astype(o_ref.dtype), mask=head_ok[:, None])
  # A NaN score at a valid key makes l NaN (and out, lse); Triton's max ignores NaN, so
  # max_logits follows l.
  plgpu.store(ml_ref.at[t, pl.ds(h0, block_h)], jnp.where(jnp.isnan(l), jnp.nan, m * LN2),
              mask=head_ok)
  plgpu.store(lse_ref.at[t, pl.ds(h0, block_h)], lse, mask=head_ok)


def _run(q: jax.Array, sets: Sequence[tuple[KVSource, jax.Array, jax.Array, Sequence[jax.Array]]],
         attn_sink: jax.Array | None, *, sm_scale: float, d_v: int, config: Config,
         interpret: bool):
  """Runs the kernel over query tokens ``q[T, h_q, d_qk]`` and key sets sharing one softmax.

  Each set is ``(source, indices[T, topk] int32, lengths[T] int32, kv_views)``; indices
  at positions ``>= lengths[t]`` are ignored. Returns ``(out bf16[T, h_q, d_v],
  max_logits f32[T, h_q], lse f32[T, h_q])``, natural-log statistics.
  """
  num_tokens, h_q, _ = q.shape
  block_h = max(MIN_TILE, min(config.block_h, next_pow2(h_q)))
  num_h_blocks = cdiv(h_q, block_h)
  pieces = sets[0][0].pieces
  if any(src.pieces != pieces for src, *_ in sets):
    raise ValueError("all key sets must share one row layout")
  operands = [q]
  for _, idx, lengths, views in sets:
    operands += [idx, lengths, *views]
  if attn_sink is not None:
    operands.append(attn_sink)
  kernel = functools.partial(
      _sparse_mla_kernel, sources=tuple(s[0] for s in sets),
      topks=tuple(s[1].shape[1] for s in sets), h_q=h_q, block_h=block_h,
      block_k=config.block_k, num_h_blocks=num_h_blocks, d_v=d_v,
      scale_log2=float(sm_scale) * LOG2E, has_sink=attn_sink is not None)
  out_shape = (jax.ShapeDtypeStruct((num_tokens, h_q, d_v), jnp.bfloat16),
               jax.ShapeDtypeStruct((num_tokens, h_q), jnp.float32),
               jax.ShapeDtypeStruct((num_tokens, h_q), jnp.float32))
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(num_tokens * num_h_blocks,),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret, name="sparse_mla")(*operands)


def sparse_prefill(q, kv, indices, attn_sink, lengths, *, sm_scale: float, d_v: int,
                   config: Config, interpret: bool = False):
  """Sparse prefill on the kernel; inputs validated and squeezed by
  :func:`jax_mla.sparse_mla.sparse_mla_prefill`.

  ``q[s_q, h_q, d_qk]`` bf16, ``kv[s_kv, d_qk]`` bf16, ``indices[s_q, topk]`` int32,
  ``lengths`` int32 ``[s_q]``. Returns ``(out, max_logits, lse)``.
  """
  src = bf16_source(kv.shape[0], kv.shape[1])
  return _run(q, [(src, indices, lengths, (kv,))], attn_sink, sm_scale=sm_scale, d_v=d_v,
              config=config, interpret=interpret)


def sparse_decode(q, sets, attn_sink, *, fmt: Format, sm_scale: float, d_v: int,
                  config: Config, interpret: bool = False, extra_fmt: Format | None = None):
  """Sparse decode on the kernel: ``q[T, h, d]`` and sets ``(kv_cache, indices[T, topk],
  lengths[T])`` validated and flattened by :func:`jax_mla.sparse_mla.sparse_mla_decode`;
  ``fmt`` the caches' format, ``extra_fmt`` the second set's when it differs. Returns
  ``(out, max_logits, lse)``."""
  kernel_sets = []
  for (cache, idx, lengths), f in zip(sets, (fmt, extra_fmt or fmt), strict=False):
    src, views = cache_source(cache, f)
    kernel_sets.append((src, idx, lengths, views))
  return _run(q, kernel_sets, attn_sink, sm_scale=sm_scale, d_v=d_v, config=config,
              interpret=interpret)
