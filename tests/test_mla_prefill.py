"""mla_prefill: Triton kernel vs jax.numpy reference vs a hand-written numpy softmax."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from jax_mla.dense_prefill import mla_prefill, mla_prefill_token_major, triton


def _cu(lens):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(seed, len_q, len_k, *, heads=2, d_qk=192, d_v=128, tail_q=0, tail_k=0,
            dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  tq, tk = sum(len_q) + tail_q, sum(len_k) + tail_k
  q = rng.standard_normal((tq, heads, d_qk)).astype(np.float32)
  k = rng.standard_normal((tk, heads, d_qk)).astype(np.float32)
  v = rng.standard_normal((tk, heads, d_v)).astype(np.float32)
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(_cu(len_q)), jnp.asarray(_cu(len_k)))


def _numpy_prefill(q, k, v, len_q, len_k, sm_scale, causal):
  """Per query: softmax over exactly the keys it may see (float64 loops)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  tq, heads, _ = q.shape
  out = np.zeros((tq, heads, v.shape[-1]))
  lse = np.full((heads, tq), np.inf)
  cq, ck = _cu(len_q), _cu(len_k)
  for b, (lq, lk) in enumerate(zip(len_q, len_k, strict=True)):
    for i in range(lq):
      n_keys = min(lk, i + lk - lq + 1) if causal else lk
      if n_keys <= 0:
        continue
      keys = slice(ck[b], ck[b] + n_keys)
      for h in range(heads):
        s = k[keys, h] @ q[cq[b] + i, h] * sm_scale
        p = np.exp(s - s.max())
        out[cq[b] + i, h] = p @ v[keys, h] / p.sum()
        lse[h, cq[b] + i] = s.max() + math.log(p.sum())
  return out, lse


# One shape for the kernel tests: 4 sequences (zero-length ones pad), 64 query and 104
# key rows (rows past cu_seqlens[-1] pad), max_seqlen 40 (at least the longest). Cases
# differ in values, so each kernel (and the reference) compiles once per `causal`.
NUM_SEQS, ROWS_Q, ROWS_K, MAX_LEN = 4, 64, 104, 40
TILES = triton.Config(block_q=16, block_k=16)  # several q / k blocks per sequence


def _padded(seed, len_q, len_k):
  """``_inputs`` of the shared shape."""
  pad = [0] * (NUM_SEQS - len(len_q))
  len_q, len_k = list(len_q) + pad, list(len_k) + pad
  assert max(len_q + len_k) <= MAX_LEN
  return _inputs(seed, len_q, len_k, tail_q=ROWS_Q - sum(len_q), tail_k=ROWS_K - sum(len_k))


def _run(q, k, v, cu_q, cu_k, causal, max_seqlen=MAX_LEN, **kw):
  return mla_prefill(q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                     sm_scale=0.11, causal=causal, return_lse=True, **kw)


def _check_lse(lse, ref, tol):
  lse, ref = np.asarray(lse), np.asarray(ref)
  np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(ref))
  assert not np.isnan(lse).any()
  fin = np.isfinite(ref)
  np.testing.assert_allclose(lse[fin], ref[fin], atol=tol, rtol=tol)


@pytest.mark.cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_numpy(causal):
  # Zero-length, length-1, len_q < len_k, len_q > len_k (causal rows without keys).
  len_q, len_k = [3, 0, 1, 6, 4], [5, 2, 1, 4, 4]
  q, k, v, cu_q, cu_k = _inputs(0, len_q, len_k, tail_q=2)
  out, lse = _run(q, k, v, cu_q, cu_k, causal, implementation="xla")
  ref_out, ref_lse = _numpy_prefill(q, k, v, len_q, len_k, 0.11, causal)
  assert rel_err(out, ref_out) < 1e-5
  _check_lse(lse, ref_lse, 1e-5)
  if causal:  # the first two rows of the 6-query sequence see no key
    row = int(cu_q[3])
    assert np.all(np.asarray(out)[row:row + 2] == 0) and np.all(np.isposinf(lse[:, row:row + 2]))


