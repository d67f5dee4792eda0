"""``"fp8_ds_mla"`` (DeepSeek V3.2, FlashMLA "FP8 with scale"): 656 bytes per token.

uint8 ``[num_blocks, block_size, 656]``; per token::

  bytes   0..511  512 x fp8 e4m3  NoPE value / scale of its 128-tile
  bytes 512..527    4 x float32   tile scales (little endian), tile i covers
                                  NoPE values 128*i .. 128*i+127
  bytes 528..655   64 x bf16      RoPE, not quantized

Writer (vLLM ``concat_and_cache_ds_mla_kernel``): ``scale = max(amax / 448,
FLT_MIN)``; FlashMLA's test reference instead uses power-of-two scales
``2**ceil(log2(max(amax / 448, 1e-4))))`` (``pow2_scales=True`` here). ``amax``
ignores NaN (the CUDA writer's ``fmaxf``). Dequantization multiplies in float32 and
rounds once to bf16.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla._common import D_NOPE, D_ROPE, check_dtype
from jax_mla.cache import e4m3
from jax_mla.cache.layout import Format, check_float, check_last, from_bytes, to_bytes


@dataclasses.dataclass(frozen=True)
class DsMla(Format):
  """The fp8_ds_mla token row ``[nope fp8 | num_tiles float32 scales | rope bf16]``.

  Attributes:
    nope: fp8 values per token (the first ``nope`` latent columns).
    rope: bf16 values per token (the rest of the latent).
    tile: fp8 values per float32 scale.
    min_scale: the scale's floor (vLLM's rule); ``pow2_min_scale`` that of FlashMLA's
      power-of-two rule.
  """
  name: str = "fp8_ds_mla"
  nope: int = D_NOPE
  rope: int = D_ROPE
  tile: int = 128
  min_scale: float = float(np.finfo(np.float32).tiny)  # FLT_MIN
  pow2_min_scale: float = 1e-4

  @property
  def head_size(self) -> int:  # 576
    return self.nope + self.rope

  @property
  def num_tiles(self) -> int:  # 4
    return self.nope // self.tile

  @property
  def scale_offset(self) -> int:  # 512: byte offset of the scales in a token row
    return self.nope

  @property
  def rope_offset(self) -> int:  # 528
    return self.scale_offset + 4 * self.num_tiles

  @property
  def token_bytes(self) -> int:  # 656
    return self.rope_offset + 2 * self.rope

  def row_width(self, block_size: int, head_size: int) -> int:
    del block_size, head_size
    return self.token_bytes

  def input_widths(self):
    return ((self.nope, self.rope),)

  def quantize_tiles(self, tiles: jax.Array, *, pow2_scales: bool = False):
    """float32 ``[..., tile]`` -> (fp8 bytes ``[..., tile]``, float32 scale ``[...]``),
    shared by the XLA codec and the Triton writer (see :mod:`jax_mla.cache.e4m3`).

    ``scale = max(amax / 448, FLT_MIN)`` (vLLM), or with ``pow2_scales``
    ``2**ceil(log2(max(amax / 448, 1e-4)))`` (FlashMLA's reference); values are
    ``x / scale`` rounded once to fp8.
    """
    amax = e4m3.tile_amax(tiles)
    if pow2_scales:
      e = jnp.maximum(e4m3.ceil_log2_div448(amax),
                      e4m3.ceil_log2(np.float32(self.pow2_min_scale)))
      return (e4m3.fp8_bytes(tiles * e4m3.exp2_int(-e)[..., None], sign_of=tiles),
              e4m3.exp2_int(e))
    scale = jnp.maximum(e4m3.div448(amax), self.min_scale)
    return e4m3.fp8_bytes_of_quotient(tiles, scale[..., None]), scale

  def encode(self, x: jax.Array, *, pow2_scales: bool = False) -> jax.Array:
    """Latents ``[..., 576]`` -> token rows uint8 ``[..., 656]``."""
    nope = x[..., :self.nope].astype(jnp.float32)
    tiles = nope.reshape(*x.shape[:-1], self.num_tiles, self.tile)
    nope_bytes, scale = self.quantize_tiles(tiles, pow2_scales=pow2_scales)
    nope_bytes = nope_bytes.reshape(*x.shape[:-1], self.nope)
    rope = x[..., self.nope:].astype(jnp.bfloat16)
    return jnp.concatenate([nope_bytes, to_bytes(scale), to_bytes(rope)], axis=-1)

  def decode_rows(self, rows, scale=None):
    del scale
    nope = e4m3.fp8_bytes_to_f32(rows[..., :self.nope])
    scale = from_bytes(rows[..., self.scale_offset:self.rope_offset], jnp.float32)
    nope = nope.reshape(*rows.shape[:-1], self.num_tiles, self.tile) * scale[..., None]
    rope = from_bytes(rows[..., self.rope_offset:], jnp.bfloat16)
    return jnp.concatenate(
        [nope.reshape(*rows.shape[:-1], self.nope).astype(jnp.bfloat16), rope], axis=-1)

  def encode_rows(self, x, scale, dtype):
    del scale, dtype
    return self.encode(x)


DS_MLA = DsMla()


@functools.partial(jax.jit, static_argnames=("pow2_scales",))
def quantize_fp8_ds_mla(x: jax.Array, *, pow2_scales: bool = False) -> jax.Array:
  """Quantizes latents to the 656-byte fp8_ds_mla token layout.

  Args:
    x: ``[..., 576]`` float (bf16 usually): ``[kv_c (512) | k_pe (64)]``.
    pow2_scales: round each tile scale up to a power of two (FlashMLA's
      reference ``quantize_k_cache``); default is vLLM's writer,
      ``max(amax / 448, FLT_MIN)``.

  Returns:
    uint8 ``[..., 656]``. A bf16 ``[num_blocks, block_size, 576]`` input gives a
    whole fp8_ds_mla cache.
  """
  check_float("x", x)
  check_last("x", x, DS_MLA.head_size)
  return DS_MLA.encode(x, pow2_scales=pow2_scales)


@jax.jit
def dequantize_fp8_ds_mla(b: jax.Array) -> jax.Array:
  """Inverse of :func:`quantize_fp8_ds_mla`: uint8 ``[..., 656]`` -> bf16 ``[..., 576]``."""
  check_dtype("b", b, jnp.uint8)
  check_last("b", b, DS_MLA.token_bytes)
  return DS_MLA.decode_rows(b)
