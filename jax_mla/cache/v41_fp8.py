"""``"fp8_v41"`` (DeepSeek V4.1, FlashMLA ``V41_FP8Sparse``): 528 bytes per token.

uint8 ``[num_blocks, block_size, 528]``, token rows contiguous, no block padding::

  bytes   0..511  512 x fp8 e4m3   latent value / scale of its 32-tile (RoPE included)
  bytes 512..527   16 x UE8M0      scale 2**(byte - 127) of values 32*i .. 32*i+31

Scale of a tile (FlashMLA ``tests/quant.py``): ``2**ceil(log2(max(amax / 448,
1e-4)))``, so UE8M0 bytes 114..247 for finite input; values ``x / scale`` rounded
once to fp8 (exact quotients: the scale is a power of two). A NaN poisons its tile
as torch's ``max`` does there: scale byte 0xFF (NaN) and every value NaN (0x7F); an
infinity gives scale +inf, also byte 0xFF, finite values ``+-0`` and infinities
NaN. NaN bytes are 0x7F whatever the input's sign (the GPU's canonical NaN).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla._common import check_dtype
from jax_mla.cache import e4m3
from jax_mla.cache.layout import TileScaled, check_float, check_last

_NAN_SCALE = 0xFF  # UE8M0 NaN; +inf scales are stored as it too


@dataclasses.dataclass(frozen=True)
class V41Fp8(TileScaled):
  """The fp8_v41 token row ``[512 fp8 | 16 UE8M0]``.

  Attributes:
    min_scale: floor of ``amax / 448`` in the scale rule.
  """
  name: str = "fp8_v41"
  tile: int = 32
  bits: int = 8
  min_scale: float = 1e-4

  @property
  def min_exponent(self) -> int:  # -13: ceil(log2(float32(1e-4))), a Python int for kernels
    return int(np.ceil(np.log2(np.float64(np.float32(self.min_scale)))))

  def quantize_tiles(self, tiles):
    """``e = max(ceil(log2(amax / 448)), ceil(log2(1e-4)))`` (exact, see
    :func:`~jax_mla.cache.e4m3.ceil_log2_div448`), values ``fp8(x * 2**-e)``, byte
    ``e + 127``; a tile with NaN or an infinity as in the module doc."""
    has_nan = jnp.max(jnp.isnan(tiles).astype(jnp.int32), axis=-1) > 0
    amax = e4m3.tile_amax(tiles)  # NaN left out: has_nan decides those tiles
    e = jnp.maximum(e4m3.ceil_log2_div448(amax), self.min_exponent)
    vals = e4m3.fp8_bytes(tiles * e4m3.exp2_int(-e)[..., None]).astype(jnp.int32)
    # x / NaN is NaN, x / inf is +-0 and inf / inf NaN.
    poisoned = has_nan | (amax == jnp.inf)
    nan_out = has_nan[..., None] | ~jnp.isfinite(tiles)
    zero = jnp.where(jax.lax.bitcast_convert_type(tiles, jnp.int32) < 0, 0x80, 0)
    vals = jnp.where(poisoned[..., None], jnp.where(nan_out, 0x7F, zero), vals)
    return vals, jnp.where(poisoned, _NAN_SCALE, e + 127)

  def decode_values(self, codes):
    return e4m3.fp8_bytes_to_f32(codes.astype(jnp.uint8))

  def decode_scales(self, codes):
    """UE8M0 byte ``c`` -> ``2**(c - 127)``: the float32 whose exponent field is ``c``
    (UE8M0 shares float32's bias); 0xFF is NaN. Byte 0 (``2**-127``, a subnormal; never
    written) reads as 0, as it would on platforms that flush subnormals."""
    scale = jax.lax.bitcast_convert_type(jax.lax.shift_left(codes, 23), jnp.float32)
    return jnp.where(codes == _NAN_SCALE, jnp.nan, scale)


V41_FP8 = V41Fp8()


@jax.jit
def quantize_fp8_v41(x: jax.Array) -> jax.Array:
  """Quantizes DeepSeek V4.1 latents to fp8_v41 token rows.

  Args:
    x: ``[..., 512]`` float: 448 NoPE values then 64 RoPE values, all quantized.

  Returns:
    uint8 ``[..., 528]``; a ``[num_blocks, block_size, 512]`` input gives a whole
    cache (FlashMLA ``quantize_k_cache(..., V41_FP8Sparse)``).
  """
  check_float("x", x)
  check_last("x", x, V41_FP8.head_size)
  return V41_FP8.encode(x)


@jax.jit
def dequantize_fp8_v41(b: jax.Array) -> jax.Array:
  """Inverse of :func:`quantize_fp8_v41`: uint8 ``[..., 528]`` -> bf16 ``[..., 512]``."""
  check_dtype("b", b, jnp.uint8)
  check_last("b", b, V41_FP8.token_bytes)
  return V41_FP8.decode_rows(b)