CASES = [
    # (seed, len_q, len_k, causal): odd lengths, empty and single-token sequences, several
    # q / k blocks, len_q < len_k and > len_k, rows past cu_seqlens[-1] (or none: seed 2).
    (1, [37, 0, 1, 21], [37, 0, 1, 21], True),
    (1, [37, 0, 1, 21], [37, 0, 1, 21], False),
    (2, [5, 19, 1, 39], [40, 19, 33, 12], True),
    (3, [35, 2, 0, 9], [17, 9, 4, 30], True),
    (3, [35, 2, 0, 9], [17, 9, 4, 30], False),
]


@pytest.mark.parametrize("seed,len_q,len_k,causal", CASES)
def test_kernel_matches_reference(interpret, seed, len_q, len_k, causal):
  # 16 x 16 tiles: several q blocks per sequence, unmasked key blocks, diagonal blocks.
  q, k, v, cu_q, cu_k = _padded(seed, len_q, len_k)
  out, lse = _run(q, k, v, cu_q, cu_k, causal, implementation="triton", config=TILES,
                  interpret=interpret)
  ref_out, ref_lse = _run(q, k, v, cu_q, cu_k, causal, implementation="xla")
  assert out.shape == ref_out.shape and lse.shape == (q.shape[1], q.shape[0])
  tol = 1e-5 if interpret else 1e-4  # GPU: another summation order
  assert rel_err(out, ref_out) < tol
  _check_lse(lse, ref_lse, tol)
  tail = np.asarray(out)[int(cu_q[-1]):]
  assert np.all(tail == 0) and np.all(np.isposinf(np.asarray(lse)[:, int(cu_q[-1]):]))


def test_kernel_bf16_small_blocks(interpret):
  # bf16 inputs, head sizes 128 (no rest part) and v 64, several key blocks per query block.
  len_q, len_k = [23, 9], [50, 9]
  q, k, v, cu_q, cu_k = _inputs(4, len_q, len_k, d_qk=128, d_v=64, heads=3, dtype=jnp.bfloat16)
  out, lse = _run(q, k, v, cu_q, cu_k, True, max_seqlen=50, implementation="triton",
                  interpret=interpret)
  ref_out, ref_lse = _numpy_prefill(q, k, v, len_q, len_k, 0.11, True)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, ref_out) < 1e-2
  _check_lse(lse, ref_lse, 1e-2)


@pytest.mark.cpu_only
def test_without_lse_and_default_scale():
  len_q = [4, 3]
  q, k, v, cu_q, _ = _inputs(5, len_q, len_q)
  out = mla_prefill(q, k, v, cu_q, cu_q, max_seqlen_q=4, max_seqlen_k=4, sm_scale=None,
                    implementation="xla")
  ref, _ = _numpy_prefill(q, k, v, len_q, len_q, 192**-0.5, True)
  assert rel_err(out, ref) < 1e-5


def test_nan_outside_sequences_does_not_leak(interpret):
  # Keys past cu_seqlens_k[-1] (and q rows past cu_seqlens_q[-1]) hold NaN.
  q, k, v, cu_q, cu_k = _padded(6, [7, 3], [12, 3])
  tq, tk = int(cu_q[-1]), int(cu_k[-1])
  q, k, v = q.at[tq:].set(jnp.nan), k.at[tk:].set(jnp.nan), v.at[tk:].set(jnp.nan)
  for impl in ("pallas", "xla"):  # "pallas": the old name of "triton"
    out, lse = _run(q, k, v, cu_q, cu_k, False, implementation=impl, interpret=interpret,
                    config=TILES if impl == "pallas" else None)
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()


