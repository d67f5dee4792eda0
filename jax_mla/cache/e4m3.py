"""fp8 e4m3 arithmetic, bit-exact on every platform: the one home of the fp8 cast.

Quantized values are ``float8_e4m3fn(clip(float32(x / scale), +-448))``: the IEEE
float32 quotient, saturated, rounded to nearest even (CUDA's writers). Every fp8
byte in jax_mla comes from here: the cache formats (XLA codec and Triton writer),
and :func:`cast_fp8` for per-tensor fp8 (the ``"fp8"`` cache, fp8 outputs).

Bit-exact on every platform: XLA rewrites ``a / 448`` into ``a * fl(1/448)``, and
XLA:GPU and Triton divide with the approximate ``div.full.f32``, so no result here
depends on a division. ``amax / 448`` and ``ceil(log2(.))`` come from float32 bits
with exact corrections, and ``x / scale`` from a candidate fixed up by exact
comparisons at fp8 midpoints (:func:`fp8_bytes_of_quotient`). No fp8 byte comes
from a float conversion either (XLA:GPU's f32 -> f8 ``convert`` did not match
round-to-nearest-even): :func:`fp8_bytes` rounds with integer bit arithmetic.
Everything is plain jax.numpy on arrays of any shape, so the XLA references and
the Pallas kernels share it. (Exactness assumes normal float32 intermediates:
tiles with amax below ~1e-30 may differ by an fp8 step between platforms that
flush denormals and those that do not.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla._common import FP8_E4M3_MAX

FP8 = jnp.float8_e4m3fn

_F32_448 = int(np.float32(FP8_E4M3_MAX).view(np.int32))  # float32 bits of 448
_F32_INF = 0x7F800000
_FP8_MAX_CODE = 0x7E  # 448, the largest finite e4m3fn magnitude
_FP8_NAN_CODE = 0x7F


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


def tile_amax(tiles: jax.Array) -> jax.Array:
  """``max |x|`` over the last axis, NaN ignored (CUDA's ``fmaxf`` writers): one NaN
  value stays one NaN byte instead of spoiling its tile's scale. Written out so that
  no backend's NaN rule for ``max`` decides it (Triton's ignores NaN, XLA's keeps it)."""
  return jnp.max(jnp.where(jnp.isnan(tiles), 0.0, jnp.abs(tiles)), axis=-1)


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


def fp8_value(code: jax.Array) -> jax.Array:
  """float32 value of the e4m3fn magnitude code ``code`` (int32, 0..0x7E), exact."""
  exponent = jax.lax.shift_right_logical(code, 3)
  significand = (code & 7) | jnp.where(exponent > 0, 8, 0)
  return significand.astype(jnp.float32) * exp2_int(jnp.maximum(exponent, 1) - 10)


def _with_sign(code: jax.Array, x: jax.Array) -> jax.Array:
  """uint8 byte: ``code`` with the sign bit of float32 ``x`` (so -0.0 and -NaN keep it)."""
  negative = jax.lax.bitcast_convert_type(x, jnp.int32) < 0
  return (code | jnp.where(negative, 0x80, 0)).astype(jnp.uint8)


def fp8_bytes(v: jax.Array, sign_of: jax.Array | None = None) -> jax.Array:
  """uint8 bytes of ``float8_e4m3fn(clip(v, +-448))`` for float32 ``v`` (round to
  nearest even; NaN stays NaN with its sign), from integer bit arithmetic.

  ``sign_of``: the float32 values whose signs the bytes take (default ``v``). Pass the
  input of a scaled ``v = x * 2**-e``: GPUs return a NaN product as +NaN, so only
  ``x`` keeps a -NaN's sign on every platform."""
  return _with_sign(_fp8_code(jax.lax.bitcast_convert_type(v, jnp.int32)),
                    v if sign_of is None else sign_of)


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
  c = fp8_value(code)
  s_hi = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(s, jnp.int32) & ~0xFFF, jnp.float32)
  s_lo = s - s_hi

  def cmp(m, h):  # sign of ax - (m + h) * s
    return ((ax - m * s_hi) - m * s_lo) - h * s

  def side(m):  # +1: the float32 quotient is above m, -1: below, 0: equal
    up, down = _ulp_up_down(m)
    return jnp.where(cmp(m, 0.5 * up) > 0, 1, jnp.where(cmp(m, -0.5 * down) < 0, -1, 0))

  odd = (code & 1) == 1  # its neighbours are even: a tie moves there
  above = side(0.5 * (c + fp8_value(code + 1)))
  below = side(0.5 * (c + fp8_value(jnp.maximum(code - 1, 0))))
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


def cast_fp8(x: jax.Array, scale=None) -> jax.Array:
  """``float8_e4m3fn(clip(float32(x / scale), +-448))`` with one float32 ``scale``
  (per tensor; ``None`` means 1.0): the fp8 cast of every per-tensor fp8 value."""
  s = jnp.asarray(1.0 if scale is None else scale, jnp.float32).reshape(())
  return jax.lax.bitcast_convert_type(fp8_bytes_of_quotient(x.astype(jnp.float32), s), FP8)


def fp8_bytes_to_f32(b: jax.Array) -> jax.Array:
  """float32 values of uint8 e4m3fn bytes (exact)."""
  return jax.lax.bitcast_convert_type(b, FP8).astype(jnp.float32)
