"""Sparse MLA decode on a paged cache: fp8 rows dequantized inside the kernel.

The kernel is the one in ``prefill_pallas`` (one program per query token and head
block, gathered rows, one online softmax over the main and the extra key set);
this module adds the key sources that read the fp8 cache formats of
``jax_mla.cache``. The cache is handed to the kernel as zero-copy views of its
bytes (reshapes and bitcasts, no dequantized copy); each gathered row is
dequantized in registers, one scale tile at a time, to bf16 for the dots:

* ``"fp8_ds_mla"`` (V3.2, 656 B/token): 4 NoPE tiles of 128 fp8 values, each times
  its float32 scale, then the 64 bf16 RoPE values. V = the 4 NoPE tiles.
* ``"fp8_model1"`` (V4): 7 NoPE tiles of 64 fp8 values times ``2**(e - 127)``
  (UE8M0 byte ``e`` from the block's scale region), then 64 bf16 RoPE values.
  V = all 8 pieces (d_v 512 = 448 NoPE + 64 RoPE).

Pallas Triton computes gather offsets in int32 for arrays of at most 4 GiB, which
wraps once an element offset passes 2**31: byte views of caches between 2 and
4 GiB are therefore read as uint16 pairs and split into bytes in registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from jax_mla.cache.formats import (
  DS_MLA_BYTES,
  DS_MLA_NUM_TILES,
  DS_MLA_ROPE_OFFSET,
  DS_MLA_SCALE_OFFSET,
  DS_MLA_TILE,
  FP8,
  KV_LORA_RANK,
  MODEL1_DATA_BYTES,
  MODEL1_NOPE,
  MODEL1_NUM_TILES,
  MODEL1_SCALE_BYTES,
  MODEL1_TILE,
  ROPE_DIM,
)
from jax_mla.sparse_mla.prefill_pallas import (
  KernelConfig,
  KVSource,
  bf16_source,
  gather_rows,
  run_sparse_mla,
)

# Byte views larger than this (and at most 4 GiB) are read as uint16 (see the module doc).
I32_SAFE_BYTES = 2**31


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
  is exact), else in float32 with one rounding, as the reference dequantizer does.
  """
  vals = lax.bitcast_convert_type(byte_tile, FP8)
  if exact_bf16:
    return vals.astype(jnp.bfloat16) * scale.astype(jnp.bfloat16)[:, None]
  return (vals.astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)