def test_nan_query_row_gives_nan_in_kernel_and_reference(interpret):
  # A NaN score is not "no key": kernel and reference both return NaN for that row only.
  q, k, v, cu_q, cu_k = _padded(10, [4, 3], [6, 3])
  q = q.at[1, 0].set(jnp.nan)
  for impl in ("triton", "xla"):
    out, lse = _run(q, k, v, cu_q, cu_k, True, implementation=impl, interpret=interpret,
                    config=TILES if impl == "triton" else None)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isnan(out[1, 0]).all() and np.isnan(lse[0, 1]), impl
    nan_rows = np.isnan(out).any(-1)
    nan_rows[1, 0] = False
    assert not nan_rows.any() and np.isnan(lse).sum() == 1, impl


@pytest.mark.cpu_only
def test_validation_errors():
  q, k, v, cu, _ = _inputs(7, [4], [4])
  kw = dict(max_seqlen_q=4, max_seqlen_k=4, sm_scale=0.1)
  with pytest.raises(ValueError, match="q must have rank 3"):
    mla_prefill(q[0], k, v, cu, cu, **kw)
  with pytest.raises(TypeError, match="k must have dtype float32"):
    mla_prefill(q, k.astype(jnp.bfloat16), v, cu, cu, **kw)
  with pytest.raises(ValueError, match="k must have shape"):
    mla_prefill(q, k[:, :1], v, cu, cu, **kw)
  with pytest.raises(TypeError, match="cu_seqlens_q must have an integer dtype"):
    mla_prefill(q, k, v, cu.astype(jnp.float32), cu, **kw)
  with pytest.raises(ValueError, match="cu_seqlens_k must have shape"):
    mla_prefill(q, k, v, cu, jnp.zeros((3,), jnp.int32), **kw)
  with pytest.raises(ValueError, match="head size .* got 100"):
    mla_prefill(q[..., :100], k[..., :100], v, cu, cu, implementation="triton", interpret=True,
                **kw)
  with pytest.raises(ValueError, match="max_seqlen_q"):
    mla_prefill(q, k, v, cu, cu, max_seqlen_q=None, max_seqlen_k=4, sm_scale=0.1)
  with pytest.raises(TypeError, match="sm_scale"):
    mla_prefill(q, k, v, cu, cu, max_seqlen_q=4, max_seqlen_k=4, sm_scale=jnp.float32(0.1))
  with pytest.raises(TypeError, match="config"):
    mla_prefill(q, k, v, cu, cu, **kw, config=object(), implementation="triton", interpret=True)


@pytest.mark.cpu_only  # host code: the cast and the LSE transpose
def test_int64_metadata_and_token_major_lse(interpret):
  len_q, len_k = [5, 3], [6, 3]
  q, k, v, cu_q, cu_k = _inputs(9, len_q, len_k)
  cu_q64, cu_k64 = _cu(len_q).astype(np.int64), _cu(len_k).astype(np.int64)
  for impl in ("triton", "xla"):
    want_out, want_lse = _run(q, k, v, cu_q, cu_k, True, implementation=impl,
                              interpret=interpret)
    out, lse = mla_prefill_token_major(q, k, v, cu_q64, cu_k64, max_seqlen_q=MAX_LEN,
                                       max_seqlen_k=MAX_LEN, sm_scale=0.11,
                                       implementation=impl, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse).T)


@pytest.mark.gpu
def test_kernel_matches_reference_gpu():
  len_q, len_k = [700, 1, 0, 333, 1024], [900, 1, 5, 333, 1024]
  q, k, v, cu_q, cu_k = _inputs(8, len_q, len_k, heads=8, dtype=jnp.bfloat16, tail_q=5)
  for causal in (True, False):
    out, lse = _run(q, k, v, cu_q, cu_k, causal, max_seqlen=1024, implementation="triton")
    ref_out, ref_lse = _run(q, k, v, cu_q, cu_k, causal, max_seqlen=1024, implementation="xla")
    assert rel_err(out, ref_out) < 1e-2
    _check_lse(lse, ref_lse, 1e-2)
