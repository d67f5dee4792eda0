"""Pallas Triton cache writer for the fp8_ds_mla, fp8_model1, fp8_v41 and fp4_v41 formats.

One program per token: load the leading latent values, compute the tile scales,
convert to fp8 (fp4) and store the token's bytes straight into its cache slot, at
the offsets of the format's layout object (:data:`~jax_mla.cache.ds_mla.DS_MLA`,
:data:`~jax_mla.cache.model1.MODEL1`, :class:`~jax_mla.cache.layout.TileScaled`).
The cache is aliased input -> output, so under jit with donation the write is in
place and only the written slots' bytes move.

Every in-kernel array has a power-of-two size: the quantized values are viewed as
tiles ``[4, 128]`` (V3.2), ``[8, 64]`` (V4: 7 NoPE tiles plus the RoPE tile,
whose fp8 bytes are masked off and whose scale byte becomes the zero pad), or
``[16, 32]`` / ``[32, 16]`` (V4.1 fp8 / fp4: the whole latent); the pieces stored
are 512 (V4: masked to 448), 256, 32, 16 or 8, and 128 bytes. The V3.2 / V4 RoPE
bytes are a bitcast of the input made outside the kernel (T * 128 bytes).

The quantization math is the XLA codec's own (``quantize_tiles`` of the format),
written without divisions where the result must be exact and with the fp8
rounding done in integer bit arithmetic (no float -> fp8 conversion), so the
kernel matches the XLA reference byte for byte.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla._common import next_pow2
from jax_mla.cache.ds_mla import DsMla
from jax_mla.cache.layout import Format, TileScaled, to_bytes
from jax_mla.cache.model1 import Model1


@dataclasses.dataclass(frozen=True)
class Config:
  """Triton launch parameters of the writer (one program per token)."""
  num_warps: int = 4
  num_stages: int = 1


def default_config() -> Config:
  return Config()


def supports(fmt: Format) -> bool:
  """Whether the kernel writes ``fmt`` (the others are a plain XLA scatter anyway)."""
  return isinstance(fmt, (DsMla, Model1, TileScaled))


def tiles(fmt: Format) -> tuple[int, int]:
  """``(tiles, tile)``: the kernel quantizes the first ``tiles * tile`` input columns
  (the format's scale tiles, their count rounded up to a power of two)."""
  return next_pow2(fmt.num_tiles), fmt.tile


def _le_bytes(words: jax.Array) -> jax.Array:
  """int32 ``[n]`` -> little-endian uint8 ``[4n]`` (shifts, no reshaping bitcast)."""
  n = words.shape[0]
  shifts = jnp.broadcast_to(8 * jax.lax.iota(jnp.int32, 4)[None, :], (n, 4))
  b = jax.lax.shift_right_logical(jnp.broadcast_to(words[:, None], (n, 4)), shifts) & 0xFF
  return b.reshape(4 * n).astype(jnp.uint8)


def _kernel(slot_ref, x_ref, rope_ref, cache_in_ref, cache_ref, *, fmt, block_size, capacity):
  del cache_in_ref  # The same buffer as cache_ref (input_output_aliases).
  t = pl.program_id(0)
  slot = slot_ref[t]

  @pl.when((slot >= 0) & (slot < capacity))
  def _write():
    block = slot // block_size
    offset = slot % block_size
    num_tiles, tile = tiles(fmt)
    x = x_ref[t, pl.ds(0, num_tiles * tile)].astype(jnp.float32).reshape(num_tiles, tile)
    rope = rope_ref[t, :]
    if isinstance(fmt, DsMla):
      nope, scale = fmt.quantize_tiles(x)
      nope = nope.reshape(fmt.nope)
      base = offset * fmt.token_bytes
      cache_ref[block, pl.ds(base, fmt.nope)] = nope
      cache_ref[block, pl.ds(base + fmt.scale_offset, 4 * num_tiles)] = _le_bytes(
          jax.lax.bitcast_convert_type(scale, jnp.int32))
      cache_ref[block, pl.ds(base + fmt.rope_offset, 2 * fmt.rope)] = rope
    else:
      nope, e = fmt.quantize_tiles(x)
      nope = nope.reshape(num_tiles * tile)
      lane = jax.lax.iota(jnp.int32, num_tiles * tile)
      base = offset * fmt.data_bytes
      # The tiles past the NoPE are RoPE: their fp8 bytes are not stored, the first
      # one's scale slot is the pad.
      plgpu.store(cache_ref.at[block, pl.ds(base, num_tiles * tile)], nope,
                  mask=lane < fmt.nope)
      cache_ref[block, pl.ds(base + fmt.nope, 2 * fmt.rope)] = rope
      codes = jnp.where(jax.lax.iota(jnp.int32, num_tiles) < fmt.num_tiles,
                        e + fmt.exponent_bias, 0)
      scale_at = fmt.scale_region(block_size) + offset * fmt.scale_bytes
      cache_ref[block, pl.ds(scale_at, fmt.scale_bytes)] = codes.astype(jnp.uint8)


def _tile_scaled_kernel(slot_ref, x_ref, cache_in_ref, cache_ref, *, fmt: TileScaled,
                        block_size, capacity):
  """V4.1: the whole latent quantized, ``[values | scale bytes]`` at the slot's row."""
  del cache_in_ref  # The same buffer as cache_ref (input_output_aliases).
  t = pl.program_id(0)
  slot = slot_ref[t]

  @pl.when((slot >= 0) & (slot < capacity))
  def _write():
    base = (slot % block_size) * fmt.token_bytes
    x = x_ref[t, pl.ds(0, fmt.head_size)].astype(jnp.float32).reshape(fmt.num_tiles, fmt.tile)
    codes, scales = fmt.quantize_tiles(x)
    block = slot // block_size
    cache_ref[block, pl.ds(base, fmt.data_bytes)] = fmt.pack(codes.reshape(fmt.head_size))
    cache_ref[block, pl.ds(base + fmt.data_bytes, fmt.num_tiles)] = scales.astype(jnp.uint8)


def write_quantized(x: jax.Array, rope: jax.Array | None, kv_cache: jax.Array,
                    slot_mapping: jax.Array, *, fmt: Format, config: Config,
                    interpret: bool = False) -> jax.Array:
  """Writes token ``t`` (``t < S``) into slot ``slot_mapping[t]``; invalid slots are skipped.

  Args:
    x: ``[S, >= tiles * tile]`` float (see :func:`tiles`); its leading columns are
      quantized: the V3.2 NoPE (fp8_ds_mla), the whole V4 latent, whose RoPE tile
      is not stored as fp8, or the whole V4.1 latent.
    rope: ``[S, 64]`` RoPE values, stored as bf16; ``None`` for the V4.1 formats.
    kv_cache, slot_mapping: as ``concat_and_cache_mla``, which validates them.
    fmt: the cache format (:func:`supports` it).
  """
  num_tokens = slot_mapping.shape[0]
  nb, bs, width = kv_cache.shape
  if rope is None:
    kernel = functools.partial(_tile_scaled_kernel, fmt=fmt, block_size=bs, capacity=nb * bs)
    operands = (slot_mapping, x)
  else:
    rope = to_bytes(rope.astype(jnp.bfloat16))
    kernel = functools.partial(_kernel, fmt=fmt, block_size=bs, capacity=nb * bs)
    operands = (slot_mapping, x, rope)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((nb, bs * width), jnp.uint8),
      grid=(num_tokens,),
      input_output_aliases={len(operands): 0},
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
  )(*operands, kv_cache.reshape(nb, bs * width))
  return out.reshape(nb, bs, width)
