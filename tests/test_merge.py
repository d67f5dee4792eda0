"""merge_attn_states against a softmax over the union of both key sets."""

import jax.numpy as jnp
import numpy as np

from jax_mla.merge import merge_attn_states


def _part(scores, values):
  m = scores.max(-1, keepdims=True)
  p = np.exp(scores - m)
  return (p @ values) / p.sum(-1, keepdims=True), (np.log(p.sum(-1)) + m[..., 0])


def test_merge_matches_union_softmax():
  rng = np.random.default_rng(0)
  s_a, s_b = rng.normal(size=(3, 5)), rng.normal(size=(3, 7))
  v_a, v_b = rng.normal(size=(5, 4)), rng.normal(size=(7, 4))
  out_a, lse_a = _part(s_a, v_a)
  out_b, lse_b = _part(s_b, v_b)
  want, want_lse = _part(np.concatenate([s_a, s_b], 1), np.concatenate([v_a, v_b], 0))
  out, lse = merge_attn_states(jnp.asarray(out_a, jnp.float32), jnp.asarray(lse_a, jnp.float32),
                               jnp.asarray(out_b, jnp.float32), jnp.asarray(lse_b, jnp.float32))
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5)


def test_merge_empty_parts():
  out_a = jnp.ones((3, 2), jnp.float32)
  out_b = jnp.full((3, 2), 2.0, jnp.float32)
  lse_a = jnp.array([jnp.inf, 0.5, -jnp.inf], jnp.float32)  # empty, valid, empty (vLLM style)
  lse_b = jnp.array([0.25, jnp.inf, jnp.inf], jnp.float32)
  out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
  np.testing.assert_allclose(out, [[2, 2], [1, 1], [0, 0]])
  np.testing.assert_allclose(lse, [0.25, 0.5, np.inf])
