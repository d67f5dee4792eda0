"""The online softmax of every Pallas Triton attention kernel, in one place (the Mosaic
GPU loops, which hold their state in warpgroup layouts, share :func:`safe_max`).

A kernel keeps, per query row, the running maximum ``m`` and the running sum ``l``
of its base-2 scores (``s = q.k * sm_scale * log2(e)``, so ``exp`` is ``exp2``) and
a float32 accumulator ``acc`` of ``p @ v``. Per key block::

  m, l = init(rows)                                   # before the loop
  m, l, alpha, p = step(m, l, s, mask)                # s: [rows, keys] base-2 scores
  acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
  inv, lse = finish(m, l, v_scale=..., sink=...)      # after the loop
  out = acc * inv[:, None]

Masked scores are ``-inf``. A row that has seen no key yet keeps ``m = -inf``; its
exponents are taken against 0 instead (no ``(-inf) - (-inf)``), so ``p`` and
``alpha`` are 0 there. A row with no key at the end (``l == 0``: a kept key adds
``exp2(0) = 1`` at the row maximum) gets ``out = 0`` and ``lse = +inf``, the
convention :mod:`jax_mla.merge` reads as "weighs nothing".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mla._common import LN2, LOG2E


def init(rows: int) -> tuple[jax.Array, jax.Array]:
  """``(m, l)`` before the first key block: ``-inf`` and 0, float32 ``[rows]``."""
  return jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)


def safe_max(m: jax.Array) -> jax.Array:
  """The max a row's exponents are taken against: ``m``, or 0 where it is ``-inf`` (a
  row with no key yet), so that no ``(-inf) - (-inf)`` arises."""
  return jnp.where(m == -jnp.inf, 0.0, m)


def step(m: jax.Array, l: jax.Array, s: jax.Array, mask: jax.Array | None = None):
  """One key block: ``(m, l, alpha, p)`` after base-2 scores ``s`` float32 ``[rows, keys]``.

  ``mask`` (bool, broadcastable to ``s``; None keeps every score) selects the keys
  a row sees; the others become ``-inf``. The caller rescales its accumulator by
  ``alpha[:, None]`` and adds ``p @ v``.
  """
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  m_safe = safe_max(m_new)
  alpha = jnp.exp2(m - m_safe)
  p = jnp.exp2(s - m_safe[:, None])
  return m_new, l * alpha + jnp.sum(p, axis=1), alpha, p


def finish(m: jax.Array, l: jax.Array, *, v_scale=1.0, sink: jax.Array | None = None):
  """``(inv, lse)`` after the last block: ``out = acc * inv[:, None]``, natural-log ``lse``.

  ``v_scale`` multiplies the output (a per-tensor fp8 V scale). ``sink`` (natural
  log, ``[rows]``) adds ``exp(sink)`` to the denominator and nothing to the values
  (``+inf`` takes all the weight, ``-inf`` none); the returned ``lse`` is over the
  keys alone. Rows without keys: ``inv = 0``, ``lse = +inf``.
  """
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  lse2 = m + jnp.log2(l_safe)
  inv = v_scale / l_safe
  if sink is not None:
    # out *= exp(lse) / (exp(lse) + exp(sink)); sink=+inf -> 0, -inf -> 1.
    inv = inv / (1.0 + jnp.exp2(sink * LOG2E - lse2))
  return jnp.where(empty, 0.0, inv), jnp.where(empty, jnp.inf, lse2 * LN2)
