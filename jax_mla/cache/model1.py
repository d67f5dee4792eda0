"""``"fp8_model1"`` (DeepSeek V4, FlashMLA ``MODEL1_FP8Sparse``, vLLM's V4
``quantize_and_insert_k_cache``).

One 512-wide latent per token: 448 NoPE values (fp8, 7 tiles of 64) and 64 RoPE
values (bf16). Per cache block of ``block_size`` tokens::

  [0, bs*576)            token data, token j at j*576:
                           448 x fp8 e4m3 NoPE, then 64 x bf16 RoPE (128 B)
  [bs*576, bs*584)       scales, token j at bs*576 + j*8:
                           7 x UE8M0 (exponent + 127, one per 64-tile), 1 zero pad
  [bs*584, padded)       padding up to a multiple of 576 bytes

The array is uint8 ``[num_blocks, block_size, padded // block_size]`` (FlashMLA's
view; block_size must divide the padded block, which holds for every power of two
up to 512). Tile scale: ``2**ceil(log2(max(amax, 1e-4) / 448))`` (vLLM's writer;
FlashMLA's test clamps ``amax/448`` at 1e-4 instead); ``amax`` ignores NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mla._common import D_QK_V4, D_ROPE, cdiv, check_dtype, check_rank
from jax_mla.cache import e4m3
from jax_mla.cache.layout import Format, check_float, check_last, from_bytes, slot_targets, to_bytes


@dataclasses.dataclass(frozen=True)
class Model1(Format):
  """The fp8_model1 block: token data rows at the front, scale rows behind them.

  Attributes:
    head_size: latent width (448 NoPE + 64 RoPE).
    rope: bf16 values per token (the last ``rope`` latent columns).
    tile: fp8 values per UE8M0 scale.
    block_align: a block's bytes are padded to a multiple of this.
    min_amax: the floor of a tile's ``amax`` in the scale rule.
    exponent_bias: UE8M0 code of the scale ``2**e`` is ``e + exponent_bias``.
  """
  name: str = "fp8_model1"
  head_size: int = D_QK_V4
  rope: int = D_ROPE
  tile: int = 64
  block_align: int = 576
  min_amax: float = 1e-4
  exponent_bias: int = 127

  @property
  def nope(self) -> int:  # 448 fp8 values, also the RoPE's byte offset in a data row
    return self.head_size - self.rope

  @property
  def num_tiles(self) -> int:  # 7
    return self.nope // self.tile

  @property
  def data_bytes(self) -> int:  # 576: one token's data row (fp8 NoPE, bf16 RoPE)
    return self.nope + 2 * self.rope

  @property
  def scale_bytes(self) -> int:  # 8: one token's scale row (UE8M0 codes, zero pad)
    return self.num_tiles + 1

  @property
  def token_bytes(self) -> int:  # 584
    return self.data_bytes + self.scale_bytes

  def block_bytes(self, block_size: int) -> int:
    """Bytes of one cache block: ``block_size * 584`` padded to a multiple of 576."""
    return cdiv(block_size * self.token_bytes, self.block_align) * self.block_align

  def scale_region(self, block_size: int) -> int:
    """Byte offset of a block's scale rows (behind its ``block_size`` data rows)."""
    return block_size * self.data_bytes

  def row_width(self, block_size: int, head_size: int) -> int:
    del head_size
    padded = self.block_bytes(block_size)
    if padded % block_size:
      raise ValueError(
          f"fp8_model1 needs block_size to divide its padded block ({padded} bytes) so the "
          f"cache can be viewed as [num_blocks, block_size, width]; got block_size={block_size}")
    return padded // block_size

  def input_widths(self):
    # V4 has one 512-wide latent: passed split (448 | 64) or whole with an empty k_pe,
    # as vLLM's V4 writer takes the whole latent.
    return ((self.nope, self.rope), (self.head_size, 0))

  def quantize_tiles(self, tiles: jax.Array):
    """float32 ``[..., tile]`` -> (fp8 bytes, int32 exponent ``e`` of the scale ``2**e``),
    shared by the XLA codec and the Triton writer.

    ``e = ceil(log2(max(amax, 1e-4) / 448))``, in [-22, 120] for finite input.
    """
    e = e4m3.ceil_log2_div448(jnp.maximum(e4m3.tile_amax(tiles), self.min_amax))
    return e4m3.fp8_bytes(tiles * e4m3.exp2_int(-e)[..., None], sign_of=tiles), e

  def __post_init__(self):
    if self.exponent_bias != 127:
      raise ValueError("UE8M0 codes are read as float32 exponent fields: exponent_bias is 127")

  def decode_scales(self, codes: jax.Array) -> jax.Array:
    """UE8M0 codes (int32) -> float32 scales ``2**(code - 127)``: the float32 whose
    exponent field is the code (UE8M0 shares float32's bias), so code 0 gives 0.0."""
    return jax.lax.bitcast_convert_type(jax.lax.shift_left(codes, 23), jnp.float32)

  def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[..., 512]`` -> (token data uint8 ``[..., 576]``, scale bytes uint8 ``[..., 8]``)."""
    tiles = x[..., :self.nope].astype(jnp.float32).reshape(
        *x.shape[:-1], self.num_tiles, self.tile)
    nope_bytes, e = self.quantize_tiles(tiles)
    nope_bytes = nope_bytes.reshape(*x.shape[:-1], self.nope)
    rope = x[..., self.nope:].astype(jnp.bfloat16)
    data = jnp.concatenate([nope_bytes, to_bytes(rope)], axis=-1)
    codes = (e + self.exponent_bias).astype(jnp.uint8)
    pad = jnp.zeros((*x.shape[:-1], self.scale_bytes - self.num_tiles), jnp.uint8)
    return data, jnp.concatenate([codes, pad], axis=-1)

  def decode(self, data: jax.Array, scales: jax.Array) -> jax.Array:
    """(``[..., 576]``, ``[..., 8]``) bytes -> bf16 ``[..., 512]``."""
    nope = e4m3.fp8_bytes_to_f32(data[..., :self.nope]).reshape(
        *data.shape[:-1], self.num_tiles, self.tile)
    scale = self.decode_scales(scales[..., :self.num_tiles].astype(jnp.int32))
    nope = (nope * scale[..., None]).reshape(*data.shape[:-1], self.nope)
    rope = from_bytes(data[..., self.nope:], jnp.bfloat16)
    return jnp.concatenate([nope.astype(jnp.bfloat16), rope], axis=-1)

  def regions(self, cache: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cache -> (token data ``[nb, bs, 576]``, scale bytes ``[nb, bs, 8]``) views."""
    nb, bs, _ = cache.shape
    flat = cache.reshape(nb, -1)
    data = flat[:, :self.scale_region(bs)].reshape(nb, bs, self.data_bytes)
    scales = flat[:, self.scale_region(bs):bs * self.token_bytes].reshape(
        nb, bs, self.scale_bytes)
    return data, scales

  def _columns(self, block_size: int, offset: jax.Array):
    """Byte columns, within its block, of the data and scale rows of token ``offset[..., 1]``."""
    data = offset * self.data_bytes + jnp.arange(self.data_bytes)
    scales = (self.scale_region(block_size) + offset * self.scale_bytes
              + jnp.arange(self.scale_bytes))
    return data, scales

  def gather_dequantize(self, kv_cache, slots, scale=None):
    # Token data and scales live in different regions of the block: two gathers, no
    # copy of the cache. (block, byte-in-block) gathers: a flat byte index would pass
    # 2**31 on caches of 2 GiB and more.
    del scale
    nb, bs, width = kv_cache.shape
    s = jnp.clip(slots, 0, nb * bs - 1)
    blocks = kv_cache.reshape(nb, bs * width)
    block = (s // bs)[..., None]
    data_cols, scale_cols = self._columns(bs, (s % bs)[..., None])
    return self.decode(blocks[block, data_cols], blocks[block, scale_cols])

  def token_regions(self, block_size, width):
    del width
    return ((0, self.data_bytes), (self.scale_region(block_size), self.scale_bytes))

  def encode_regions(self, x, scale, dtype):
    del scale, dtype
    return self.encode(x)

  def write(self, kv_cache, x, slot_mapping, scale):
    del scale
    nb, bs, width = kv_cache.shape
    data, scales = self.encode(x)
    target = slot_targets(slot_mapping, nb * bs)
    block = (target // bs)[:, None]  # == nb for skipped tokens: dropped
    data_cols, scale_cols = self._columns(bs, (target % bs)[:, None])
    flat = kv_cache.reshape(nb, bs * width)
    flat = flat.at[block, data_cols].set(data, mode="drop")
    flat = flat.at[block, scale_cols].set(scales, mode="drop")
    return flat.reshape(nb, bs, width)


MODEL1 = Model1()


def model1_block_bytes(block_size: int) -> int:
  """Bytes of one fp8_model1 cache block: ``block_size * 584`` padded to a multiple of 576."""
  return MODEL1.block_bytes(block_size)


@jax.jit
def quantize_fp8_model1(x: jax.Array) -> jax.Array:
  """Quantizes DeepSeek V4 latents to per-token fp8_model1 bytes.

  Args:
    x: ``[..., 512]`` float: 448 NoPE values then 64 RoPE values.

  Returns:
    uint8 ``[..., 584]``: the token's 576 data bytes (448 fp8 + 64 bf16) then its
    8 scale bytes (7 UE8M0 exponents + a zero pad), i.e. the two pieces a cache
    block stores apart. Use :func:`quantize_fp8_model1_cache` for a whole cache.
  """
  check_float("x", x)
  check_last("x", x, MODEL1.head_size)
  return jnp.concatenate(MODEL1.encode(x), axis=-1)


@jax.jit
def dequantize_fp8_model1(b: jax.Array) -> jax.Array:
  """Inverse of :func:`quantize_fp8_model1`: uint8 ``[..., 584]`` -> bf16 ``[..., 512]``."""
  check_dtype("b", b, jnp.uint8)
  check_last("b", b, MODEL1.token_bytes)
  return MODEL1.decode(b[..., :MODEL1.data_bytes], b[..., MODEL1.data_bytes:])


@jax.jit
def quantize_fp8_model1_cache(x: jax.Array) -> jax.Array:
  """Builds a whole fp8_model1 cache from bf16 ``x[num_blocks, block_size, 512]``.

  Returns uint8 ``[num_blocks, block_size, padded_block_bytes // block_size]``
  (FlashMLA ``quantize_k_cache(..., MODEL1_FP8Sparse)``), padding bytes zero.
  """
  check_float("x", x)
  check_rank("x", x, 3)
  check_last("x", x, MODEL1.head_size)
  nb, bs, _ = x.shape
  width = MODEL1.row_width(bs, MODEL1.head_size)
  data, scales = MODEL1.encode(x)
  pad = jnp.zeros((nb, bs * width - bs * MODEL1.token_bytes), jnp.uint8)
  flat = jnp.concatenate([data.reshape(nb, -1), scales.reshape(nb, -1), pad], axis=-1)
  return flat.reshape(nb, bs, width)


@jax.jit
def dequantize_fp8_model1_cache(cache: jax.Array) -> jax.Array:
  """fp8_model1 cache ``[num_blocks, block_size, width]`` -> bf16 ``[.., .., 512]``."""
  check_rank("cache", cache, 3)
  MODEL1.check(cache, "cache")
  return MODEL1.decode(*MODEL1.regions(cache))
