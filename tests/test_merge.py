"""merge_attn_states against a softmax over the union of both key sets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.merge import combine_splits, merge_attn_states

# jax.numpy only; on a GPU every split kernel's test runs these merges compiled.
pytestmark = pytest.mark.cpu_only


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


def test_combine_splits_empty_rows():
  # -inf (vLLM) and +inf (FlashMLA) both mark a split without keys.
  out = jnp.ones((3, 2, 8), jnp.float32)
  lse = jnp.array([[-jnp.inf, 0.0], [jnp.inf, 0.0], [-jnp.inf, jnp.inf]], jnp.float32)
  o, l = combine_splits(out, lse, jnp.bfloat16)
  assert o.dtype == jnp.bfloat16
  assert np.all(np.asarray(o[0]) == 0) and np.isposinf(float(l[0]))
  np.testing.assert_allclose(np.asarray(o[1], np.float32), 1.0)
  np.testing.assert_allclose(float(l[1]), np.log(2.0), rtol=1e-6)


def test_merge_is_a_two_way_combine():
  rng = np.random.default_rng(1)
  outs = jnp.asarray(rng.normal(size=(2, 5, 3)), jnp.float32)
  lses = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
  got = merge_attn_states(outs[0], lses[0], outs[1], lses[1])
  want = jax.jit(combine_splits)(outs, lses)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
