"""mla_prefill on the Mosaic GPU kernel vs the jax.numpy reference.

Mosaic GPU has no interpreter: the kernel tests need a Hopper GPU (``@pytest.mark.gpu``);
the input checks run anywhere.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lowers_for_cuda, rel_err

from jax_mla import _mosaic
from jax_mla.dense_prefill import mla_prefill, mosaic, triton_backward
from jax_mla.dense_prefill.reference import mla_prefill_reference


def _case(seed, lens_q, lens_k, *, heads=3, d_qk=192, d_v=128, tail_q=0, tail_k=0):
  """Packed bf16 inputs; NaN in every row past ``cu_seqlens[-1]``."""
  rng = np.random.default_rng(seed)
  tq, tk = sum(lens_q), sum(lens_k)
  q = rng.standard_normal((tq + tail_q, heads, d_qk)).astype(np.float32) / 2
  k = rng.standard_normal((tk + tail_k, heads, d_qk)).astype(np.float32) / 2
  v = rng.standard_normal((tk + tail_k, heads, d_v)).astype(np.float32)
  q[tq:], k[tk:], v[tk:] = np.nan, np.nan, np.nan
  cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)  # noqa: E731
  return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
          cu(lens_q), cu(lens_k))


def _check(args, *, causal, config=None, sm_scale=0.08):
  lens_q = np.diff(np.asarray(args[3]))
  lens_k = np.diff(np.asarray(args[4]))
  kw = dict(max_seqlen_q=max(int(lens_q.max()), 1), max_seqlen_k=max(int(lens_k.max()), 1),
            sm_scale=sm_scale, causal=causal)
  out, lse = mla_prefill(*args, **kw, return_lse=True, implementation="mosaic", config=config)
  ref_out, ref_lse = mla_prefill(*args, **kw, return_lse=True, implementation="xla")
  out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
  assert np.isfinite(out).all() and not np.isnan(lse).any()
  assert rel_err(out, ref_out) < 1e-2
  np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(ref_lse))
  fin = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-2, rtol=1e-2)
  end = int(args[3][-1])  # tokens past the last sequence: out 0, lse +inf
  assert (out[end:] == 0).all() and np.isposinf(lse[:, end:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens_q,lens_k,tail_q,tail_k", [
    # tiles cut mid-sequence, sequences shorter than a 64-row tile, an empty one
    ((300, 1, 0, 77, 128, 64), (300, 1, 5, 77, 128, 64), 37, 3),
    # len_q > len_k (causal: queries with no key), long keys (several stages per tile)
    ((200, 65, 9), (130, 700, 1), 0, 100),
    # one sequence, the padding rows longer than max_seqlen_q (the tail loop)
    ((70,), (70,), 400, 0),
])
def test_kernel_matches_reference(causal, lens_q, lens_k, tail_q, tail_k):
  _check(_case(len(lens_q) + tail_q, lens_q, lens_k, tail_q=tail_q, tail_k=tail_k),
         causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [mosaic.Config(block_k=64, num_stages=4),
                                    mosaic.Config(block_k=64, num_stages=2,
                                                  consumer_registers=240, producer_registers=24)])
def test_configs(config):
  args = _case(5, (257, 63, 640), (257, 100, 640), tail_k=70)
  for causal in (True, False):
    _check(args, causal=causal, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk,d_v", [(128, 128), (256, 128), (128, 64)])
def test_head_sizes(d_qk, d_v):
  args = _case(6, (190, 5, 64), (190, 300, 64), d_qk=d_qk, d_v=d_v, tail_q=3)
  _check(args, causal=True, sm_scale=d_qk**-0.5)


@pytest.mark.gpu
def test_default_on_hopper_and_gradients():
  lens_q, lens_k = (300, 212), (300, 404)  # token counts multiples of 8, long sequences
  q, k, v, cu_q, cu_k = _case(7, lens_q, lens_k, tail_q=8)
  q = q.at[-8:].set(0)  # gradients are compared everywhere
  k = jnp.where(jnp.isnan(k), 0, k)
  v = jnp.where(jnp.isnan(v), 0, v)
  kw = dict(max_seqlen_q=300, max_seqlen_k=404, sm_scale=0.08, causal=True)
  assert _mosaic.on_hopper()

  def run(q, k, impl=None):
    return jax.jit(lambda *a: mla_prefill(*a, **kw, implementation=impl))(q, k, v, cu_q, cu_k)

  same = lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),  # noqa: E731
                                                    np.asarray(b, np.float32))
  same(run(q, k), run(q, k, "mosaic"))
  # A token count that is not a multiple of 8 defaults to Triton (no padded copy).
  same(run(q[:-3], k), run(q[:-3], k, "triton"))

  w = jax.random.normal(jax.random.PRNGKey(0), (q.shape[0], q.shape[1], v.shape[-1]))

  def loss(out, lse):
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

  got = jax.grad(lambda *a: loss(*mla_prefill(*a, cu_q, cu_k, **kw, return_lse=True,
                                              implementation="mosaic")),
                 argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(lambda *a: loss(*mla_prefill_reference(*a, cu_q, cu_k, **kw)),
                  argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
    assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d_qk,lens_q,lens_k,tail_q,tail_k", [
    (192, (300, 1, 0, 77, 128, 64), (300, 1, 5, 77, 128, 64), 37, 3),
    (192, (200, 65, 9), (130, 700, 1), 0, 100),
    (128, (190, 5, 64), (190, 300, 64), 3, 0),
])
def test_backward_kernels_match_the_triton_backward(causal, d_qk, lens_q, lens_k, tail_q,
                                                   tail_k):
  # NaN in q, k, v rows past the sequences; dO there random (its rows' dq is never read).
  q, k, v, cu_q, cu_k = _case(3, lens_q, lens_k, d_qk=d_qk, tail_q=tail_q, tail_k=tail_k)
  kw = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), sm_scale=0.08, causal=causal)
  out, lse = mla_prefill(q, k, v, cu_q, cu_k, **kw, return_lse=True, implementation="triton")
  lse = lse.T
  rng = np.random.default_rng(4)
  d_out = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
  d_lse = jnp.asarray(rng.standard_normal(lse.shape), jnp.float32)
  b = triton_backward.row_term(out, lse, d_out, d_lse)
  got = mosaic.mla_prefill_bwd_mosaic(q, k, v, cu_q, cu_k, d_out, lse, b,
                                      config=mosaic.default_config(d_qk, 128, grad=True), **kw)
  want = triton_backward.mla_prefill_bwd(q, k, v, cu_q, cu_k, out, lse, d_out, d_lse,
                                         config=triton_backward.Config(), **kw)
  for name, a, w, end in zip(("dq", "dk", "dv"), got, want,
                             (int(cu_q[-1]), int(cu_k[-1]), int(cu_k[-1])), strict=True):
    a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(a).all(), name
    assert rel_err(a, w) < 1e-2, (name, rel_err(a, w))
    assert (a[end:] == 0).all(), name  # rows past the sequences


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (128, 128)])
def test_kernels_lower(causal, d_qk, d_v):
  """The forward, dq and dk/dv kernels lower for CUDA at their default configs (shared
  memory, layouts, grid); runs without a GPU."""
  s = jax.ShapeDtypeStruct
  tq, tk, h = 200, 232, 2
  cu = s((3,), jnp.int32)
  q, k, v = s((tq, h, d_qk), jnp.bfloat16), s((tk, h, d_qk), jnp.bfloat16), s((tk, h, d_v),
                                                                              jnp.bfloat16)
  common = dict(sm_scale=0.1, causal=causal)
  lowers_for_cuda(functools.partial(mosaic.mla_prefill_mosaic, max_seqlen_q=128,
                                    config=mosaic.default_config(d_qk, d_v), **common),
                  q, k, v, cu, cu)
  lowers_for_cuda(functools.partial(mosaic.mla_prefill_bwd_mosaic, max_seqlen_q=128,
                                    max_seqlen_k=160, config=mosaic.default_config(
                                        d_qk, d_v, grad=True), **common),
                  q, k, v, cu, cu, s((tq, h, d_v), jnp.bfloat16), s((tq, h), jnp.float32),
                  s((tq, h), jnp.float32))


def test_check_supported_and_config():
  q = jnp.zeros((4, 2, 192), jnp.bfloat16)
  v = jnp.zeros((4, 2, 128), jnp.bfloat16)
  mosaic.check_supported(q, v)
  with pytest.raises(ValueError, match="bf16 or fp16"):
    mosaic.check_supported(q.astype(jnp.float32), v.astype(jnp.float32))
  with pytest.raises(ValueError, match="v head size"):
    mosaic.check_supported(jnp.zeros((4, 2, 96), jnp.bfloat16), jnp.zeros((4, 2, 32), q.dtype))
  with pytest.raises(ValueError, match="d_qk - d_v"):
    mosaic.check_supported(jnp.zeros((4, 2, 160), jnp.bfloat16), v)
  with pytest.raises(ValueError, match="shared memory"):
    mosaic.check_supported(q, v, mosaic.Config(block_k=128, num_stages=3))
  with pytest.raises(ValueError, match="block_k"):
    mosaic.Config(block_k=32)
  # Backward: three 64-row stages at d 192/128, two at 256/128; at 256/256 forward only.
  assert mosaic.default_config(192, 128, grad=True) == mosaic.Config(block_k=64, num_stages=3)
  assert mosaic.default_config(256, 128, grad=True) == mosaic.Config(block_k=64)
  assert mosaic.default_config(256, 256) == mosaic.Config(block_k=64)
  assert mosaic.default_config(256, 256, grad=True) is None
  with pytest.raises(ValueError, match="register split"):
    mosaic.Config(consumer_registers=240, producer_registers=40)
  tokens = lambda n: jnp.zeros((n, 2, 192), jnp.bfloat16)  # noqa: E731
  mosaic.check_default(tokens(512), tokens(8), v, 2)
  with pytest.raises(ValueError, match="multiples of 8"):
    mosaic.check_default(tokens(510), tokens(8), v, 2)
  with pytest.raises(ValueError, match="multiples of 8"):
    mosaic.check_default(tokens(512), tokens(9), v, 2)
  with pytest.raises(ValueError, match="256 query tokens on average"):
    mosaic.check_default(tokens(512), tokens(8), v, 3)
  if not _mosaic.on_hopper():  # the op refuses "mosaic" off a GPU with an actionable message
    with pytest.raises(ValueError, match="needs a GPU|Mosaic"):
      mla_prefill(q, q, v, jnp.array([0, 4]), jnp.array([0, 4]), max_seqlen_q=4, max_seqlen_k=4,
                  sm_scale=0.1, implementation="mosaic")
