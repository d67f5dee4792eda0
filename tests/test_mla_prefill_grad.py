"""Gradients of ``mla_prefill``: the custom VJP (jax_mla/dense_prefill/backward.py)
against autodiff of the jax.numpy reference; queries with no visible key get zero
gradients. Tolerance: 1e-2 relative (bf16 inputs, gradients in bf16)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.dense_prefill import backward, mla_prefill, triton_backward
from jax_mla.dense_prefill.reference import mla_prefill_reference
from jax_mla.testing import rel_err

H, D_QK, D_V = 2, 192, 128


def _case(seed, lens_q, lens_k):
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  tq, tk = sum(lens_q), sum(lens_k)
  q = (jax.random.normal(k[0], (tq + 1, H, D_QK)) / 2).astype(jnp.bfloat16)  # +1: past the end
  kk = (jax.random.normal(k[1], (tk, H, D_QK)) / 2).astype(jnp.bfloat16)
  v = jax.random.normal(k[2], (tk, H, D_V)).astype(jnp.bfloat16)
  cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)  # noqa: E731
  w = jax.random.normal(k[3], (tq + 1, H, D_V))
  wl = jax.random.normal(k[4], (tq + 1, H))
  return q, kk, v, cu(lens_q), cu(lens_k), w, wl


def _loss(out, lse, w, wl):
  return (jnp.sum(out.astype(jnp.float32) * w)
          + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl))


@pytest.mark.parametrize("causal,lens_q,lens_k", [
    (True, (5, 1, 9), (5, 1, 9)),      # new tokens
    (False, (4, 3), (7, 10)),          # a context chunk
    (True, (6, 2), (3, 8)),            # len_q > len_k: queries with no key
])
@pytest.mark.parametrize("impl", ["xla", "triton", "xla, 4 queries a step"])
def test_grads_match_autodiff_of_the_reference(impl, causal, lens_q, lens_k, interpret,
                                               monkeypatch):
  if impl == "xla, 4 queries a step":  # several query blocks in the backward, one padded
    impl = "xla"
    monkeypatch.setattr(backward, "_QUERIES_PER_STEP", 4)
    jax.clear_caches()  # the block size is read when the backward is traced
  q, k, v, cu_q, cu_k, w, wl = _case(len(lens_q) + causal, lens_q, lens_k)
  kw = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), sm_scale=0.1, causal=causal)

  def api_loss(q, k, v):
    out, lse = mla_prefill(q, k, v, cu_q, cu_k, return_lse=True, implementation=impl,
                           interpret=interpret, **kw)
    return _loss(out, lse.T, w, wl)

  def ref_loss(q, k, v):
    return _loss(*mla_prefill_reference(q, k, v, cu_q, cu_k, **kw), w, wl)

  got = jax.jit(jax.grad(api_loss, argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
    assert bool(jnp.isfinite(a.astype(jnp.float32)).all()), name
    b = jnp.where(jnp.isfinite(b.astype(jnp.float32)), b, 0)  # autodiff may NaN on empty rows
    assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))
  np.testing.assert_array_equal(np.asarray(got[0][-1], np.float32), 0)  # past the last query


@pytest.mark.parametrize("causal", [True, False])
def test_kernel_blocks_against_the_xla_backward(causal, interpret):
  """The Triton backward with 16-row blocks (several query and key blocks, the causal
  diagonal inside and across blocks, an empty sequence, len_q > len_k, a tail past
  cu_seqlens_q[-1]) against the XLA backward; NaN in the tail rows never leaks."""
  lens_q, lens_k = (37, 0, 9, 50), (37, 5, 4, 70)
  q, k, v, cu_q, cu_k, w, wl = _case(7 + causal, lens_q, lens_k)
  q = q.at[-1].set(jnp.nan)  # the row past the end
  kw = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), sm_scale=0.1, causal=causal)
  out, lse = mla_prefill_reference(q, k, v, cu_q, cu_k, **kw)
  out, lse = out.at[-1].set(0), lse.at[-1].set(jnp.inf)
  d_out, d_lse = w.astype(jnp.bfloat16), wl
  config = triton_backward.Config(16, 16, 16, 16, num_warps=4, num_stages=1)
  got = jax.jit(functools.partial(triton_backward.mla_prefill_bwd, config=config,
                                  interpret=interpret, **kw))(
      q, k, v, cu_q, cu_k, out, lse, d_out, d_lse)
  want = backward.mla_prefill_bwd(q, k, v, cu_q, cu_k, out, lse, d_out, d_lse, **kw)
  for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
    assert bool(jnp.isfinite(a.astype(jnp.float32)).all()), name
    assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))
  np.testing.assert_array_equal(np.asarray(got[0][-1], np.float32), 0)
