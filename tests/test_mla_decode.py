"""Dense MLA decode: kernel (interpret mode on CPU) vs reference vs a numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from jax_mla.dense_decode import mla_decode, mla_decode_paged, mla_ragged_paged_attention
from jax_mla.dense_decode import pallas as kern

D = 576
DV = 512


def _np_attention(q, keys, scale, causal):
  """Dense softmax of ``q [Lq, H, 576]`` over exactly ``keys [Lk, 576]`` (float64)."""
  q = np.asarray(q, np.float64)
  keys = np.asarray(keys, np.float64)
  lq, h, _ = q.shape
  lk = keys.shape[0]
  out = np.zeros((lq, h, DV))
  lse = np.full((lq, h), np.inf)
  for i in range(lq):
    n = max(0, lk - (lq - 1 - i)) if causal else lk
    if n == 0:
      continue
    s = q[i] @ keys[:n].T * scale  # [H, n]
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lse[i] = (m[:, 0] + np.log(p.sum(-1)))
    out[i] = (p / p.sum(-1, keepdims=True)) @ keys[:n, :DV]
  return out, lse


def _paged_case(rng, b, s_q, h_q, block_size, seqlens, extra_blocks=2):
  """FlashMLA-style data: shuffled block table, NaN past each sequence, junk ids."""
  max_blocks = max(1, max(-(-s // block_size) for s in seqlens)) + 1
  num_blocks = b * max_blocks + extra_blocks
  perm = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
  cache = (rng.standard_normal((num_blocks, block_size, D)) / 4).astype(np.float32)
  for i, s in enumerate(seqlens):
    used = -(-s // block_size)
    for j in range(used, max_blocks):
      cache[perm[i, j]] = np.nan
    if s % block_size:
      cache[perm[i, used - 1], s % block_size:] = np.nan
    perm[i, used:] = [2147480000, -1][i % 2]
  q = (rng.standard_normal((b, s_q, h_q, D)) / 4).astype(np.float32)
  return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16), jnp.asarray(perm),
          jnp.asarray(np.asarray(seqlens, np.int32)))


def _gather_keys(cache, pages, seqlen):
  cache = np.asarray(cache.astype(jnp.float32))
  n = -(-seqlen // cache.shape[1])
  return np.concatenate([cache[p] for p in pages[:n]], 0)[:seqlen] if n else np.zeros((0, D))


@pytest.mark.parametrize("causal", [False, True])
def test_paged_reference_matches_numpy(causal):
  rng = np.random.default_rng(0)
  seqlens = [19, 0, 2]
  q, cache, bt, sl = _paged_case(rng, 3, 3, 4, 8, seqlens)
  out, lse = mla_decode_paged(q, cache, bt, sl, causal=causal, implementation="xla")
  assert out.shape == (3, 3, 4, DV) and lse.shape == (3, 4, 3)
  for i, s in enumerate(seqlens):
    keys = _gather_keys(cache, np.asarray(bt[i]), s)
    want_o, want_l = _np_attention(np.asarray(q[i].astype(jnp.float32)), keys, D**-0.5, causal)
    np.testing.assert_allclose(np.asarray(out[i], np.float32), want_o, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse[i]).T, want_l, rtol=1e-5, atol=1e-5)
  # seqlen 0, and seqlen 2 with 3 causal queries: the first query sees no key.
  assert np.all(np.asarray(out[1]) == 0) and np.all(np.isposinf(np.asarray(lse[1])))
  if causal:
    assert np.all(np.asarray(out[2, 0]) == 0) and np.all(np.isposinf(np.asarray(lse[2, :, 0])))


@pytest.mark.parametrize("b,s_q,h_q,block_size,seqlens,causal", [
    (3, 1, 16, 16, [37, 1, 0], False),
    (2, 4, 20, 64, [70, 3], True),
    (1, 3, 8, 1, [13], True),
    (2, 1, 128, 16, [5, 0], False),
])
def test_paged_kernel_matches_reference(interpret, b, s_q, h_q, block_size, seqlens, causal):
  rng = np.random.default_rng(b * 100 + h_q + s_q)
  q, cache, bt, sl = _paged_case(rng, b, s_q, h_q, block_size, seqlens)
  out, lse = mla_decode_paged(q, cache, bt, sl, causal=causal, implementation="pallas",
                              interpret=interpret)
  ro, rl = mla_decode_paged(q, cache, bt, sl, causal=causal, implementation="xla")
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert rel_err(out, ro) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), rtol=1e-5, atol=1e-5)


def _aiter_case(rng, q_lens, kv_lens, h_q, page_size, *, kv_dtype=jnp.bfloat16):
  """AITER-style data: ragged qo_indptr, page-level kv_indptr, random page ids."""
  num_req = len(q_lens)
  n_pages = [-(-s // page_size) for s in kv_lens]
  total_pages = sum(n_pages) + 3
  pool = rng.permutation(total_pages).astype(np.int32)
  kv_indices = pool[: sum(n_pages)]
  kv_indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
  last = np.array([(s - 1) % page_size + 1 if s else 0 for s in kv_lens], np.int32)
  qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  cache = (rng.standard_normal((total_pages, page_size, D)) / 4).astype(np.float32)
  used = np.zeros((total_pages, page_size), bool)
  for r in range(num_req):
    for j, p in enumerate(kv_indices[kv_indptr[r]:kv_indptr[r + 1]]):
      used[p, : min(page_size, kv_lens[r] - j * page_size)] = True
  cache[~used] = np.nan
  q = (rng.standard_normal((int(qo_indptr[-1]), h_q, D)) / 4).astype(np.float32)
  return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16).astype(kv_dtype),
          jnp.asarray(qo_indptr), jnp.asarray(kv_indptr), jnp.asarray(kv_indices),
          jnp.asarray(last))


def test_mla_decode_reference_matches_numpy():
  rng = np.random.default_rng(1)
  q_lens, kv_lens = [1, 3, 2], [9, 4, 1]
  q, cache, qo, kvp, kvi, last = _aiter_case(rng, q_lens, kv_lens, 4, 4)
  out, lse = mla_decode(q, cache, qo, kvp, kvi, last, max_seqlen_q=3, implementation="xla")
  for r in range(3):
    pages = np.asarray(kvi)[int(kvp[r]):int(kvp[r + 1])]
    keys = _gather_keys(cache, pages, kv_lens[r])
    rows = slice(int(qo[r]), int(qo[r + 1]))
    want_o, want_l = _np_attention(np.asarray(q[rows].astype(jnp.float32)), keys, D**-0.5, True)
    np.testing.assert_allclose(np.asarray(out[rows], np.float32), want_o, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse[rows]), want_l, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lens,kv_lens,h_q,page_size,max_seqlen_q,splits", [
    ([1, 1, 1], [40, 17, 0], 16, 1, 1, 3),
    ([2, 1, 4, 3], [35, 2, 64, 3], 16, 16, 4, 2),
    ([8, 5], [20, 9], 8, 16, 8, None),
])
def test_mla_decode_kernel_matches_reference(interpret, q_lens, kv_lens, h_q, page_size,
                                             max_seqlen_q, splits):
  rng = np.random.default_rng(sum(kv_lens) + h_q)
  args = _aiter_case(rng, q_lens, kv_lens, h_q, page_size)
  out, lse = mla_decode(*args, max_seqlen_q=max_seqlen_q, num_kv_splits=splits,
                        implementation="pallas", interpret=interpret)
  ro, rl = mla_decode(*args, max_seqlen_q=max_seqlen_q, implementation="xla")
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert rel_err(out, ro) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), rtol=1e-5, atol=1e-5)


def test_mla_decode_non_causal_and_uncovered_tokens(interpret):
  rng = np.random.default_rng(5)
  q, cache, qo, kvp, kvi, last = _aiter_case(rng, [3, 2], [10, 6], 16, 4)
  # Two extra tokens after the last request: not computed, returned as 0 / +inf.
  q = jnp.concatenate([q, jnp.ones((2,) + q.shape[1:], q.dtype)])
  for impl in ("pallas", "xla"):
    out, lse = mla_decode(q, cache, qo, kvp, kvi, last, max_seqlen_q=3, causal=False,
                          num_kv_splits=2, implementation=impl, interpret=interpret)
    assert np.all(np.asarray(out[5:]) == 0) and np.all(np.isposinf(np.asarray(lse[5:])))
    if impl == "pallas":
      got = (out, lse)
  assert rel_err(got[0], out) < 1e-2
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(lse), rtol=1e-5, atol=1e-5)


def test_mla_decode_fp8(interpret):
  """fp8 queries and fp8 cache with per-tensor scales (bf16 q + fp8 cache runs on GPU)."""
  rng = np.random.default_rng(7)
  q, cache, qo, kvp, kvi, last = _aiter_case(rng, [1, 2], [45, 30], 16, 16)
  kv_scale, q_scale = 0.02, 0.01
  # Quantised cache: unused slots stay NaN (fp8 e4m3fn has NaN).
  cache8 = (cache.astype(jnp.float32) / kv_scale).astype(jnp.float8_e4m3fn)
  q8 = (q.astype(jnp.float32) / q_scale).astype(jnp.float8_e4m3fn)
  out, lse = mla_decode(q8, cache8, qo, kvp, kvi, last, max_seqlen_q=2, q_scale=q_scale,
                        kv_scale=jnp.array([kv_scale], jnp.float32), num_kv_splits=2,
                        implementation="pallas", interpret=interpret)
  ro, rl = mla_decode(q8, cache8, qo, kvp, kvi, last, max_seqlen_q=2, q_scale=q_scale,
                      kv_scale=kv_scale, implementation="xla")
  assert rel_err(out, ro) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), rtol=1e-5, atol=1e-5)
  # Against the unquantised bf16 computation: fp8 error only.
  bo, _ = mla_decode(q, cache, qo, kvp, kvi, last, max_seqlen_q=2, implementation="xla")
  assert rel_err(out, bo) < 0.1


def test_split_combine_matches_single_split(interpret):
  rng = np.random.default_rng(11)
  q, cache, qo, kvp, kvi, last = _aiter_case(rng, [1, 1], [100, 3], 16, 4)
  outs = [mla_decode(q, cache, qo, kvp, kvi, last, max_seqlen_q=1, num_kv_splits=s,
                     implementation="pallas", interpret=interpret) for s in (1, 4)]
  assert rel_err(outs[1][0], outs[0][0]) < 5e-3
  np.testing.assert_allclose(np.asarray(outs[1][1]), np.asarray(outs[0][1]), rtol=1e-5)


def test_combine_splits_empty_rows():
  out = jnp.ones((3, 2, DV), jnp.float32)
  lse = jnp.array([[-jnp.inf, 0.0], [-jnp.inf, 0.0], [-jnp.inf, -jnp.inf]], jnp.float32)
  o, l = kern.combine_splits(out, lse, jnp.bfloat16)
  assert np.all(np.asarray(o[0]) == 0) and np.isposinf(float(l[0]))
  np.testing.assert_allclose(np.asarray(o[1], np.float32), 1.0)
  np.testing.assert_allclose(float(l[1]), np.log(2.0), rtol=1e-6)


def _ragged_case(rng, q_lens, kv_lens, n_heads, page_size, pages_per_seq, num_tokens,
                 num_live):
  s = len(q_lens)
  num_pages = s * pages_per_seq + 2
  page_indices = rng.permutation(num_pages)[: s * pages_per_seq].astype(np.int32)
  cache = (rng.standard_normal((num_pages, page_size, D)) / 4).astype(np.float32)
  cache[:] = np.nan  # only written slots and the prefix below are real
  for i in range(num_live):
    for t in range(kv_lens[i] - q_lens[i]):
      p = page_indices[i * pages_per_seq + t // page_size]
      cache[p, t % page_size] = rng.standard_normal(D) / 4
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  def bf(x):
    return jnp.asarray(x, jnp.bfloat16)
  return (bf(rng.standard_normal((num_tokens, n_heads, DV)) / 4),
          bf(rng.standard_normal((num_tokens, n_heads, 64)) / 4),
          bf(rng.standard_normal((num_tokens, DV)) / 4),
          bf(rng.standard_normal((num_tokens, 64)) / 4), bf(cache),
          jnp.asarray(np.asarray(kv_lens, np.int32)), jnp.asarray(page_indices), jnp.asarray(cu))


def test_ragged_reference_matches_numpy():
  rng = np.random.default_rng(3)
  q_lens, kv_lens = [1, 3], [6, 5]
  args = _ragged_case(rng, q_lens, kv_lens, 2, 4, 2, 5, 2)
  dist = jnp.array([1, 2, 2], jnp.int32)
  out, cache = mla_ragged_paged_attention(*args, dist, sm_scale=0.1, implementation="xla")
  ql, qp, kvc, kpe, _, kvl, pi, cu = args
  q = np.asarray(jnp.concatenate([ql, qp], -1).astype(jnp.float32))
  new = np.asarray(jnp.concatenate([kvc, kpe], -1).astype(jnp.float32))
  for i in range(2):
    keys = _gather_keys(cache, np.asarray(pi)[i * 2:i * 2 + 2], kv_lens[i])
    rows = slice(int(cu[i]), int(cu[i + 1]))
    np.testing.assert_array_equal(keys[kv_lens[i] - q_lens[i]:], new[rows])  # cache write
    want, _ = _np_attention(q[rows], keys, 0.1, True)
    np.testing.assert_allclose(np.asarray(out[rows], np.float32), want, atol=2e-2, rtol=2e-2)
  assert np.all(np.asarray(out[4]) == 0)  # padding token


@pytest.mark.parametrize("q_lens,kv_lens,n_heads,page_size,num_live,qpb", [
    ([1, 5, 3], [12, 5, 20], 8, 4, 3, None),      # decode + prefill + chunked prefill
    ([2, 7, 1], [3, 26, 4], 16, 16, 2, 4),        # third sequence unused
])
def test_ragged_kernel_matches_reference(interpret, q_lens, kv_lens, n_heads, page_size,
                                         num_live, qpb):
  rng = np.random.default_rng(sum(kv_lens))
  pages_per_seq = max(-(-k // page_size) for k in kv_lens)
  num_tokens = sum(q_lens) + 2
  args = _ragged_case(rng, q_lens, kv_lens, n_heads, page_size, pages_per_seq, num_tokens,
                      num_live)
  dist = jnp.array([1, 2, num_live], jnp.int32)
  copy = lambda a: jnp.array(a, copy=True)  # noqa: E731 - the cache is donated
  out, cache = mla_ragged_paged_attention(*args[:4], copy(args[4]), *args[5:], dist,
                                          sm_scale=0.07, num_queries_per_block=qpb,
                                          num_kv_splits=2, implementation="pallas",
                                          interpret=interpret)
  ro, rc = mla_ragged_paged_attention(*args[:4], copy(args[4]), *args[5:], dist, sm_scale=0.07,
                                      implementation="xla")
  np.testing.assert_array_equal(np.asarray(cache.astype(jnp.float32)),
                                np.asarray(rc.astype(jnp.float32)))
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert rel_err(out, ro) < 1e-2
  live = int(np.asarray(args[7])[num_live])
  assert np.all(np.asarray(out[live:]) == 0)


def test_validation_errors():
  q = jnp.zeros((2, 16, D), jnp.bfloat16)
  cache = jnp.zeros((4, 16, D), jnp.bfloat16)
  i32 = lambda *v: jnp.array(v, jnp.int32)  # noqa: E731
  good = (q, cache, i32(0, 1, 2), i32(0, 1, 2), i32(0, 1), i32(3, 4))
  with pytest.raises(ValueError, match="q must have shape"):
    mla_decode(jnp.zeros((2, 16, 512), jnp.bfloat16), *good[1:], max_seqlen_q=1)
  with pytest.raises(TypeError, match="kv_indices must have dtype int32"):
    mla_decode(*good[:4], good[4].astype(jnp.int16), good[5], max_seqlen_q=1)
  with pytest.raises(TypeError, match="kv_cache must have dtype"):
    mla_decode(q, cache.astype(jnp.float32), *good[2:], max_seqlen_q=1)
  with pytest.raises(ValueError, match="kv_last_page_lens must have shape"):
    mla_decode(*good[:5], i32(1), max_seqlen_q=1)
  with pytest.raises(ValueError, match="max_seqlen_q"):
    mla_decode(*good, max_seqlen_q=0)
  with pytest.raises(ValueError, match="num_kv_splits"):
    mla_decode(*good, max_seqlen_q=1, num_kv_splits=0)
  with pytest.raises(ValueError, match="block_table must have shape"):
    mla_decode_paged(q[None], cache, jnp.zeros((2, 3), jnp.int32), i32(1))
  with pytest.raises(ValueError, match="implementation"):
    mla_decode(*good, max_seqlen_q=1, implementation="cuda")


def test_jit_composes():
  rng = np.random.default_rng(2)
  args = _aiter_case(rng, [1, 1], [5, 9], 8, 4)
  f = jax.jit(lambda *a: mla_decode(*a, max_seqlen_q=1, implementation="xla")[0])
  assert f(*args).shape == (2, 8, DV)
