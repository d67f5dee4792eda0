"""fp4 e2m1 arithmetic, bit-exact on every platform: the one home of the e2m1 codes.

An e2m1 code is 4 bits: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the
mantissa; the magnitudes of codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (no inf, no
NaN). Quantizing ``x`` by a scale ``s`` gives the code of the IEEE float32
quotient ``x / s`` rounded to the nearest magnitude, ties to the even code,
saturated at 6 (PTX ``cvt.rn.satfinite.e2m1x2.f32``, FlashMLA's ``_quantize_to_e2m1``).

No result here depends on a division (approximate on XLA:GPU and Triton) or a
float conversion: :func:`magnitude_codes` places the quotient against the seven
midpoints between magnitudes with exact products and comparisons, and
:func:`values` builds the floats from their bits. Plain jax.numpy on arrays of any
shape, shared by the XLA codec and the Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MAX = 6.0  # the largest magnitude

# Midpoint j lies between magnitudes j and j + 1. A float32 quotient equals it iff the
# exact quotient is within half a float32 ulp of it (above, below): the midpoints have
# short significands, so a float32 tie rounds onto them.
_MIDPOINTS = tuple(float(m) for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
_HALF_UP = tuple(float(np.spacing(np.float32(m))) / 2 for m in _MIDPOINTS)
_HALF_DOWN = tuple(float(np.float32(m) - np.nextafter(np.float32(m), np.float32(0))) / 2
                   for m in _MIDPOINTS)


def magnitude_codes(ax: jax.Array, s: jax.Array) -> jax.Array:
  """e2m1 magnitude code (int32, 0..7) of ``float32(ax / s)`` rounded to nearest even,
  saturated at 6, for float32 ``ax >= 0`` (``inf`` gives 6) and positive normal ``s``
  (broadcast against ``ax``) with at most 21 significant bits (an e4m3 scale has 4).

  The code counts the midpoints the float32 quotient lies above, plus the odd ones it
  equals (a tie goes to the even code). ``d = ax - m * s`` is exact where it decides
  (``m * s`` has at most 24 bits; Sterbenz near the midpoint) and of the right sign
  elsewhere; ``h * s`` is exact (``h`` a power of two).
  """
  code = jnp.zeros(ax.shape, jnp.int32)
  for j, (m, up, down) in enumerate(zip(_MIDPOINTS, _HALF_UP, _HALF_DOWN, strict=True)):
    d = ax - m * s
    # Even j: only strictly above moves up. Odd j: above or equal (the even code j + 1).
    past = d > up * s if j % 2 == 0 else d >= -down * s
    code = code + past.astype(jnp.int32)
  return code


def codes(x: jax.Array, s: jax.Array) -> jax.Array:
  """Signed e2m1 codes (int32, 0..15) of float32 ``x / s`` (see :func:`magnitude_codes`);
  the sign bit is ``x``'s, so ``-0.0`` gives code 8."""
  negative = jax.lax.bitcast_convert_type(x, jnp.int32) < 0
  return magnitude_codes(jnp.abs(x), s) | jnp.where(negative, 8, 0)


def values(c: jax.Array) -> jax.Array:
  """float32 values of e2m1 codes (int32, 0..15), exact, from their bits: exponent
  field ``e`` > 0 gives ``(1 + m/2) * 2**(e - 1)``, ``e`` = 0 gives ``m / 2``."""
  e = jax.lax.shift_right_logical(c, 1) & 3
  m = c & 1
  bits = jnp.where(e == 0, m * 0x3F000000,  # 0.5 or 0
                   jax.lax.shift_left(e + 126, 23) | jax.lax.shift_left(m, 22))
  bits = bits | jax.lax.shift_left(c & 8, 28)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)
