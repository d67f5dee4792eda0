"""Gradients of ``sparse_mla_prefill``: the custom VJP (the XLA backward of
jax_mla/sparse_mla/backward.py, the Triton backward kernel of triton_backward.py in
interpret mode, and on a GPU the kernel behind the Mosaic GPU forward) against autodiff
of the jax.numpy reference, which is itself checked against finite differences; edge
cases (duplicate and invalid indices, infinite sinks, rows with no key) give finite,
zero gradients.

Tolerance: 1e-2 relative (``q`` and ``kv`` are bf16 and the gradients come back in bf16).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import has_gpu, lowers_for_cuda
from sparse_cases import random_indices

from jax_mla.sparse_mla import (
  backward,
  mosaic_backward,
  reference,
  sparse_mla_prefill,
  triton_backward,
)
from jax_mla.sparse_mla.layout import token_lengths
from jax_mla.testing import rel_err

# The implementations whose backward runs here: the XLA one, the Triton kernel
# (interpret mode on CPU), and on a GPU the default (Mosaic GPU forward on Hopper).
IMPLS = ["xla", "triton"] + (["default"] if has_gpu() else [])

SCALE = 0.05


def _case(seed, d_qk=576, s_q=7, h=3, s_kv=50, topk=20):
  k = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = (jax.random.normal(k[0], (s_q, h, d_qk)) / 2).astype(jnp.bfloat16)
  kv = (jax.random.normal(k[1], (s_kv, d_qk)) / 2).astype(jnp.bfloat16)
  # invalid (< 0, >= s_kv) and duplicate indices; every row keeps a valid first key
  idx = jax.random.randint(k[2], (s_q, topk), -4, s_kv + 4, jnp.int32)
  idx = idx.at[:, 0].set(jnp.arange(s_q) % s_kv).at[1, :5].set(3)
  lens = jax.random.randint(k[3], (s_q,), 1, topk + 1, jnp.int32)
  sink = jax.random.normal(k[4], (h,), jnp.float32)
  w = jax.random.normal(k[5], (s_q, h, 512))
  return q, kv, idx, lens, sink, w


def _loss(out, lse, w):
  return (jnp.sum(out.astype(jnp.float32) * w)
          + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w[..., 0]))


def _api_grads(impl, q, kv, idx, lens, sink, w):
  implementation = None if impl == "default" else impl
  interpret = impl == "triton" and not has_gpu()

  def loss(q, kv, sink):
    out, _, lse = sparse_mla_prefill(q, kv, idx, sm_scale=SCALE, attn_sink=sink,
                                     topk_length=lens, implementation=implementation,
                                     interpret=interpret)
    return _loss(out, lse, w)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, sink)


def _reference_grads(q, kv, idx, lens, sink, w):
  def loss(q, kv, sink):
    out, _, lse = reference.sparse_prefill(q, kv, idx, sink, token_lengths(idx, lens),
                                           sm_scale=SCALE, d_v=512)
    return _loss(out, lse, w)
  return jax.grad(loss, argnums=(0, 1, 2))(q, kv, sink)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed,d_qk", [(0, 576), (1, 512)])
def test_grads_match_autodiff_of_the_reference(impl, seed, d_qk):
  case = _case(seed, d_qk)
  got = _api_grads(impl, *case)
  want = _reference_grads(*case)
  for name, a, b in zip(("dq", "dkv", "dsink"), got, want, strict=True):
    assert a.dtype == b.dtype
    assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))


@pytest.mark.parametrize("impl", IMPLS)
def test_duplicate_indices_add_their_gradients(impl):
  q, kv, idx, lens, sink, w = _case(3, topk=8)
  dup = idx.at[:, 1].set(idx[:, 0]).at[:, 5].set(idx[:, 0])  # key 0 three times a row
  lens = jnp.full_like(lens, 8)
  got = _api_grads(impl, q, kv, dup, lens, sink, w)[1]
  want = _reference_grads(q, kv, dup, lens, sink, w)[1]
  assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("seed", [7, 8])
def test_kernel_head_blocks_and_key_steps(seed, interpret):
  """The kernel alone with several head blocks (their atomics meet in the same rows)
  and several key steps with a partial last one, every row sharing some keys."""
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  s_q, h, s_kv, topk = 5, 40, 12, 37
  q = (jax.random.normal(k[0], (s_q, h, 576)) / 2).astype(jnp.bfloat16)
  kv = (jax.random.normal(k[1], (s_kv, 576)) / 2).astype(jnp.bfloat16)
  idx = jax.random.randint(k[2], (s_q, topk), -3, s_kv + 3, jnp.int32)
  lens = jnp.array([37, 0, 20, 16, 33], jnp.int32)
  out, _, lse = reference.sparse_prefill(q, kv, idx, None, lens, sm_scale=SCALE, d_v=512)
  g = jax.random.normal(k[3], out.shape).astype(jnp.bfloat16)
  c = jax.random.normal(k[4], lse.shape)
  f, g_out = backward.head_terms(out, lse, g, None)
  dq, dkv = triton_backward.sparse_prefill_bwd(
      q, kv, idx, lens, g, lse, f, c - f * g_out, sm_scale=SCALE, d_v=512,
      config=triton_backward.Config(dq_block_h=16, dq_block_k=16, dkv_block_h=16,
                                      dkv_block_k=16), interpret=interpret)
  want_dq, want_dkv, _ = backward.sparse_prefill_bwd(
      q, kv, idx, None, lens, out, lse, g, c, sm_scale=SCALE, d_v=512)
  assert rel_err(dq, want_dq) < 1e-2
  assert rel_err(dkv, want_dkv) < 1e-2
  np.testing.assert_array_equal(np.asarray(dq[1], np.float32), 0)  # length 0


def _kernel_case(seed, s_q, h, d_qk, s_kv, topk, lens, sink=False):
  """Random inputs of the backward kernels with invalid indices of every kind, NaN in the
  unnamed rows of ``kv`` and ``lens`` clipped to ``topk`` (with ``sink``, a finite
  attention sink per head, so the sink factor ``f`` is not 1); returns ``(args, want_dq,
  want_dkv)`` (the XLA backward's)."""
  rng = np.random.default_rng(seed)
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = (jax.random.normal(k[0], (s_q, h, d_qk)) / 2).astype(jnp.bfloat16)
  idx = random_indices(rng, (s_q, topk), s_kv)
  idx[:, 1:4] = idx[:, :1]  # duplicates in a row
  idx[1:, 5] = idx[0, 5]  # and across rows
  rows = rng.standard_normal((s_kv, d_qk)).astype(np.float32) / 2
  named = np.zeros(s_kv, bool)
  named[idx[(idx >= 0) & (idx < s_kv)]] = True
  rows[~named] = np.nan
  kv, idx = jnp.asarray(rows, jnp.bfloat16), jnp.asarray(idx)
  lens = jnp.asarray(lens, jnp.int32)
  attn_sink = jnp.asarray(rng.standard_normal(h), jnp.float32) if sink else None
  out, _, lse = reference.sparse_prefill(q, kv, idx, attn_sink, lens, sm_scale=SCALE, d_v=512)
  g = jax.random.normal(k[1], out.shape).astype(jnp.bfloat16)
  c = jax.random.normal(k[2], lse.shape)
  f, g_out = backward.head_terms(out, lse, g, attn_sink)
  want_dq, want_dkv, _ = backward.sparse_prefill_bwd(
      q, kv, idx, attn_sink, lens, out, lse, g, c, sm_scale=SCALE, d_v=512)
  return (q, kv, idx, lens, g, lse, f, c - f * g_out), want_dq, want_dkv


@pytest.mark.gpu
@pytest.mark.parametrize("seed,h,d_qk,sink", [(11, 64, 576, False), (12, 128, 512, True),
                                              (13, 192, 576, True), (17, 16, 576, False),
                                              (18, 72, 512, True), (16, 40, 576, True)])
def test_mosaic_backward_kernel(seed, h, d_qk, sink):
  """The Mosaic GPU backward kernel: several key blocks (a partial last one), lengths of
  0, short and past topk, invalid and duplicate indices, NaN in unnamed rows, 1-3 head
  blocks, padded heads (16, 40, 72), sinks."""
  s_q, s_kv, topk = 6, 300, 150
  args, want_dq, want_dkv = _kernel_case(seed, s_q, h, d_qk, s_kv, topk,
                                         [150, 0, 64, 65, 1, 400], sink)
  assert mosaic_backward.supported(args[0], 512)
  dq, dkv = mosaic_backward.sparse_prefill_bwd(*args, sm_scale=SCALE)
  assert dq.shape == args[0].shape and dq.dtype == jnp.bfloat16
  assert dkv.shape == args[1].shape and dkv.dtype == jnp.float32
  assert bool(jnp.isfinite(dq.astype(jnp.float32)).all()) and bool(jnp.isfinite(dkv).all())
  assert rel_err(dq, want_dq) < 1e-2 and rel_err(dkv, want_dkv) < 1e-2
  np.testing.assert_array_equal(np.asarray(dq[1], np.float32), 0)  # length 0


def test_mosaic_backward_batches_by_folding_the_batch_into_the_tokens():
  """``jax.vmap`` of the kernel's wrapper runs one call over the batch: indices move by
  ``b * s_kv``, unusable ones (out of range, past the length) stay unusable, an unbatched
  ``kv`` is shared, the per-token output comes back per element. Checked with a scatter
  in the kernel's signature."""
  from jax_mla.sparse_mla.layout import valid_slots

  def scatter(q, kv, indices, lengths, w):
    rows = jnp.where(valid_slots(indices, lengths, kv.shape[0]), indices, kv.shape[0])
    add = jnp.broadcast_to((w + q.sum(-1))[:, None, None], (*indices.shape, kv.shape[1]))
    out = jnp.zeros((kv.shape[0] + 1, kv.shape[1])).at[rows.reshape(-1)].add(
        add.reshape(-1, kv.shape[1]))
    return q * w[:, None], out[:-1] + kv

  rng = np.random.default_rng(0)
  b, s_q, s_kv, topk = 3, 4, 6, 5
  q = jnp.asarray(rng.standard_normal((b, s_q, 2)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((s_kv, 2)), jnp.float32)
  idx = jnp.asarray(rng.integers(-2, s_kv + 3, (b, s_q, topk)), jnp.int32)
  lens = jnp.asarray(rng.integers(0, topk + 1, (b, s_q)), jnp.int32)
  w = jnp.asarray(rng.standard_normal((b, s_q)), jnp.float32)
  got = jax.vmap(mosaic_backward.fold_batch(scatter), in_axes=(0, None, 0, 0, 0))(
      q, kv, idx, lens, w)
  for i, part in enumerate(("per token", "dkv")):
    want = jnp.stack([scatter(q[j], kv, idx[j], lens[j], w[j])[i] for j in range(b)])
    np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=1e-6, atol=1e-6,
                               err_msg=part)


@pytest.mark.parametrize("s_q,h,d_qk", [(3, 128, 576), (2, 64, 512), (3, 16, 576), (2, 40, 576)])
def test_mosaic_backward_kernel_lowers(s_q, h, d_qk):
  """The Mosaic GPU backward kernel lowers for CUDA (shared memory, layouts), also under
  vmap; runs without a GPU."""
  s = jax.ShapeDtypeStruct
  args = (s((s_q, h, d_qk), jnp.bfloat16), s((300, d_qk), jnp.bfloat16),
          s((s_q, 130), jnp.int32), s((s_q,), jnp.int32), s((s_q, h, 512), jnp.bfloat16),
          *[s((s_q, h), jnp.float32)] * 3)
  kernel = functools.partial(mosaic_backward.sparse_prefill_bwd, sm_scale=SCALE)
  lowers_for_cuda(kernel, *args)
  lowers_for_cuda(jax.vmap(kernel), *[s((2, *a.shape), a.dtype) for a in args])


def test_mosaic_backward_supported_shapes():
  """What falls back to the Triton kernels."""
  q = jax.ShapeDtypeStruct
  for shape in ((2, 64, 576), (2, 128, 512), (2, 24, 576), (2, 16, 512)):
    assert mosaic_backward.supported(q(shape, jnp.bfloat16), 512)
  assert not mosaic_backward.supported(q((2, 64, 576), jnp.float16), 512)
  assert not mosaic_backward.supported(q((2, 64, 576), jnp.bfloat16), 256)  # d_v
  assert not mosaic_backward.supported(q((2, 64, 640), jnp.bfloat16), 512)


@pytest.mark.parametrize("impl", IMPLS)
def test_infinite_sinks_and_empty_rows_give_finite_zero_gradients(impl):
  q, kv, idx, lens, _, w = _case(4)
  lens = lens.at[2].set(0)  # token 2 attends to nothing
  idx = idx.at[4].set(-1)  # token 4: every index invalid
  sink = jnp.array([jnp.inf, -jnp.inf, 0.5], jnp.float32)

  def out_loss(q, kv, sink, idx=idx, lens=lens):
    out, _, _ = sparse_mla_prefill(q, kv, idx, sm_scale=SCALE, attn_sink=sink, topk_length=lens,
                                   implementation=None if impl == "default" else impl,
                                   interpret=impl == "triton" and not has_gpu())
    return jnp.sum(out.astype(jnp.float32) * w)

  dq, dkv, dsink = jax.grad(out_loss, argnums=(0, 1, 2))(q, kv, sink)
  for g in (dq, dkv, dsink):
    assert bool(jnp.isfinite(g.astype(jnp.float32)).all())
  np.testing.assert_array_equal(np.asarray(dq[2], np.float32), 0)  # empty rows
  np.testing.assert_array_equal(np.asarray(dq[4], np.float32), 0)
  np.testing.assert_array_equal(np.asarray(dq[:, 0], np.float32), 0)  # +inf sink: out = 0
  np.testing.assert_array_equal(np.asarray(dsink[:2]), 0)  # f is 0 or 1: flat
  # a -inf sink is no sink at all
  no_sink = jax.grad(lambda q: out_loss(q, kv, jnp.array([0.0, -jnp.inf, 0.0])))(q)
  np.testing.assert_allclose(np.asarray(dq[:, 1], np.float32),
                             np.asarray(no_sink[:, 1], np.float32), rtol=1e-6, atol=1e-6)


def test_reference_lse_gradient_matches_finite_differences():
  """The oracle's own autodiff, in float32 through the lse output (finite differences)."""
  k = jax.random.split(jax.random.PRNGKey(5), 3)
  q = jax.random.normal(k[0], (2, 2, 576), jnp.float32)
  kv = jax.random.normal(k[1], (9, 576), jnp.float32)
  idx = jnp.array([[0, 3, 3, 8, -1], [2, 9, 4, 1, 5]], jnp.int32)
  lens = jnp.array([5, 4], jnp.int32)
  wl = jax.random.normal(k[2], (2, 2))

  def loss(q):
    _, _, lse = reference.sparse_prefill(q, kv, idx, None, token_lengths(idx, lens),
                                         sm_scale=SCALE, d_v=512)
    return jnp.sum(lse * wl)

  grad = np.asarray(jax.grad(loss)(q))
  rng = np.random.default_rng(0)
  eps = 1e-2
  for _ in range(6):
    t, h, d = rng.integers(2), rng.integers(2), rng.integers(576)
    e = jnp.zeros_like(q).at[t, h, d].set(eps)
    fd = (float(loss(q + e)) - float(loss(q - e))) / (2 * eps)
    assert abs(fd - grad[t, h, d]) < 1e-3 + 1e-2 * abs(fd), (fd, grad[t, h, d])


@pytest.mark.parametrize("impl", IMPLS)
def test_grads_under_vmap(impl):
  """A batch of independent prefills sharing ``kv``: the VJP batches like the forward
  (on a GPU, the Mosaic GPU backward kernels under vmap)."""
  q, kv, idx, lens, sink, w = _case(6)
  qs = jnp.stack([q, (q.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)])

  def grads(q):
    return _api_grads(impl, q, kv, idx, lens, sink, w)[:2]

  got_dq, got_dkv = jax.vmap(grads)(qs)
  for b in range(2):
    want_dq, want_dkv, _ = _reference_grads(qs[b], kv, idx, lens, sink, w)
    assert rel_err(got_dq[b], want_dq) < 1e-2
    assert rel_err(got_dkv[b], want_dkv) < 1e-2
