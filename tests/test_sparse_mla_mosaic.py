"""Sparse MLA prefill and decode on the Mosaic GPU kernel vs the jax.numpy reference.

Mosaic GPU has no interpreter, so the kernel tests need a Hopper GPU
(``@pytest.mark.gpu``); the input checks run anywhere.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from jax_mla import _mosaic
from jax_mla.cache.formats import quantize_fp8_ds_mla
from jax_mla.sparse_mla import mosaic, sparse_mla_decode, sparse_mla_prefill

BAD = [-1, -2**31, 2**31 - 1, -123456]  # plus s_kv and s_kv + 7, added per case


def _indices(rng, shape, num_slots, bad_frac=0.2):
  """Random slots, a fraction replaced by invalid entries of every kind."""
  idx = rng.integers(0, num_slots, shape)
  bad = np.asarray(BAD + [num_slots, num_slots + 7])
  idx = np.where(rng.random(shape) < bad_frac, bad[rng.integers(0, bad.size, shape)], idx)
  return idx.astype(np.int32)


def _rows(rng, num_slots, d_qk, idx):
  """``[num_slots, d_qk]`` float32 latents with NaN in every row no index names."""
  rows = (rng.standard_normal((num_slots, d_qk)) / 3).astype(np.float32)
  used = np.zeros(num_slots, bool)
  used[idx[(idx >= 0) & (idx < num_slots)]] = True
  rows[~used] = np.nan
  return rows


def _case(rng, s_q, h_q, d_qk, s_kv, topk):
  q = (rng.standard_normal((s_q, h_q, d_qk)) / 3).astype(np.float32)
  idx = _indices(rng, (s_q, topk), s_kv)
  kv = _rows(rng, s_kv, d_qk, idx)
  return jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), jnp.asarray(idx)


def _check(q, kv, idx, **kw):
  kw.setdefault("sm_scale", q.shape[-1] ** -0.5)
  got = sparse_mla_prefill(q, kv, idx, implementation="mosaic", **kw)
  ref = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
  out, ml, lse = (np.asarray(x, np.float32) for x in got)
  r_out, r_ml, r_lse = (np.asarray(x, np.float32) for x in ref)
  assert out.shape == r_out.shape and lse.shape == r_lse.shape and ml.shape == r_ml.shape
  assert np.isfinite(out).all()
  assert rel_err(out, r_out) < 1e-2
  empty = np.isposinf(r_lse)
  np.testing.assert_array_equal(np.isposinf(lse), empty)
  np.testing.assert_array_equal(np.isneginf(ml), np.isneginf(r_ml))
  np.testing.assert_allclose(lse[~empty], r_lse[~empty], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ml[~empty], r_ml[~empty], rtol=1e-4, atol=1e-5)
  assert np.all(out[empty] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [64, 128])
def test_random_with_invalid_indices(d_qk, h_q):
  rng = np.random.default_rng(d_qk + h_q)
  _check(*_case(rng, 9, h_q, d_qk, 700, 256))


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 61, 64, 65, 200])
def test_odd_topk(topk):
  _check(*_case(np.random.default_rng(topk), 5, 64, 576, 333, topk))


@pytest.mark.gpu
def test_topk_length_short_zero_and_over():
  rng = np.random.default_rng(3)
  q, kv, idx = _case(rng, 8, 128, 576, 500, 190)
  lengths = jnp.asarray([0, 1, 63, 64, 65, 190, 500, -3], jnp.int32)
  _check(q, kv, idx, topk_length=lengths)


@pytest.mark.gpu
def test_all_invalid_rows():
  rng = np.random.default_rng(4)
  q, kv, idx = _case(rng, 4, 64, 512, 300, 130)
  idx = idx.at[1].set(-1).at[3].set(300)
  _check(q, kv, idx)


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk", [576, 512])
def test_sinks(d_qk):
  rng = np.random.default_rng(5)
  q, kv, idx = _case(rng, 6, 128, d_qk, 400, 150)
  sink = rng.standard_normal(128).astype(np.float32)
  sink[::3], sink[1::3] = np.inf, -np.inf
  lengths = jnp.asarray([150, 0, 77, 150, 3, 64], jnp.int32)
  _check(q, kv, idx, attn_sink=jnp.asarray(sink), topk_length=lengths)


def _decode_case(rng, b, s_q, h_q, fmt, num_blocks, block_size, topk):
  idx = _indices(rng, (b, s_q, topk), num_blocks * block_size)
  rows = jnp.asarray(_rows(rng, num_blocks * block_size, 576, idx).reshape(
      num_blocks, block_size, 576), jnp.bfloat16)
  cache = quantize_fp8_ds_mla(rows) if fmt == "fp8_ds_mla" else rows
  q = jnp.asarray(rng.standard_normal((b, s_q, h_q, 576)) / 3, jnp.bfloat16)
  return q, cache, jnp.asarray(idx)


def _check_decode(q, cache, idx, fmt, **kw):
  got = sparse_mla_decode(q, cache, idx, kv_cache_dtype=fmt, implementation="mosaic", **kw)
  ref = sparse_mla_decode(q, cache, idx, kv_cache_dtype=fmt, implementation="xla", **kw)
  (out, lse), (r_out, r_lse) = ([np.asarray(x, np.float32) for x in y] for y in (got, ref))
  assert out.shape == r_out.shape and lse.shape == r_lse.shape
  assert np.isfinite(out).all()
  assert rel_err(out, r_out) < 1e-2
  empty = np.isposinf(r_lse)
  np.testing.assert_array_equal(np.isposinf(lse), empty)
  np.testing.assert_allclose(lse[~empty], r_lse[~empty], rtol=1e-4, atol=1e-5)
  assert np.all(out.transpose(0, 2, 1, 3)[empty] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("h_q,block_size", [(64, 64), (128, 61), (128, 2)])
def test_decode_random_with_invalid_indices(fmt, h_q, block_size):
  rng = np.random.default_rng(h_q + block_size)
  _check_decode(*_decode_case(rng, 3, 2, h_q, fmt, 600 // block_size + 1, block_size, 200), fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "auto"])
def test_decode_lengths_and_sinks(fmt):
  rng = np.random.default_rng(11)
  q, cache, idx = _decode_case(rng, 5, 2, 128, fmt, 9, 64, 130)
  sink = rng.standard_normal(128).astype(np.float32)
  sink[::3], sink[1::3] = np.inf, -np.inf
  _check_decode(q, cache, idx, fmt, topk_length=jnp.asarray([0, 1, 64, 130, 999], jnp.int32),
                attn_sink=jnp.asarray(sink))


def test_decode_rejects_what_it_does_not_take():
  q = jnp.zeros((1, 1, 64, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="kv_cache_dtype"):
    mosaic.check_decode_supported(q, "fp8_model1", False)
  with pytest.raises(ValueError, match="extra_kv_cache"):
    mosaic.check_decode_supported(q, "fp8_ds_mla", True)
  with pytest.raises(ValueError, match="multiple of 64"):
    mosaic.check_decode_supported(q[:, :, :20], "fp8_ds_mla", False)


@pytest.mark.gpu
def test_default_picks_mosaic_on_hopper_for_supported_heads():
  q = jnp.zeros((2, 128, 576), jnp.bfloat16)
  assert mosaic.prefill_default_for(q) == _mosaic.on_hopper()
  assert not mosaic.prefill_default_for(jnp.zeros((2, 20, 576), jnp.bfloat16))


def test_rejects_head_counts_it_does_not_take():
  q = jnp.zeros((2, 20, 576), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 64"):
    sparse_mla_prefill(q, jnp.zeros((8, 576), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32),
                       sm_scale=0.1, implementation="mosaic")


def test_rejects_interpret():
  q = jnp.zeros((2, 64, 576), jnp.bfloat16)
  with pytest.raises(ValueError, match="no interpreter"):
    sparse_mla_prefill(q, jnp.zeros((8, 576), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32),
                       sm_scale=0.1, implementation="mosaic", interpret=True)
