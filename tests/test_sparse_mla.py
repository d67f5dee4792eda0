"""Sparse MLA prefill and decode: kernels vs reference, reference vs a dense numpy softmax.

Kernels run in the Pallas interpreter on CPU (tiny shapes, real head sizes
576/512). Cases follow FlashMLA's tests: invalid indices of every kind, rows with
no valid index, short and zero ``topk_length``, sinks at +-inf, NaN in every
unused cache slot, head counts that are not 64/128, odd topk, several query
positions per request in decode, block sizes 2, 61 and 64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from sparse_cases import BAD, bf16, decode_inputs, random_indices, random_sink

from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill, triton

OUT_TOL = 1e-2
LSE_TOL = 1e-5


def _dense_numpy(q, rows, valid, sm_scale, sink):
  """Per query token: softmax over exactly its valid gathered rows (float64)."""
  q = np.asarray(q, np.float64)
  t, h, _ = q.shape
  out = np.zeros((t, h, 512))
  lse = np.full((t, h), np.inf)
  mx = np.full((t, h), -np.inf)
  for i in range(t):
    keys = np.asarray(rows[i], np.float64)[valid[i]]
    if keys.shape[0] == 0:
      continue
    s = q[i] @ keys.T * sm_scale
    mx[i] = s.max(-1)
    lse[i] = mx[i] + np.log(np.exp(s - mx[i][:, None]).sum(-1))
    o = np.exp(s - lse[i][:, None]) @ keys[:, :512]
    if sink is not None:
      o = o / (1.0 + np.exp(np.asarray(sink, np.float64) - lse[i]))[:, None]
    out[i] = o
  return out, mx, lse


def _check_stats(got, ref, lse_tol=LSE_TOL):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  assert np.array_equal(np.isposinf(got), np.isposinf(ref))
  assert np.array_equal(np.isneginf(got), np.isneginf(ref))
  assert not np.isnan(got).any()
  fin = np.isfinite(ref)
  np.testing.assert_allclose(got[fin], ref[fin], rtol=lse_tol, atol=lse_tol)


# ----------------------------------------------------------------------------- prefill


def _prefill_case(seed, s_q, h_q, d_qk, s_kv, topk, *, sink, lengths, empty_rows=()):
  rng = np.random.default_rng(seed)
  q = bf16(rng, (s_q, h_q, d_qk))
  kv = bf16(rng, (s_kv, d_qk))
  idx = random_indices(rng, (s_q, topk), s_kv)
  for r in empty_rows:
    idx[r] = BAD[r % BAD.size]
  topk_length = None
  if lengths:
    topk_length = rng.integers(0, topk + 1, s_q).astype(np.int32)
    topk_length[0] = 0
    topk_length = jax.device_put(topk_length)
  kw = dict(sm_scale=d_qk ** -0.5, attn_sink=random_sink(rng, h_q) if sink else None,
            topk_length=topk_length)
  return q, kv, jax.device_put(idx), kw


@pytest.mark.parametrize("seed,s_q,h_q,d_qk,topk,sink,lengths", [
    (0, 3, 16, 576, 37, True, True),
    (1, 2, 20, 512, 19, False, True),
    (2, 2, 64, 576, 64, True, False),
    (3, 2, 5, 512, 1, True, False),
])
def test_prefill_kernel_matches_reference(interpret, seed, s_q, h_q, d_qk, topk, sink, lengths):
  q, kv, idx, kw = _prefill_case(seed, s_q, h_q, d_qk, 50, topk, sink=sink, lengths=lengths,
                                 empty_rows=(s_q - 1,))
  # NaN in every row no index names: must never reach an output.
  used = np.zeros(kv.shape[0], bool)
  i = np.asarray(idx)
  used[i[(i >= 0) & (i < kv.shape[0])]] = True
  kv = jax.device_put(np.where(used[:, None], np.asarray(kv), np.nan).astype(kv.dtype))
  got = sparse_mla_prefill(q, kv, idx, implementation="triton", interpret=interpret, **kw)
  ref = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
  assert got[0].shape == (s_q, h_q, 512) and got[0].dtype == jnp.bfloat16
  assert rel_err(got[0], ref[0]) < OUT_TOL
  _check_stats(got[1], ref[1])
  _check_stats(got[2], ref[2])
  # The all-invalid last row: out 0, lse +inf, max_logits -inf.
  out, mx, lse = (np.asarray(x, np.float32) for x in got)
  assert np.all(out[-1] == 0) and np.all(np.isposinf(lse[-1])) and np.all(np.isneginf(mx[-1]))


def test_prefill_block_and_3d_layouts(interpret):
  """[s_kv, 1, d] / [s_q, 1, topk] inputs, topk not a multiple of block_k, several blocks.
  The first kernel case's shapes: only the block_k 16 kernel is a new compile."""
  q, kv, idx, kw = _prefill_case(7, 3, 16, 576, 50, 37, sink=True, lengths=True)
  kv3, idx3 = (jax.device_put(np.asarray(x)[:, None]) for x in (kv, idx))
  got = sparse_mla_prefill(q, kv3, idx3, implementation="pallas",
                           interpret=interpret, **kw)
  small = sparse_mla_prefill(q, kv, idx, implementation="triton", interpret=interpret,
                             config=triton.Config(block_k=16), **kw)
  ref = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
  for out in (got, small):
    assert rel_err(out[0], ref[0]) < OUT_TOL
    _check_stats(out[2], ref[2])


