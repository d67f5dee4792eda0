"""MLA KV-cache formats: shapes, quantization references and per-slot reads.

A cache holds one latent vector per token slot; slot ``s`` lives in block
``s // block_size`` at offset ``s % block_size`` (``block_size = cache.shape[1]``
for every format). Formats (``kv_cache_dtype``):

``"auto"``
  ``[num_blocks, block_size, head_size]`` in the activation dtype (bf16):
  ``[kv_c (512) | k_pe (64)]``.

``"fp8"``
  Same layout, ``float8_e4m3fn(x / scale)`` with one per-tensor float32
  ``scale`` (vLLM's ``fp8`` / ``fp8_e4m3``). The array may be
  ``float8_e4m3fn`` or ``uint8`` (the same bytes).

``"fp8_ds_mla"`` (DeepSeek V3.2, FlashMLA "FP8 with scale")
  uint8 ``[num_blocks, block_size, 656]``; per token::

    bytes   0..511  512 x fp8 e4m3  NoPE value / scale of its 128-tile
    bytes 512..527    4 x float32   tile scales (little endian), tile i covers
                                    NoPE values 128*i .. 128*i+127
    bytes 528..655   64 x bf16      RoPE, not quantized

  Writer (vLLM ``concat_and_cache_ds_mla_kernel``): ``scale = max(amax / 448,
  FLT_MIN)``; FlashMLA's test reference instead uses power-of-two scales
  ``2**ceil(log2(max(amax / 448, 1e-4))))`` (``pow2_scales=True`` here).

``"fp8_model1"`` (DeepSeek V4, FlashMLA ``MODEL1_FP8Sparse``, vLLM's V4
``quantize_and_insert_k_cache``)
  One 512-wide latent per token: 448 NoPE values (fp8, 7 tiles of 64) and
  64 RoPE values (bf16). Per cache block of ``block_size`` tokens::

    [0, bs*576)            token data, token j at j*576:
                             448 x fp8 e4m3 NoPE, then 64 x bf16 RoPE (128 B)
    [bs*576, bs*584)       scales, token j at bs*576 + j*8:
                             7 x UE8M0 (exponent + 127, one per 64-tile), 1 zero pad
    [bs*584, padded)       padding up to a multiple of 576 bytes

  The array is uint8 ``[num_blocks, block_size, padded // block_size]``
  (FlashMLA's view; block_size must divide the padded block, which holds for
  every power of two up to 512). Tile scale: ``2**ceil(log2(max(amax, 1e-4) / 448))``
  (vLLM's writer; FlashMLA's test clamps ``amax/448`` at 1e-4 instead).

Quantized values are ``float8_e4m3fn(clip(float32(x / scale), +-448))``: the
IEEE float32 quotient, saturated, rounded to nearest even (CUDA's writers).
Dequantization multiplies in float32 and rounds once to bf16 (exact for the
power-of-two scales).

Bit-exact on every platform: XLA rewrites ``a / 448`` into ``a * fl(1/448)``,
and XLA:GPU and Triton divide with the approximate ``div.full.f32``, so no
result here depends on a division. ``amax / 448`` and ``ceil(log2(.))`` come from
float32 bits with exact corrections, and ``x / scale`` from a candidate fixed
up by exact comparisons at fp8 midpoints (:func:`fp8_bytes_of_quotient`). No
fp8 byte comes from a float conversion either (XLA:GPU's f32 -> f8 ``convert``
did not match round-to-nearest-even): :func:`fp8_bytes` rounds with integer bit
arithmetic. The
reference and the Pallas kernel share these functions. (Exactness assumes
normal float32 intermediates: tiles with amax below ~1e-30 may differ by an
fp8 step between platforms that flush denormals and those that do not.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla._common import (
  FP8_E4M3_MAX,
  check_dtype,
  check_int32,
  check_one_of,
  check_rank,
  check_shape,
)

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla", "fp8_model1")
FP8 = jnp.float8_e4m3fn

# DeepSeek V3 / V3.2 latent: kv_c 512 + k_pe 64.
KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_SIZE = KV_LORA_RANK + ROPE_DIM  # 576

# fp8_ds_mla (V3.2): 656 bytes per token.
DS_MLA_TILE = 128
DS_MLA_NUM_TILES = KV_LORA_RANK // DS_MLA_TILE  # 4
DS_MLA_SCALE_OFFSET = KV_LORA_RANK  # 512
DS_MLA_ROPE_OFFSET = DS_MLA_SCALE_OFFSET + 4 * DS_MLA_NUM_TILES  # 528
DS_MLA_BYTES = DS_MLA_ROPE_OFFSET + 2 * ROPE_DIM  # 656

# fp8_model1 (V4): 448 NoPE + 64 RoPE = 512.
MODEL1_HEAD_SIZE = 512
MODEL1_NOPE = MODEL1_HEAD_SIZE - ROPE_DIM  # 448
MODEL1_TILE = 64
MODEL1_NUM_TILES = MODEL1_NOPE // MODEL1_TILE  # 7
MODEL1_DATA_BYTES = MODEL1_NOPE + 2 * ROPE_DIM  # 576 per token, block front
MODEL1_SCALE_BYTES = MODEL1_NUM_TILES + 1  # 8 per token, block tail
MODEL1_TOKEN_BYTES = MODEL1_DATA_BYTES + MODEL1_SCALE_BYTES  # 584
MODEL1_BLOCK_ALIGN = 576

# Clamps of the scale rules (see the module docstring).
DS_MLA_MIN_SCALE = float(np.finfo(np.float32).tiny)  # FLT_MIN
POW2_MIN_SCALE = 1e-4
MODEL1_MIN_AMAX = 1e-4


# ----------------------------------------------------------------------------
# Shapes


def model1_block_bytes(block_size: int) -> int:
  """Bytes of one fp8_model1 cache block: ``block_size * 584`` padded to a multiple of 576."""
  raw = block_size * MODEL1_TOKEN_BYTES
  return -(-raw // MODEL1_BLOCK_ALIGN) * MODEL1_BLOCK_ALIGN


def _model1_row_width(block_size: int) -> int:
  padded = model1_block_bytes(block_size)
  if padded % block_size:
    raise ValueError(
        f"fp8_model1 needs block_size to divide its padded block ({padded} bytes) so the "
        f"cache can be viewed as [num_blocks, block_size, width]; got block_size={block_size}")
  return padded // block_size


def kv_cache_shape(num_blocks: int, block_size: int, head_size: int = HEAD_SIZE,
                   cache_dtype: str = "auto") -> tuple[int, int, int]:
  """Shape of an MLA KV cache (vLLM ``get_kv_cache_shape``).

  Args:
    num_blocks: number of cache blocks.
    block_size: tokens per block.
    head_size: latent width: 576 for DeepSeek V3/V3.2 (``"fp8_ds_mla"`` needs 576),
      512 for DeepSeek V4 (``"fp8_model1"`` needs 512); any width for ``"auto"``/``"fp8"``.
    cache_dtype: one of ``"auto"``, ``"fp8"``, ``"fp8_ds_mla"``, ``"fp8_model1"``.

  Returns:
    ``(num_blocks, block_size, last_dim)``; allocate it with
    :func:`kv_cache_storage_dtype`.
  """
  check_one_of("cache_dtype", cache_dtype, KV_CACHE_DTYPES)
  if num_blocks < 1 or block_size < 1 or head_size < 1:
    raise ValueError("num_blocks, block_size and head_size must be >= 1; got "
                     f"{num_blocks}, {block_size}, {head_size}")
  if cache_dtype == "fp8_ds_mla":
    if head_size != HEAD_SIZE:
      raise ValueError(f"head_size must be {HEAD_SIZE} for 'fp8_ds_mla'; got {head_size}")
    return (num_blocks, block_size, DS_MLA_BYTES)
  if cache_dtype == "fp8_model1":
    if head_size != MODEL1_HEAD_SIZE:
      raise ValueError(
          f"head_size must be {MODEL1_HEAD_SIZE} for 'fp8_model1' (DeepSeek V4); got {head_size}")
    return (num_blocks, block_size, _model1_row_width(block_size))
  return (num_blocks, block_size, head_size)


def kv_cache_storage_dtype(cache_dtype: str = "auto", activation_dtype=jnp.bfloat16):
  """Array dtype of a cache in format ``cache_dtype`` (``"auto"`` stores activations as is)."""
  check_one_of("cache_dtype", cache_dtype, KV_CACHE_DTYPES)
  return {"auto": jnp.dtype(activation_dtype), "fp8": jnp.dtype(FP8)}.get(
      cache_dtype, jnp.dtype(jnp.uint8))


# ----------------------------------------------------------------------------
# Tile quantizers, shared with the Pallas writer: plain jax.numpy on arrays of
# any shape, written so that XLA (CPU, GPU) and Triton give the same bits. The
# scale rules need no division: XLA turns `a / 448` into `a * fl(1/448)` and
# XLA:GPU and Triton divide with the approximate `div.full.f32`, all of which
# move results by an ulp against the IEEE quotient that the CUDA writers use.


def _exponent_bits(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(unbiased exponent, 23-bit mantissa field) of float32 ``x``."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  return (jax.lax.shift_right_logical(bits, 23) & 0xFF) - 127, bits & 0x7FFFFF


def ceil_log2(s: jax.Array) -> jax.Array:
  """``ceil(log2(s))`` as int32 for positive normal float32 ``s``, exact."""
  e, mantissa = _exponent_bits(s)
  return e + (mantissa != 0).astype(jnp.int32)


def exp2_int(e: jax.Array) -> jax.Array:
  """``2.0**e`` as float32 for int32 ``e`` in [-126, 127], exact."""
  return jax.lax.bitcast_convert_type(jax.lax.shift_left(e + 127, 23), jnp.float32)


def ceil_log2_div448(a: jax.Array) -> jax.Array:
  """``ceil(log2(a / 448))`` (int32) for positive float32 ``a``, exact.

  ``a = m * 2**k`` with ``m`` in [1, 2) and ``448 = 1.75 * 2**8``: the quotient is
  at most ``2**(k-8)`` iff ``m <= 1.75`` (mantissa field ``0x600000``). Equal to
  ``ceil_log2`` of the correctly rounded quotient (rounding never crosses a power
  of two here); values below the normal range give a very negative exponent.
  """
  k, mantissa = _exponent_bits(a)
  return k - 8 + (mantissa > 0x600000).astype(jnp.int32)


def div448(a: jax.Array) -> jax.Array:
  """Correctly rounded float32 ``a / 448`` for finite ``a >= 0`` where the
  quotient is a normal float; below that, some value <= FLT_MIN (callers clamp)."""
  a = a.astype(jnp.float32)
  small = a < 2.0**-60  # scaled up (exactly) so that every ulp below is normal
  a_s = jnp.where(a == 0, 1.0, jnp.where(small, a * np.float32(2.0**64), a))
  q = a_s * np.float32(1 / 7)  # within 2 ulp of a_s / 7
  for _ in range(2):  # each step moves q one ulp towards the rounded quotient
    r = 2 * (0.5 * a_s - 4 * q) + q  # a_s - 7q, exact (Sterbenz twice; no overflow)
    e, mantissa = _exponent_bits(q)
    up = exp2_int(e - 23)
    down = jnp.where(mantissa == 0, exp2_int(e - 24), up)  # ulp below a power of two
    q = jnp.where(2 * r > 7 * up, q + up, jnp.where(2 * r < -7 * down, q - down, q))
  q = q * jnp.where(small, np.float32(2.0**-70), np.float32(2.0**-6))
  return jnp.where(a == 0, 0.0, q)


_F32_448 = int(np.float32(FP8_E4M3_MAX).view(np.int32))  # float32 bits of 448
_F32_INF = 0x7F800000
_FP8_MAX_CODE = 0x7E  # 448, the largest finite e4m3fn magnitude
_FP8_NAN_CODE = 0x7F


def _fp8_code(bits: jax.Array) -> jax.Array:
  """e4m3fn magnitude code (int32, 0..0x7F) of the float32 with int32 ``bits``
  (sign ignored): round to nearest even, saturated to 448, NaN -> 0x7F.

  Integer arithmetic only, so the result is the same on every backend: under
  XLA:GPU (H100), codes derived from float32 -> float8 ``convert`` came out one
  step off against round-to-nearest-even at a few ties.
  ``|v| = m * 2**(e - 150)`` with the 24-bit significand ``m``; the code is
  ``(max(e - 121, 0) << 3) + round(m / 2**sh)``, ``sh = clip(141 - e, 20, 31)``
  (20 for e4m3 normals, more below 2**-6 where the step is 2**-9); a mantissa
  carry moves into the exponent field by itself.
  """
  u = bits & 0x7FFFFFFF
  biased = jax.lax.shift_right_logical(u, 23)
  e = jnp.maximum(biased, 1)  # float32 subnormals: exponent -126, no implicit bit
  m = (u & 0x7FFFFF) | jnp.where(biased > 0, 0x800000, 0)
  sh = jnp.clip(141 - e, 20, 31)
  q = jax.lax.shift_right_logical(m, sh)
  rem = m - jax.lax.shift_left(q, sh)
  half = jax.lax.shift_left(jnp.ones_like(sh), sh - 1)
  q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
  code = jax.lax.shift_left(jnp.maximum(e - 121, 0), 3) + q
  code = jnp.where(u >= _F32_448, _FP8_MAX_CODE, code)
  return jnp.where(u > _F32_INF, _FP8_NAN_CODE, code)


def _fp8_value(code: jax.Array) -> jax.Array:
  """float32 value of the e4m3fn magnitude code ``code`` (int32, 0..0x7E), exact."""
  exponent = jax.lax.shift_right_logical(code, 3)
  significand = (code & 7) | jnp.where(exponent > 0, 8, 0)
  return significand.astype(jnp.float32) * exp2_int(jnp.maximum(exponent, 1) - 10)


def _with_sign(code: jax.Array, x: jax.Array) -> jax.Array:
  """uint8 byte: ``code`` with the sign bit of float32 ``x`` (so -0.0 and -NaN keep it)."""
  negative = jax.lax.bitcast_convert_type(x, jnp.int32) < 0
  return (code | jnp.where(negative, 0x80, 0)).astype(jnp.uint8)


def fp8_bytes(v: jax.Array) -> jax.Array:
  """uint8 bytes of ``float8_e4m3fn(clip(v, +-448))`` for float32 ``v`` (round to
  nearest even; NaN stays NaN with its sign), from integer bit arithmetic."""
  return _with_sign(_fp8_code(jax.lax.bitcast_convert_type(v, jnp.int32)), v)


def _ulp_up_down(v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 spacing above and below positive normal ``v``."""
  e, mantissa = _exponent_bits(v)
  up = exp2_int(e - 23)
  return up, jnp.where(mantissa == 0, 0.5 * up, up)


