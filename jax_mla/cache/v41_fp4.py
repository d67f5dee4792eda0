"""``"fp4_v41"`` (DeepSeek V4.1, FlashMLA ``V41_FP4Sparse``): 288 bytes per token.

uint8 ``[num_blocks, block_size, 288]``, token rows contiguous, no block padding::

  bytes   0..255  512 x fp4 e2m1   two per byte: value 2i in the low nibble of byte i,
                                   2i+1 in the high one (RoPE included)
  bytes 256..287   32 x fp8 e4m3   scale of values 16*i .. 16*i+15

Scale of a tile (FlashMLA ``tests/quant.py``): ``e4m3(clip(amax / 6, 2**-9, 448))``,
``amax / 6`` the IEEE float32 quotient rounded once to e4m3; values: the e2m1 code
of the float32 quotient ``x / scale``, nearest, ties to even, saturated at +-6
(:mod:`~jax_mla.cache.e2m1`). A NaN poisons its tile: scale NaN (0x7F) and every
code 0 (``x / NaN`` is the GPU's canonical, positive NaN, which e2m1 stores as +0).
An infinity does not: ``amax`` takes it as the largest float32 (torch's
``nan_to_num``), so the scale is 448 and the infinity saturates to +-6. FlashMLA
serves this format as the extra (compressed) cache next to an ``"fp8_v41"`` main
cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla._common import check_dtype
from jax_mla.cache import e2m1, e4m3
from jax_mla.cache.layout import TileScaled, check_float, check_last

_FP8_NAN = 0x7F
_F32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class V41Fp4(TileScaled):
  """The fp4_v41 token row ``[256 B of e2m1 pairs | 32 e4m3 scales]``."""
  name: str = "fp4_v41"
  tile: int = 16
  bits: int = 4

  def quantize_tiles(self, tiles):
    """Scale byte: e4m3 code of ``float32(amax / 6)``, at least 1 (``2**-9``), exact
    (:func:`~jax_mla.cache.e4m3.fp8_bytes_of_quotient`); value codes
    :func:`~jax_mla.cache.e2m1.codes` of ``x / scale``; NaN or inf: see the module doc."""
    mag = jnp.minimum(jnp.abs(tiles), _F32_MAX)
    amax = jnp.max(jnp.where(jnp.isnan(tiles), jnp.inf, mag), axis=-1)
    poisoned = amax == jnp.inf  # a NaN, and only a NaN
    scale = jnp.maximum(e4m3.fp8_bytes_of_quotient(
        amax, jnp.full_like(amax, e2m1.MAX)).astype(jnp.int32), 1)
    vals = e2m1.codes(tiles, e4m3.fp8_value(scale)[..., None])
    return (jnp.where(poisoned[..., None], 0, vals),
            jnp.where(poisoned, _FP8_NAN, scale))

  def decode_values(self, codes):
    return e2m1.values(codes)

  def decode_scales(self, codes):
    return e4m3.fp8_bytes_to_f32(codes.astype(jnp.uint8))


V41_FP4 = V41Fp4()


@jax.jit
def quantize_fp4_v41(x: jax.Array) -> jax.Array:
  """Quantizes DeepSeek V4.1 latents to fp4_v41 token rows.

  Args:
    x: ``[..., 512]`` float: 448 NoPE values then 64 RoPE values, all quantized.

  Returns:
    uint8 ``[..., 288]``; a ``[num_blocks, block_size, 512]`` input gives a whole
    cache (FlashMLA ``quantize_k_cache(..., V41_FP4Sparse)``).
  """
  check_float("x", x)
  check_last("x", x, V41_FP4.head_size)
  return V41_FP4.encode(x)


@jax.jit
def dequantize_fp4_v41(b: jax.Array) -> jax.Array:
  """Inverse of :func:`quantize_fp4_v41`: uint8 ``[..., 288]`` -> bf16 ``[..., 512]``."""
  check_dtype("b", b, jnp.uint8)
  check_last("b", b, V41_FP4.token_bytes)
  return V41_FP4.decode_rows(b)
