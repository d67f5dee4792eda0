"""Softmax-state helpers: combining partial attention results by their LSE.

The one home of the split-KV combine in XLA: chunked-context prefill merges two passes
(:func:`merge_attn_states`), and the Triton split-KV decode kernels combine their
splits (:func:`combine_splits`); the Mosaic GPU ones use its kernel twin,
:func:`jax_mla.merge_mosaic.combine`, so that their programs stay Mosaic GPU kernels
only. LSE is natural-log float32; a part with no valid key
has ``lse = +inf`` by the FlashMLA convention or ``-inf`` by the vLLM one, and
contributes nothing either way.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from jax_mla._common import LN2, check_dtype


@jax.jit
def lse2_to_lse(lse_base2: jax.Array) -> jax.Array:
  """Converts a base-2 LSE (as FlashMLA kernels keep it) to natural log, in float32."""
  return lse_base2.astype(jnp.float32) * LN2


def combine_splits(out_parts: jax.Array, lse_parts: jax.Array, out_dtype=None):
  """Combines ``S`` partial results over disjoint key sets (the flash-decoding reduce).

  Args:
    out_parts: ``[S, ..., d]`` partial outputs, each normalised over its own keys (an
      array or a sequence of ``S`` arrays).
    lse_parts: ``[S, ...]`` float32 natural-log LSE of each part; ``+inf`` or ``-inf``
      marks a part without keys.
    out_dtype: dtype of the result (default: that of ``out_parts``).

  Returns:
    ``(out [..., d], lse [...])`` over the union of keys; a row empty in every part
    gets ``out = 0`` and ``lse = +inf``.
  """
  # Rows with no valid key carry lse=+inf (FlashMLA) or -inf (vLLM): both weigh zero.
  # The parts are summed one by one (S is static), so two parts give exactly the
  # pairwise merge below.
  lses = [jnp.where(jnp.isposinf(lse), -jnp.inf, lse) for lse in lse_parts]
  m = functools.reduce(jnp.maximum, lses)
  empty = jnp.isneginf(m)
  m_safe = jnp.where(empty, 0.0, m)
  ws = [jnp.exp(lse - m_safe) for lse in lses]
  total = functools.reduce(operator.add, ws)
  inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
  out = functools.reduce(operator.add, [o.astype(jnp.float32) * (w * inv)[..., None]
                                        for o, w in zip(out_parts, ws, strict=True)])
  lse = jnp.where(empty, jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, total)))
  return out.astype(out_parts[0].dtype if out_dtype is None else out_dtype), lse


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
  return _merge_attn_states(out_a, lse_a, out_b, lse_b)


@jax.jit
def _merge_attn_states(out_a, lse_a, out_b, lse_b):
  return combine_splits((out_a, out_b), (lse_a, lse_b), out_a.dtype)