def _settle_quotient_code(ax: jax.Array, s: jax.Array, code: jax.Array) -> jax.Array:
  """e4m3fn magnitude code of ``clip(float32(ax / s), 448)`` for ``ax >= 0`` and
  positive normal ``s``, given a candidate ``code`` at most one off.

  The candidate is settled at the fp8 midpoint ``m`` towards each neighbour code:
  the float32 quotient lies beyond ``m`` iff ``ax / s > m + ulp(m)/2``, and equals
  ``m`` (an fp8 tie, to the even code) iff it is within half a float32 ulp of it.
  The signs of ``ax - (m + h) * s`` decide, computed exactly: ``s`` is split into
  two 12-bit halves so every product is exact, and ``h`` is a power of two.
  """
  c = _fp8_value(code)
  s_hi = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(s, jnp.int32) & ~0xFFF, jnp.float32)
  s_lo = s - s_hi

  def cmp(m, h):  # sign of ax - (m + h) * s
    return ((ax - m * s_hi) - m * s_lo) - h * s

  def side(m):  # +1: the float32 quotient is above m, -1: below, 0: equal
    up, down = _ulp_up_down(m)
    return jnp.where(cmp(m, 0.5 * up) > 0, 1, jnp.where(cmp(m, -0.5 * down) < 0, -1, 0))

  odd = (code & 1) == 1  # its neighbours are even: a tie moves there
  above = side(0.5 * (c + _fp8_value(code + 1)))
  below = side(0.5 * (c + _fp8_value(jnp.maximum(code - 1, 0))))
  go_up = (code < _FP8_MAX_CODE) & ((above > 0) | ((above == 0) & odd))
  go_down = (code > 0) & ((below < 0) | ((below == 0) & odd))
  return code + go_up.astype(jnp.int32) - go_down.astype(jnp.int32)


