"""Pallas (Triton) cache writer for the fp8_ds_mla and fp8_model1 formats.

One program per token: load the 512 leading latent values, compute the tile
scales, convert to fp8 and store the token's bytes straight into its cache slot.
The cache is aliased input -> output, so under jit with donation the write is
in place and only the written slots' bytes move.

Every in-kernel array has a power-of-two size: the 512 values are viewed as
tiles ``[4, 128]`` (V3.2) or ``[8, 64]`` (V4: 7 NoPE tiles plus the RoPE tile,
whose fp8 bytes are masked off and whose scale byte becomes the zero pad); the
pieces stored are 512 (V4: masked to 448), 16 or 8, and 128 bytes. The RoPE
bytes are a bitcast of the input made outside the kernel (T * 128 bytes).

The quantization math is the reference's own (``formats.quantize_*_tiles``),
written without divisions where the result must be exact and with the fp8
rounding done in integer bit arithmetic (no float -> fp8 conversion), so the
kernel matches the XLA reference byte for byte.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla.cache import formats as F


def _le_bytes(words: jax.Array) -> jax.Array:
  """int32 ``[n]`` -> little-endian uint8 ``[4n]`` (shifts, no reshaping bitcast)."""
  n = words.shape[0]
  shifts = jnp.broadcast_to(8 * jax.lax.iota(jnp.int32, 4)[None, :], (n, 4))
  b = jax.lax.shift_right_logical(jnp.broadcast_to(words[:, None], (n, 4)), shifts) & 0xFF
  return b.reshape(4 * n).astype(jnp.uint8)


def _kernel(slot_ref, x_ref, rope_ref, cache_in_ref, cache_ref, *, kv_cache_dtype, block_size,
            capacity):
  del cache_in_ref  # The same buffer as cache_ref (input_output_aliases).
  t = pl.program_id(0)
  slot = slot_ref[t]

  @pl.when((slot >= 0) & (slot < capacity))
  def _write():
    block = slot // block_size
    offset = slot % block_size
    if kv_cache_dtype == "fp8_ds_mla":
      num_tiles, tile = F.DS_MLA_NUM_TILES, F.DS_MLA_TILE
    else:
      num_tiles, tile = F.MODEL1_NUM_TILES + 1, F.MODEL1_TILE
    x = x_ref[t, pl.ds(0, num_tiles * tile)].astype(jnp.float32).reshape(num_tiles, tile)
    rope = rope_ref[t, :]
    if kv_cache_dtype == "fp8_ds_mla":
      nope, scale = F.quantize_ds_mla_tiles(x)
      nope = nope.reshape(F.KV_LORA_RANK)
      base = offset * F.DS_MLA_BYTES
      cache_ref[block, pl.ds(base, F.KV_LORA_RANK)] = nope
      cache_ref[block, pl.ds(base + F.DS_MLA_SCALE_OFFSET, 4 * num_tiles)] = _le_bytes(
          jax.lax.bitcast_convert_type(scale, jnp.int32))
      cache_ref[block, pl.ds(base + F.DS_MLA_ROPE_OFFSET, 2 * F.ROPE_DIM)] = rope
    else:
      nope, e = F.quantize_model1_tiles(x)
      nope = nope.reshape(num_tiles * tile)
      lane = jax.lax.iota(jnp.int32, num_tiles * tile)
      base = offset * F.MODEL1_DATA_BYTES
      # The 8th tile is RoPE: its fp8 bytes are not stored, its scale slot is the pad.
      plgpu.store(cache_ref.at[block, pl.ds(base, num_tiles * tile)], nope,
                  mask=lane < F.MODEL1_NOPE)
      cache_ref[block, pl.ds(base + F.MODEL1_NOPE, 2 * F.ROPE_DIM)] = rope
      codes = jnp.where(jax.lax.iota(jnp.int32, num_tiles) < F.MODEL1_NUM_TILES, e + 127, 0)
      scale_at = block_size * F.MODEL1_DATA_BYTES + offset * F.MODEL1_SCALE_BYTES
      cache_ref[block, pl.ds(scale_at, F.MODEL1_SCALE_BYTES)] = codes.astype(jnp.uint8)


def write_quantized_pallas(x: jax.Array, rope: jax.Array, kv_cache: jax.Array,
                           slot_mapping: jax.Array, *, kv_cache_dtype: str,
                           interpret: bool = False) -> jax.Array:
  """Writes token ``t`` (``t < S``) into slot ``slot_mapping[t]``; invalid slots are skipped.

  Args:
    x: ``[S, >=512]`` float; its first 512 columns are quantized: the V3.2 NoPE
      (fp8_ds_mla) or the whole V4 latent, whose RoPE tile is not stored as fp8.
    rope: ``[S, 64]`` RoPE values, stored as bf16.
    kv_cache, slot_mapping, kv_cache_dtype: as ``concat_and_cache_mla``, which
      validates them.
  """
  num_tokens = slot_mapping.shape[0]
  nb, bs, width = kv_cache.shape
  rope = F.to_bytes(rope.astype(jnp.bfloat16))
  kernel = functools.partial(_kernel, kv_cache_dtype=kv_cache_dtype, block_size=bs,
                             capacity=nb * bs)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((nb, bs * width), jnp.uint8),
      grid=(num_tokens,),
      input_output_aliases={3: 0},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
  )(slot_mapping, x, rope, kv_cache.reshape(nb, bs * width))
  return out.reshape(nb, bs, width)
