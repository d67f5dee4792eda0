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

Triton's float32 ``/`` is approximate (``div.full.f32``); the quantizer needs
the correctly rounded quotient to match the reference byte for byte, so on
CUDA it divides with ``div.rn.f32`` through inline PTX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla.cache import formats as F


def _div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
  """IEEE round-to-nearest float32 ``a / b`` on CUDA (PTX ``div.rn.f32``)."""
  return plgpu.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def _le_bytes(words: jax.Array) -> jax.Array:
  """int32 ``[n]`` -> little-endian uint8 ``[4n]`` (shifts, no reshaping bitcast)."""
  n = words.shape[0]
  shifts = jnp.broadcast_to(8 * jax.lax.iota(jnp.int32, 4)[None, :], (n, 4))
  b = jax.lax.shift_right_logical(jnp.broadcast_to(words[:, None], (n, 4)), shifts) & 0xFF
  return b.reshape(4 * n).astype(jnp.uint8)


def _kernel(slot_ref, x_ref, rope_ref, cache_in_ref, cache_ref, *, kv_cache_dtype, block_size,
            capacity, div):
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
    amax = jnp.max(jnp.abs(x), axis=1)
    rope = rope_ref[t, :]
    if kv_cache_dtype == "fp8_ds_mla":
      scale = F.ds_mla_tile_scale(amax, pow2_scales=False, div=div)
      nope = F.to_fp8_bytes(x, scale[:, None], div=div).reshape(F.KV_LORA_RANK)
      base = offset * F.DS_MLA_BYTES
      cache_ref[block, pl.ds(base, F.KV_LORA_RANK)] = nope
      cache_ref[block, pl.ds(base + F.DS_MLA_SCALE_OFFSET, 4 * num_tiles)] = _le_bytes(
          jax.lax.bitcast_convert_type(scale, jnp.int32))
      cache_ref[block, pl.ds(base + F.DS_MLA_ROPE_OFFSET, 2 * F.ROPE_DIM)] = rope
    else:
      e = F.model1_tile_exponent(amax, div=div)
      nope = F.to_fp8_bytes(x, F.exp2_int(e)[:, None], div=div).reshape(num_tiles * tile)
      lane = jax.lax.iota(jnp.int32, num_tiles * tile)
      base = offset * F.MODEL1_DATA_BYTES
      # The 8th tile is RoPE: its fp8 bytes are not stored, its scale slot is the pad.
      plgpu.store(cache_ref.at[block, pl.ds(base, num_tiles * tile)], nope,
                  mask=lane < F.MODEL1_NOPE)
      cache_ref[block, pl.ds(base + F.MODEL1_NOPE, 2 * F.ROPE_DIM)] = rope
      codes = jnp.where(jax.lax.iota(jnp.int32, num_tiles) < F.MODEL1_NUM_TILES, e + 127, 0)
      scale_at = block_size * F.MODEL1_DATA_BYTES + offset * F.MODEL1_SCALE_BYTES
      cache_ref[block, pl.ds(scale_at, F.MODEL1_SCALE_BYTES)] = codes.astype(jnp.uint8)


def _use_div_rn(interpret: bool) -> bool:
  # Inline PTX: CUDA only (ROCm keeps Triton's division; the interpreter runs on the host).
  if interpret or jax.default_backend() != "gpu":
    return False
  return "rocm" not in jax.devices()[0].client.platform_version.lower()


def write_quantized_pallas(x: jax.Array, kv_cache: jax.Array, slot_mapping: jax.Array, *,
                           kv_cache_dtype: str, interpret: bool = False) -> jax.Array:
  """Quantizes ``x[S, 576]`` (fp8_ds_mla) or ``x[S, 512]`` (fp8_model1) into their slots.

  Inputs are validated by ``concat_and_cache_mla``; invalid slots are skipped.
  """
  num_tokens = slot_mapping.shape[0]
  nb, bs, width = kv_cache.shape
  rope = F._to_bytes(x[:, -F.ROPE_DIM:].astype(jnp.bfloat16))
  div = _div_rn if _use_div_rn(interpret) else jnp.divide
  kernel = functools.partial(_kernel, kv_cache_dtype=kv_cache_dtype, block_size=bs,
                             capacity=nb * bs, div=div)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((nb, bs * width), jnp.uint8),
      grid=(num_tokens,),
      input_output_aliases={3: 0},
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
  )(slot_mapping, x, rope, kv_cache.reshape(nb, bs * width))
  return out.reshape(nb, bs, width)