def fp8_bytes_of_quotient(x: jax.Array, s: jax.Array) -> jax.Array:
  """uint8 bytes of ``float8_e4m3fn(clip(float32(x / s), +-448))`` for float32 ``x``
  and positive normal ``s``: the IEEE float32 quotient rounded to fp8 (as the
  CUDA writers do), identically on every platform.

  The platform's float32 division (approximate on XLA:GPU and Triton) gives a
  candidate code at most one off, which exact comparisons then settle
  (:func:`_settle_quotient_code`).
  """
  ax = jnp.abs(x)
  candidate = _fp8_code(jax.lax.bitcast_convert_type(ax / s, jnp.int32))
  code = _settle_quotient_code(ax, s, candidate)
  return _with_sign(jnp.where(jnp.isnan(x), _FP8_NAN_CODE, code), x)


def quantize_ds_mla_tiles(tiles: jax.Array, *, pow2_scales: bool = False):
  """float32 ``[..., tile]`` -> (fp8 bytes ``[..., tile]``, float32 scale ``[...]``).

  ``scale = max(amax / 448, FLT_MIN)`` (vLLM), or with ``pow2_scales``
  ``2**ceil(log2(max(amax / 448, 1e-4)))`` (FlashMLA's reference); values are
  ``x / scale`` rounded once to fp8.
  """
  amax = jnp.max(jnp.abs(tiles), axis=-1)
  if pow2_scales:
    e = jnp.maximum(ceil_log2_div448(amax), ceil_log2(np.float32(POW2_MIN_SCALE)))
    return fp8_bytes(tiles * exp2_int(-e)[..., None]), exp2_int(e)
  scale = jnp.maximum(div448(amax), DS_MLA_MIN_SCALE)
  return fp8_bytes_of_quotient(tiles, scale[..., None]), scale