@pytest.mark.cpu_only
@pytest.mark.parametrize("d_qk,sink", [(576, True), (512, False)])
def test_prefill_reference_matches_dense_numpy(d_qk, sink):
  q, kv, idx, kw = _prefill_case(11, 4, 6, d_qk, 30, 13, sink=sink, lengths=True,
                                 empty_rows=(1,))
  out, mx, lse = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
  i = np.asarray(idx)
  valid = (i >= 0) & (i < kv.shape[0]) & (np.arange(i.shape[1]) < np.asarray(
      kw["topk_length"])[:, None])
  rows = np.asarray(kv, np.float64)[np.where(valid, i, 0)]
  want_out, want_mx, want_lse = _dense_numpy(q, rows, valid, kw["sm_scale"], kw["attn_sink"])
  np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=2e-2, atol=2e-2)
  _check_stats(mx, want_mx, 1e-5)
  _check_stats(lse, want_lse, 1e-5)
  assert np.all(np.asarray(out[1], np.float32) == 0)
  sink_arr = np.asarray(kw["attn_sink"]) if sink else None
  if sink_arr is not None:  # sink=+inf zeroes the head's output
    assert np.all(np.asarray(out, np.float32)[:, np.isposinf(sink_arr)] == 0)


@pytest.mark.cpu_only
def test_prefill_sink_minus_inf_has_no_effect():
  q, kv, idx, kw = _prefill_case(5, 2, 4, 512, 20, 8, sink=False, lengths=False)
  plain = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
  kw["attn_sink"] = jnp.full((4,), -jnp.inf, jnp.float32)
  sunk = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
  for a, b in zip(plain, sunk, strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.cpu_only
def test_prefill_validation():
  q = jnp.zeros((2, 4, 576), jnp.bfloat16)
  kv = jnp.zeros((8, 576), jnp.bfloat16)
  idx = jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(ValueError, match="d_qk"):
    sparse_mla_prefill(q[..., :192], kv[:, :192], idx, sm_scale=1.0)
  with pytest.raises(TypeError, match="indices"):
    sparse_mla_prefill(q, kv, idx.astype(jnp.float32), sm_scale=1.0)
  with pytest.raises(ValueError, match="d_v"):
    sparse_mla_prefill(q, kv, idx, sm_scale=1.0, d_v=256)
  with pytest.raises(ValueError, match="attn_sink"):
    sparse_mla_prefill(q, kv, idx, sm_scale=1.0, attn_sink=jnp.zeros((3,), jnp.float32))
  with pytest.raises(ValueError, match="topk_length"):
    sparse_mla_prefill(q, kv, idx, sm_scale=1.0, topk_length=jnp.zeros((3,), jnp.int32))


# ----------------------------------------------------------------------------- decode


DECODE_CASES = [
    # dtype, b, s_q, h_q, topk, blocks, block_size, sink, lengths, extra (topk, blocks, bs)
    ("fp8_ds_mla", 2, 2, 16, 37, 4, 61, True, True, None),
    ("fp8_ds_mla", 1, 3, 20, 64, 3, 64, False, False, None),
    ("fp8_model1", 2, 2, 16, 19, 3, 64, True, True, (23, 40, 2)),
    ("fp8_model1", 2, 1, 20, 8, 200, 2, False, False, (9, 2, 64)),
    ("auto", 2, 2, 16, 21, 4, 61, True, False, (7, 30, 2)),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-bs{c[6]}-h{c[3]}")
def test_decode_kernel_matches_reference(interpret, case):
  q, cache, idx, kw, _ = decode_inputs(3, case)
  got = sparse_mla_decode(q, cache, idx, implementation="triton", interpret=interpret, **kw)
  ref = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
  b, s_q, h_q, _ = q.shape
  assert got[0].shape == (b, s_q, h_q, 512) and got[1].shape == (b, h_q, s_q)
  assert rel_err(got[0], ref[0]) < OUT_TOL
  _check_stats(got[1], ref[1])
  if kw["topk_length"] is not None and "extra_kv_cache" not in kw:
    # Batch 0 has topk_length 0 and no extra set: no valid key at all.
    assert np.all(np.asarray(got[0], np.float32)[0] == 0)
    assert np.all(np.isposinf(np.asarray(got[1])[0]))


@pytest.mark.parametrize("case", [DECODE_CASES[0], DECODE_CASES[2]], ids=["ds_mla", "model1"])
def test_decode_u16_byte_view_and_small_blocks(interpret, monkeypatch, case):
  """The uint16 byte view (caches of 2-4 GiB) with block_k 16 gives the reference result."""
  q, cache, idx, kw, _ = decode_inputs(4, case)
  ref = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
  monkeypatch.setattr(triton, "I32_SAFE_BYTES", 0)
  # A config no other test uses: the jitted op compiles anew, with the patched view.
  out, lse = sparse_mla_decode(q, cache, idx, implementation="triton", interpret=interpret,
                               config=triton.Config(block_k=16, num_stages=1), **kw)
  assert rel_err(out, ref[0]) < OUT_TOL
  _check_stats(lse, ref[1])


@pytest.mark.cpu_only  # both sides dequantize on the same device
@pytest.mark.parametrize("case", [DECODE_CASES[0], DECODE_CASES[2]], ids=["ds_mla", "model1"])
def test_decode_reference_matches_dense_numpy(case):
  """One softmax over main + extra rows of the dequantized caches, per query token."""
  q, cache, idx, kw, sets = decode_inputs(5, case, dense=True)
  out, lse = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
  b, s_q, h_q, d = q.shape
  rows, valid = [], []
  for dense, i, tl in sets:
    i = np.asarray(i).reshape(b * s_q, -1)
    n = dense.shape[0] * dense.shape[1]
    ok = (i >= 0) & (i < n)
    if tl is not None:
      ok &= np.arange(i.shape[1]) < np.repeat(np.asarray(tl), s_q)[:, None]
    rows.append(np.asarray(dense, np.float64).reshape(n, d)[np.where(ok, i, 0)])
    valid.append(ok)
  want_out, _, want_lse = _dense_numpy(q.reshape(b * s_q, h_q, d), np.concatenate(rows, 1),
                                       np.concatenate(valid, 1), d ** -0.5, kw["attn_sink"])
  np.testing.assert_allclose(np.asarray(out, np.float64).reshape(want_out.shape), want_out,
                             rtol=2e-2, atol=2e-2)
  _check_stats(lse, want_lse.reshape(b, s_q, h_q).transpose(0, 2, 1), 1e-5)


@pytest.mark.cpu_only
def test_decode_validation():
  q = jnp.zeros((1, 1, 4, 576), jnp.bfloat16)
  cache = jnp.zeros((2, 4, 656), jnp.uint8)
  idx = jnp.zeros((1, 1, 3), jnp.int32)
  with pytest.raises(ValueError, match="kv_cache_dtype"):
    sparse_mla_decode(q, cache, idx, kv_cache_dtype="fp8")
  with pytest.raises(ValueError, match="q.shape"):
    sparse_mla_decode(q[..., :512], cache, idx)
  with pytest.raises(ValueError, match="indices"):
    sparse_mla_decode(q, cache, idx[0])
  with pytest.raises(ValueError, match="extra"):
    sparse_mla_decode(q, cache, idx, extra_kv_cache=cache)
  with pytest.raises(ValueError, match="topk_length"):
    sparse_mla_decode(q, cache, idx, topk_length=jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="kv_cache"):
    sparse_mla_decode(q, cache[..., :600], idx)


@pytest.mark.cpu_only
def test_decode_is_jittable():
  case = DECODE_CASES[2]
  q, cache, idx, kw, _ = decode_inputs(6, case)
  f = jax.jit(lambda q, c, i: sparse_mla_decode(q, c, i, implementation="xla", **kw))
  out, lse = f(q, cache, idx)
  assert out.shape == q.shape[:3] + (512,) and np.isfinite(np.asarray(out, np.float32)).all()


# ----------------------------------------------------------------------------- bad input


def test_nan_query_row_is_nan_on_every_path(interpret):
  """A NaN query has valid keys: its row is NaN (out, lse, max_logits), not an empty row;
  the other rows are untouched."""
  # The first kernel case's shapes (every key used): no new compile.
  q, kv, idx, kw = _prefill_case(21, 3, 16, 576, 50, 37, sink=True, lengths=True)
  kw["topk_length"] = jnp.full((3,), 37, jnp.int32)
  q = np.asarray(q).copy()
  q[1], q[2, 5] = np.nan, np.nan  # a whole token, and one head
  q = jax.device_put(q)
  for impl in ("xla", "triton"):
    out, ml, lse = (np.asarray(a, np.float32) for a in sparse_mla_prefill(
        q, kv, idx, implementation=impl, interpret=interpret and impl == "triton", **kw))
    nan_rows = np.zeros((3, 16), bool)
    nan_rows[1], nan_rows[2, 5] = True, True
    for stat in (ml, lse):
      np.testing.assert_array_equal(np.isnan(stat), nan_rows)
    assert np.isnan(out[nan_rows]).all() and not np.isnan(out[~nan_rows]).any()
  dq, cache, didx, dkw, _ = decode_inputs(22, DECODE_CASES[1])  # b 1, s_q 3
  dq = np.asarray(dq).copy()
  dq[0, 1] = np.nan
  dq = jax.device_put(dq)
  for impl in ("xla", "triton"):
    out, lse = sparse_mla_decode(dq, cache, didx, implementation=impl,
                                 interpret=interpret and impl == "triton", **dkw)
    lse, out = np.asarray(lse), np.asarray(out, np.float32)
    assert np.isnan(lse[0, :, 1]).all() and not np.isnan(np.delete(lse, 1, axis=2)).any()
    assert np.isnan(out[0, 1]).all() and not np.isnan(np.delete(out, 1, axis=1)).any()


@pytest.mark.parametrize("impl", [None, "xla", "triton"])
def test_no_query_token(interpret, impl):
  """Zero tokens (prefill) or zero requests / query positions (decode) give empty
  outputs on every implementation (no kernel runs: its grid would be empty), and the
  prefill's gradients are zeros."""
  interp = interpret and impl == "triton"
  kv = jnp.zeros((10, 576), jnp.bfloat16)
  idx = jnp.zeros((0, 8), jnp.int32)

  def prefill(q, kv):
    return sparse_mla_prefill(q, kv, idx, sm_scale=0.1, implementation=impl, interpret=interp)

  q = jnp.zeros((0, 16, 576), jnp.bfloat16)
  out, ml, lse = prefill(q, kv)
  assert out.shape == (0, 16, 512) and ml.shape == lse.shape == (0, 16)
  dq, dkv = jax.grad(lambda q, kv: prefill(q, kv)[0].astype(jnp.float32).sum(),
                     argnums=(0, 1))(q, kv)
  assert dq.shape == q.shape and dkv.shape == kv.shape and not bool(dkv.astype(bool).any())
  cache = jnp.zeros((2, 64, 576), jnp.bfloat16)
  for b, s_q in ((0, 1), (2, 0)):
    out, lse = sparse_mla_decode(jnp.zeros((b, s_q, 16, 576), jnp.bfloat16), cache,
                                 jnp.zeros((b, s_q, 8), jnp.int32), kv_cache_dtype="auto",
                                 implementation=impl, interpret=interp)
    assert out.shape == (b, s_q, 16, 512) and lse.shape == (b, 16, s_q)


@pytest.mark.cpu_only  # the cast is host code
def test_integer_metadata_of_any_dtype():
  q, kv, idx, kw = _prefill_case(23, 3, 4, 512, 20, 8, sink=False, lengths=True)
  want = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
  kw64 = dict(kw, topk_length=np.asarray(kw["topk_length"]).astype(np.int64))
  got = sparse_mla_prefill(q, kv, np.asarray(idx).astype(np.int64), implementation="xla", **kw64)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  dq, cache, didx, dkw, _ = decode_inputs(24, DECODE_CASES[2])
  want = sparse_mla_decode(dq, cache, didx, implementation="xla", **dkw)
  dkw64 = {k: np.asarray(v).astype(np.int64) if k in ("extra_indices", "topk_length",
                                                      "extra_topk_length") else v
           for k, v in dkw.items()}
  got = sparse_mla_decode(dq, cache, np.asarray(didx).astype(np.int64), implementation="xla",
                          **dkw64)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  with pytest.raises(TypeError, match="topk_length"):
    sparse_mla_prefill(q, kv, idx, sm_scale=0.1, topk_length=[1, 2, 3])


@pytest.mark.cpu_only
def test_static_arguments_named():
  q, kv, idx, _ = _prefill_case(25, 2, 4, 512, 20, 8, sink=False, lengths=False)
  with pytest.raises(TypeError, match="sm_scale"):
    sparse_mla_prefill(q, kv, idx, sm_scale=jnp.float32(0.1))
  with pytest.raises(TypeError, match="sm_scale"):
    sparse_mla_decode(q[None].reshape(1, 2, 4, 512), jnp.zeros((2, 4, 512), jnp.bfloat16),
                      idx.reshape(1, 2, 8), kv_cache_dtype="auto", sm_scale=np.float32(0.1))
  with pytest.raises(TypeError, match="config"):
    sparse_mla_prefill(q, kv, idx, sm_scale=0.1, implementation="triton", interpret=True,
                       config={"block_k": 16})


@pytest.mark.cpu_only
def test_checks_flag_lengths_outside_topk():
  from jax.experimental import checkify
  q, kv, idx, _ = _prefill_case(26, 3, 4, 512, 20, 8, sink=False, lengths=False)
  kw = dict(sm_scale=0.1, implementation="xla", checks=True)
  sparse_mla_prefill(q, kv, idx, topk_length=jnp.asarray([0, 8, 3], jnp.int32), **kw)
  for bad in ([0, -1, 3], [0, 9, 3]):
    with pytest.raises(ValueError, match="topk_length must be in"):
      sparse_mla_prefill(q, kv, idx, topk_length=jnp.asarray(bad, jnp.int32), **kw)
  dq, cache, didx, dkw, _ = decode_inputs(27, DECODE_CASES[2])
  dkw["extra_topk_length"] = dkw["extra_topk_length"].at[0].set(-2)
  with pytest.raises(ValueError, match="extra_topk_length must be in"):
    sparse_mla_decode(dq, cache, didx, implementation="xla", checks=True, **dkw)
  sparse_mla_decode(dq, cache, didx, implementation="xla", **dkw)  # off by default: clamped
  f = checkify.checkify(jax.jit(lambda q, c, i, e: sparse_mla_decode(
      q, c, i, implementation="xla", checks=True, **dict(dkw, extra_topk_length=e))))
  err, _ = f(dq, cache, didx, dkw["extra_topk_length"])
  assert "extra_topk_length" in err.get()