def ds_mla_source(kv_cache: jax.Array) -> tuple[KVSource, tuple[jax.Array, ...]]:
  """fp8_ds_mla cache ``uint8[nb, bs, 656]`` -> (source, views: bytes, f32 scales, bf16 RoPE)."""
  n = kv_cache.shape[0] * kv_cache.shape[1]
  byte_view, wide = _byte_view(kv_cache.reshape(n, DS_MLA_BYTES))
  views = (byte_view,
           lax.bitcast_convert_type(kv_cache.reshape(n, DS_MLA_BYTES // 4, 4), jnp.float32),
           lax.bitcast_convert_type(kv_cache.reshape(n, DS_MLA_BYTES // 2, 2), jnp.bfloat16))
  pieces = tuple((g * DS_MLA_TILE, DS_MLA_TILE) for g in range(DS_MLA_NUM_TILES)) + (
      (KV_LORA_RANK, ROPE_DIM),)

  def load(kv_refs, slots, valid):
    byte_ref, scale_ref, rope_ref = kv_refs
    out = []
    for g in range(DS_MLA_NUM_TILES):
      scale = plgpu.load(scale_ref.at[slots, DS_MLA_SCALE_OFFSET // 4 + g], mask=valid, other=0.0)
      out.append(_fp8_tile(
          _load_bytes(byte_ref, slots, valid, g * DS_MLA_TILE, DS_MLA_TILE, wide), scale,
          exact_bf16=False))
    out.append(gather_rows(rope_ref, slots, valid, DS_MLA_ROPE_OFFSET // 2, ROPE_DIM))
    return out

  return KVSource(pieces=pieces, num_slots=n, load=load, num_refs=3), views


def model1_source(kv_cache: jax.Array) -> tuple[KVSource, tuple[jax.Array, ...]]:
  """fp8_model1 cache ``uint8[nb, bs, w]`` -> (source, views: token rows, bf16 RoPE, scale rows).

  A block is ``bs * w`` bytes, a multiple of 576: viewed as 576-byte rows, token
  ``j`` of block ``b`` is row ``b * (bs*w/576) + j``; viewed as 8-byte rows, its
  scales are row ``b * (bs*w/8) + bs*72 + j``.
  """
  nb, bs, width = kv_cache.shape
  block_bytes = bs * width
  flat = kv_cache.reshape(-1)
  data = flat.reshape(-1, MODEL1_DATA_BYTES)
  data_view, wide = _byte_view(data)
  scale_view, _ = _byte_view(flat.reshape(-1, MODEL1_SCALE_BYTES))
  views = (data_view,
           lax.bitcast_convert_type(data.reshape(data.shape[0], MODEL1_DATA_BYTES // 2, 2),
                                    jnp.bfloat16),
           scale_view)
  rows_per_block = block_bytes // MODEL1_DATA_BYTES
  scale_rows_per_block = block_bytes // MODEL1_SCALE_BYTES
  scale_row0 = bs * MODEL1_DATA_BYTES // MODEL1_SCALE_BYTES
  pieces = tuple((g * MODEL1_TILE, MODEL1_TILE) for g in range(MODEL1_NUM_TILES)) + (
      (MODEL1_NOPE, ROPE_DIM),)

  def load(kv_refs, slots, valid):
    data_ref, rope_ref, scale_ref = kv_refs
    block, offset = slots // bs, slots % bs
    rows = block * rows_per_block + offset
    scale_rows = block * scale_rows_per_block + scale_row0 + offset
    out = []
    for g in range(MODEL1_NUM_TILES):
      code = _load_byte(scale_ref, scale_rows, valid, g, wide)
      # UE8M0: 2**(code - 127) is the float32 with exponent field `code` (masked rows: 0.0).
      scale = lax.bitcast_convert_type(lax.shift_left(code, 23), jnp.float32)
      out.append(_fp8_tile(
          _load_bytes(data_ref, rows, valid, g * MODEL1_TILE, MODEL1_TILE, wide), scale,
          exact_bf16=True))
    out.append(gather_rows(rope_ref, rows, valid, MODEL1_NOPE // 2, ROPE_DIM))
    return out

  return KVSource(pieces=pieces, num_slots=nb * bs, load=load, num_refs=3), views


def cache_source(kv_cache: jax.Array, kv_cache_dtype: str):
  """(source, views) for a cache in ``"fp8_ds_mla"``, ``"fp8_model1"`` or ``"auto"`` (bf16)."""
  if kv_cache_dtype == "fp8_ds_mla":
    return ds_mla_source(kv_cache)
  if kv_cache_dtype == "fp8_model1":
    return model1_source(kv_cache)
  nb, bs, d = kv_cache.shape
  return bf16_source(nb * bs, d), (kv_cache.reshape(nb * bs, d),)


# Best measured on an H100 (benchmarks/bench_sparse_mla.py): 145 TFLOP/s on the fp8_ds_mla
# b128 row; 3 stages with block_k 32, 16 warps and scaling P instead of K were slower.
DECODE_CONFIG = KernelConfig()


def sparse_mla_decode_pallas(q, sets, attn_sink, *, kv_cache_dtype: str, sm_scale: float,
                             d_v: int, config: KernelConfig = DECODE_CONFIG,
                             interpret: bool = False):
  """Sparse decode on the kernel: ``q[T, h, d]`` and sets ``(kv_cache, indices[T, topk],
  lengths[T])`` already validated and flattened. Returns ``(out, max_logits, lse)``."""
  kernel_sets = []
  for cache, idx, lengths in sets:
    src, views = cache_source(cache, kv_cache_dtype)
    kernel_sets.append((src, idx, lengths, views))
  return run_sparse_mla(q, kernel_sets, attn_sink, sm_scale=sm_scale, d_v=d_v, config=config,
                        interpret=interpret)
