"""Softmax-state helpers: merging partial attention results by their LSE.

Used for chunked-context prefill (two passes merged) and split-KV decode
(flash-decoding combine). LSE is natural-log float32; a part with no valid key
has ``lse = +inf`` by the FlashMLA convention or ``-inf`` by the vLLM one, and
contributes nothing either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mla._common import LN2, check_dtype


@jax.jit
def lse2_to_lse(lse_base2: jax.Array) -> jax.Array:
  """Converts a base-2 LSE (as FlashMLA kernels keep it) to natural log, in float32."""
  return lse_base2.astype(jnp.float32) * LN2


def _as_merge_lse(lse: jax.Array) -> jax.Array:
  # Rows with no valid key carry lse=+inf (FlashMLA) or -inf (vLLM): both weigh zero.
  return jnp.where(jnp.isposinf(lse), -jnp.inf, lse)


@jax.jit
def merge_attn_states(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array,
                      lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Merges two partial attention results over disjoint key sets.

  Args:
    out_a, out_b: ``[..., d]`` partial outputs, each normalised over its own keys.
    lse_a, lse_b: ``[...]`` float32 natural-log LSE of each part (``out.shape[:-1]``).

  Returns:
    ``(out, lse)``: the output over the union of keys (dtype of ``out_a``) and its
    LSE. A row empty in both parts gets ``out = 0`` and ``lse = +inf``.
  """
  if out_a.shape != out_b.shape:
    raise ValueError(
        f"out_a and out_b must have the same shape; got {out_a.shape} and {out_b.shape}")
  if lse_a.shape != out_a.shape[:-1] or lse_b.shape != out_a.shape[:-1]:
    raise ValueError(
        f"lse_a and lse_b must have shape {out_a.shape[:-1]} (out without its last axis); "
        f"got {lse_a.shape} and {lse_b.shape}")
  check_dtype("lse_a", lse_a, jnp.float32)
  check_dtype("lse_b", lse_b, jnp.float32)
  la, lb = _as_merge_lse(lse_a), _as_merge_lse(lse_b)
  m = jnp.maximum(la, lb)
  empty = jnp.isneginf(m)
  m_safe = jnp.where(empty, 0.0, m)
  wa = jnp.exp(la - m_safe)
  wb = jnp.exp(lb - m_safe)
  total = wa + wb
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
  out = (out_a.astype(jnp.float32) * (wa * inv)[..., None]
         + out_b.astype(jnp.float32) * (wb * inv)[..., None])
  lse = jnp.where(empty, jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
  return out.astype(out_a.dtype), lse