def quantize_model1_tiles(tiles: jax.Array):
  """float32 ``[..., 64]`` -> (fp8 bytes, int32 exponent ``e`` of the scale ``2**e``).

  ``e = ceil(log2(max(amax, 1e-4) / 448))``, in [-22, 120] for finite input.
  """
  e = ceil_log2_div448(jnp.maximum(jnp.max(jnp.abs(tiles), axis=-1), MODEL1_MIN_AMAX))
  return fp8_bytes(tiles * exp2_int(-e)[..., None]), e


def to_bytes(x: jax.Array) -> jax.Array:
  """Little-endian bytes of ``x`` along the last axis: ``[..., n] -> [..., n * itemsize]``."""
  b = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return b.reshape(*x.shape[:-1], -1)


def _from_bytes(b: jax.Array, dtype) -> jax.Array:
  size = jnp.dtype(dtype).itemsize
  return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, size), dtype)


def _fp8_bytes_to_f32(b: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(b, FP8).astype(jnp.float32)


# ----------------------------------------------------------------------------
# fp8_ds_mla (V3.2)


def _check_last(name: str, x, size: int) -> None:
  if x.ndim < 1 or x.shape[-1] != size:
    raise ValueError(f"{name} must have shape [..., {size}]; got {list(x.shape)}")


def check_float(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize < 2:
    raise TypeError(f"{name} must have dtype bfloat16, float16 or float32; got {x.dtype}")


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
  _check_last("x", x, HEAD_SIZE)
  nope = x[..., :KV_LORA_RANK].astype(jnp.float32)
  tiles = nope.reshape(*x.shape[:-1], DS_MLA_NUM_TILES, DS_MLA_TILE)
  nope_bytes, scale = quantize_ds_mla_tiles(tiles, pow2_scales=pow2_scales)
  nope_bytes = nope_bytes.reshape(*x.shape[:-1], KV_LORA_RANK)
  rope = x[..., KV_LORA_RANK:].astype(jnp.bfloat16)
  return jnp.concatenate([nope_bytes, to_bytes(scale), to_bytes(rope)], axis=-1)


@jax.jit
def dequantize_fp8_ds_mla(b: jax.Array) -> jax.Array:
  """Inverse of :func:`quantize_fp8_ds_mla`: uint8 ``[..., 656]`` -> bf16 ``[..., 576]``."""
  check_dtype("b", b, jnp.uint8)
  _check_last("b", b, DS_MLA_BYTES)
  nope = _fp8_bytes_to_f32(b[..., :KV_LORA_RANK])
  scale = _from_bytes(b[..., DS_MLA_SCALE_OFFSET:DS_MLA_ROPE_OFFSET], jnp.float32)
  nope = nope.reshape(*b.shape[:-1], DS_MLA_NUM_TILES, DS_MLA_TILE) * scale[..., None]
  rope = _from_bytes(b[..., DS_MLA_ROPE_OFFSET:], jnp.bfloat16)
  return jnp.concatenate(
      [nope.reshape(*b.shape[:-1], KV_LORA_RANK).astype(jnp.bfloat16), rope], axis=-1)


# ----------------------------------------------------------------------------
# fp8_model1 (V4). Token-level bytes are [data (576) | scales (8)] = 584; the
# cache stores the two parts in separate regions of each block.


def encode_model1(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``[..., 512]`` -> (token data uint8 ``[..., 576]``, scale bytes uint8 ``[..., 8]``)."""
  tiles = x[..., :MODEL1_NOPE].astype(jnp.float32).reshape(
      *x.shape[:-1], MODEL1_NUM_TILES, MODEL1_TILE)
  nope_bytes, e = quantize_model1_tiles(tiles)
  nope_bytes = nope_bytes.reshape(*x.shape[:-1], MODEL1_NOPE)
  rope = x[..., MODEL1_NOPE:].astype(jnp.bfloat16)
  data = jnp.concatenate([nope_bytes, to_bytes(rope)], axis=-1)
  codes = (e + 127).astype(jnp.uint8)
  scales = jnp.concatenate([codes, jnp.zeros((*x.shape[:-1], 1), jnp.uint8)], axis=-1)
  return data, scales


def decode_model1(data: jax.Array, scales: jax.Array) -> jax.Array:
  """(``[..., 576]``, ``[..., 8]``) bytes -> bf16 ``[..., 512]``."""
  nope = _fp8_bytes_to_f32(data[..., :MODEL1_NOPE]).reshape(
      *data.shape[:-1], MODEL1_NUM_TILES, MODEL1_TILE)
  scale = exp2_int(scales[..., :MODEL1_NUM_TILES].astype(jnp.int32) - 127)
  nope = (nope * scale[..., None]).reshape(*data.shape[:-1], MODEL1_NOPE)
  rope = _from_bytes(data[..., MODEL1_NOPE:], jnp.bfloat16)
  return jnp.concatenate([nope.astype(jnp.bfloat16), rope], axis=-1)


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
  _check_last("x", x, MODEL1_HEAD_SIZE)
  return jnp.concatenate(encode_model1(x), axis=-1)


@jax.jit
def dequantize_fp8_model1(b: jax.Array) -> jax.Array:
  """Inverse of :func:`quantize_fp8_model1`: uint8 ``[..., 584]`` -> bf16 ``[..., 512]``."""
  check_dtype("b", b, jnp.uint8)
  _check_last("b", b, MODEL1_TOKEN_BYTES)
  return decode_model1(b[..., :MODEL1_DATA_BYTES], b[..., MODEL1_DATA_BYTES:])


def _model1_regions(cache: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Cache -> (token data ``[nb, bs, 576]``, scale bytes ``[nb, bs, 8]``) views."""
  nb, bs, _ = cache.shape
  flat = cache.reshape(nb, -1)
  data = flat[:, :bs * MODEL1_DATA_BYTES].reshape(nb, bs, MODEL1_DATA_BYTES)
  scales = flat[:, bs * MODEL1_DATA_BYTES:bs * MODEL1_TOKEN_BYTES].reshape(
      nb, bs, MODEL1_SCALE_BYTES)
  return data, scales


def check_model1_cache(name: str, cache) -> None:
  check_dtype(name, cache, jnp.uint8)
  check_rank(name, cache, 3)
  width = _model1_row_width(cache.shape[1])
  check_shape(name, cache, (None, cache.shape[1], width))


@jax.jit
def quantize_fp8_model1_cache(x: jax.Array) -> jax.Array:
  """Builds a whole fp8_model1 cache from bf16 ``x[num_blocks, block_size, 512]``.

  Returns uint8 ``[num_blocks, block_size, padded_block_bytes // block_size]``
  (FlashMLA ``quantize_k_cache(..., MODEL1_FP8Sparse)``), padding bytes zero.
  """
  check_float("x", x)
  check_rank("x", x, 3)
  _check_last("x", x, MODEL1_HEAD_SIZE)
  nb, bs, _ = x.shape
  width = _model1_row_width(bs)
  data, scales = encode_model1(x)
  pad = jnp.zeros((nb, bs * width - bs * MODEL1_TOKEN_BYTES), jnp.uint8)
  flat = jnp.concatenate([data.reshape(nb, -1), scales.reshape(nb, -1), pad], axis=-1)
  return flat.reshape(nb, bs, width)


@jax.jit
def dequantize_fp8_model1_cache(cache: jax.Array) -> jax.Array:
  """fp8_model1 cache ``[num_blocks, block_size, width]`` -> bf16 ``[.., .., 512]``."""
  check_model1_cache("cache", cache)
  return decode_model1(*_model1_regions(cache))


# ----------------------------------------------------------------------------
# fp8 per tensor


def check_fp8_cache(name: str, cache) -> None:
  check_dtype(name, cache, (FP8, jnp.uint8))


def quantize_fp8_per_tensor(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``float8_e4m3fn(clip(x / scale, +-448))`` with a scalar float32 ``scale``."""
  return jax.lax.bitcast_convert_type(fp8_bytes_of_quotient(x.astype(jnp.float32), scale), FP8)


def as_scale(scale) -> jax.Array:
  """The per-tensor scale as a float32 scalar (``None`` means 1.0)."""
  s = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
  if s.size != 1:
    raise ValueError(f"scale must be a scalar (one per-tensor value); got shape {list(s.shape)}")
  return s.reshape(())


# ----------------------------------------------------------------------------
# Per-slot reads


def num_slots(kv_cache) -> int:
  return kv_cache.shape[0] * kv_cache.shape[1]


def check_cache(kv_cache, kv_cache_dtype: str, name: str = "kv_cache") -> None:
  """Validates a cache array against its format (rank, dtype, last dimension)."""
  check_one_of("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)
  check_rank(name, kv_cache, 3)
  if kv_cache_dtype == "auto":
    check_float(name, kv_cache)
  elif kv_cache_dtype == "fp8":
    check_fp8_cache(name, kv_cache)
  elif kv_cache_dtype == "fp8_ds_mla":
    check_dtype(name, kv_cache, jnp.uint8)
    check_shape(name, kv_cache, (None, None, DS_MLA_BYTES))
  else:
    check_model1_cache(name, kv_cache)


def latent_size(kv_cache, kv_cache_dtype: str) -> int:
  """Width of the dequantized latent a cache holds (576 V3.2, 512 V4, ``head_size`` otherwise)."""
  return {"fp8_ds_mla": HEAD_SIZE, "fp8_model1": MODEL1_HEAD_SIZE}.get(
      kv_cache_dtype, kv_cache.shape[-1])


@functools.partial(jax.jit, static_argnames=("kv_cache_dtype",))
def gather_dequantize(kv_cache: jax.Array, slots: jax.Array, *, kv_cache_dtype: str,
                      scale=None) -> jax.Array:
  """Reads and dequantizes the latents at global slots, for any cache format.

  Args:
    kv_cache: ``[num_blocks, block_size, *]`` cache in format ``kv_cache_dtype``.
    slots: int32, any shape; ``slot = block * block_size + offset``. Slots outside
      ``[0, num_blocks * block_size)`` are clamped into range (so the result there
      is some other slot's data, possibly NaN): callers mask them.
    kv_cache_dtype: ``"auto"``, ``"fp8"``, ``"fp8_ds_mla"`` or ``"fp8_model1"``.
    scale: per-tensor float32 scale of ``"fp8"`` (default 1.0); unused otherwise.

  Returns:
    ``[*slots.shape, d]`` with ``d = 576`` (``"fp8_ds_mla"``), 512 (``"fp8_model1"``)
    or ``head_size`` (``"auto"``/``"fp8"``); bf16, except ``"auto"`` which keeps the
    cache dtype.
  """
  check_cache(kv_cache, kv_cache_dtype)
  check_int32("slots", slots)
  nb, bs, width = kv_cache.shape
  s = jnp.clip(slots, 0, nb * bs - 1)
  if kv_cache_dtype == "fp8_model1":
    # Token data and scales live in different regions of the block: two gathers,
    # no copy of the cache.
    # (block, byte-in-block) gathers: a flat byte index would pass 2**31 on caches
    # of 2 GiB and more.
    blocks = kv_cache.reshape(nb, bs * width)
    block, offset = (s // bs)[..., None], (s % bs)[..., None]
    data = blocks[block, offset * MODEL1_DATA_BYTES + jnp.arange(MODEL1_DATA_BYTES)]
    scales = blocks[block, bs * MODEL1_DATA_BYTES + offset * MODEL1_SCALE_BYTES
                    + jnp.arange(MODEL1_SCALE_BYTES)]
    return decode_model1(data, scales)
  rows = kv_cache.reshape(nb * bs, width)[s]
  if kv_cache_dtype == "fp8_ds_mla":
    return dequantize_fp8_ds_mla(rows)
  if kv_cache_dtype == "fp8":
    vals = jax.lax.bitcast_convert_type(rows, FP8) if rows.dtype == jnp.uint8 else rows
    return (vals.astype(jnp.float32) * as_scale(scale)).astype(jnp.bfloat16)
  return rows
