"""Dense MLA decode: Triton kernel (interpret mode on CPU) vs reference vs a numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import has_gpu, rel_err

from jax_mla.dense_decode import (
  mla_decode,
  mla_decode_paged,
  mla_ragged_paged_attention,
  mosaic,
  triton,
)

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


@pytest.mark.cpu_only
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
  out, lse = mla_decode_paged(q, cache, bt, sl, causal=causal, implementation="triton",
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


@pytest.mark.cpu_only
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
                        implementation="triton", interpret=interpret)
  ro, rl = mla_decode(*args, max_seqlen_q=max_seqlen_q, implementation="xla")
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert rel_err(out, ro) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(rl), rtol=1e-5, atol=1e-5)


def test_mla_decode_non_causal_and_uncovered_tokens(interpret):
  rng = np.random.default_rng(5)
  q, cache, qo, kvp, kvi, last = _aiter_case(rng, [3, 2], [10, 6], 16, 4)
  # Two extra tokens after the last request: not computed, returned as 0 / +inf.
  q = jnp.concatenate([q, jnp.ones((2,) + q.shape[1:], q.dtype)])
  for impl in ("pallas", "xla"):  # "pallas": the old name of "triton"
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
                        implementation="triton", interpret=interpret)
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
                     implementation="triton", interpret=interpret) for s in (1, 4)]
  assert rel_err(outs[1][0], outs[0][0]) < 5e-3
  np.testing.assert_allclose(np.asarray(outs[1][1]), np.asarray(outs[0][1]), rtol=1e-5)


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


@pytest.mark.cpu_only
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


@pytest.mark.cpu_only
def test_ragged_donates_only_when_asked():
  rng = np.random.default_rng(4)
  args = _ragged_case(rng, [1, 3], [6, 5], 2, 4, 2, 5, 2)
  dist = jnp.array([1, 2, 2], jnp.int32)
  _, first = mla_ragged_paged_attention(*args, dist, implementation="xla")
  assert not args[4].is_deleted()  # an eager call leaves the caller's cache usable
  want = np.asarray(first, np.float32)
  # Writing the same tokens again into the updated cache changes nothing.
  _, second = mla_ragged_paged_attention(*args[:4], first, *args[5:], dist, donate=True,
                                         implementation="xla")
  assert first.is_deleted()  # donate=True hands the buffer over (CPU honours donation)
  np.testing.assert_array_equal(np.asarray(second, np.float32), want)


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
                                          num_kv_splits=2, implementation="triton",
                                          interpret=interpret)
  ro, rc = mla_ragged_paged_attention(*args[:4], copy(args[4]), *args[5:], dist, sm_scale=0.07,
                                      implementation="xla")
  np.testing.assert_array_equal(np.asarray(cache.astype(jnp.float32)),
                                np.asarray(rc.astype(jnp.float32)))
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert rel_err(out, ro) < 1e-2
  live = int(np.asarray(args[7])[num_live])
  assert np.all(np.asarray(out[live:]) == 0)


@pytest.mark.cpu_only
@pytest.mark.parametrize("impl", ["xla", "triton"] + (["mosaic"] if has_gpu() else []))
@pytest.mark.parametrize("b,s_q", [(0, 1), (2, 0)])
def test_paged_no_query_rows(impl, b, s_q):
  """A batch of zero requests (or zero query tokens) gives empty outputs on every
  implementation, without a kernel launch."""
  q = jnp.zeros((b, s_q, 64, 576), jnp.bfloat16)
  kv = jnp.zeros((4, 64, 576), jnp.bfloat16)
  out, lse = mla_decode_paged(q, kv, jnp.zeros((b, 2), jnp.int32), jnp.zeros((b,), jnp.int32),
                              implementation=impl, interpret=impl == "triton" and not has_gpu())
  assert out.shape == (b, s_q, 64, 512) and out.dtype == jnp.bfloat16
  assert lse.shape == (b, 64, s_q) and lse.dtype == jnp.float32
  with pytest.raises(ValueError, match="implementation"):  # still validated when empty
    mla_decode_paged(q, kv, jnp.zeros((b, 2), jnp.int32), jnp.zeros((b,), jnp.int32),
                     implementation="cuda")


def test_validation_errors():
  q = jnp.zeros((2, 16, D), jnp.bfloat16)
  cache = jnp.zeros((4, 16, D), jnp.bfloat16)
  i32 = lambda *v: jnp.array(v, jnp.int32)  # noqa: E731
  good = (q, cache, i32(0, 1, 2), i32(0, 1, 2), i32(0, 1), i32(3, 4))
  with pytest.raises(ValueError, match="q must have shape"):
    mla_decode(jnp.zeros((2, 16, 512), jnp.bfloat16), *good[1:], max_seqlen_q=1)
  with pytest.raises(TypeError, match="kv_indices must have an integer dtype"):
    mla_decode(*good[:4], good[4].astype(jnp.float32), good[5], max_seqlen_q=1)
  with pytest.raises(TypeError, match="kv_indptr must be an integer array"):
    mla_decode(*good[:3], [0, 1, 2], *good[4:], max_seqlen_q=1)
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
  with pytest.raises(TypeError, match="config"):
    mla_decode(*good, max_seqlen_q=1, config=mosaic.Config(), implementation="triton",
               interpret=True)
  with pytest.raises(ValueError, match="block_m"):
    triton.Config(block_m=48)


@pytest.mark.cpu_only
def test_static_sm_scale_must_be_a_python_number():
  q = jnp.zeros((2, 16, D), jnp.bfloat16)
  cache = jnp.zeros((4, 16, D), jnp.bfloat16)
  i32 = lambda *v: jnp.array(v, jnp.int32)  # noqa: E731
  good = (q, cache, i32(0, 1, 2), i32(0, 1, 2), i32(0, 1), i32(3, 4))
  with pytest.raises(TypeError, match="sm_scale"):
    mla_decode(*good, max_seqlen_q=1, sm_scale=jnp.float32(0.1))
  with pytest.raises(TypeError, match="sm_scale"):
    mla_decode_paged(q[None], cache, i32(0)[None], i32(3), sm_scale=np.float32(0.1))


@pytest.mark.cpu_only  # the cast is host code
def test_int64_metadata_is_cast(interpret):
  rng = np.random.default_rng(12)
  q, cache, qo, kvp, kvi, last = _aiter_case(rng, [1, 2], [21, 9], 16, 4)
  want = mla_decode(q, cache, qo, kvp, kvi, last, max_seqlen_q=2, implementation="triton",
                    interpret=interpret)
  i64 = [np.asarray(x).astype(np.int64) for x in (qo, kvp, kvi, last)]
  got = mla_decode(q, cache, *i64, max_seqlen_q=2, implementation="triton", interpret=interpret)
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  q4, cache4, bt, sl = _paged_case(rng, 2, 1, 16, 16, [20, 3])
  want = mla_decode_paged(q4, cache4, bt, sl, implementation="xla")
  got = mla_decode_paged(q4, cache4, np.asarray(bt, np.int64), np.asarray(sl, np.int64),
                         implementation="xla")
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_config_changes_tiling_not_results(interpret):
  rng = np.random.default_rng(13)
  # The shapes of a test_paged_kernel_matches_reference case: the default config's
  # kernel is compiled once.
  q, cache, bt, sl = _paged_case(rng, 2, 4, 20, 64, [100, 7])
  want = mla_decode_paged(q, cache, bt, sl, causal=True, implementation="triton",
                          interpret=interpret)
  cfg = triton.Config(block_m=16, block_n=16, num_warps=4, num_stages=2, num_splits=3)
  got = mla_decode_paged(q, cache, bt, sl, causal=True, config=cfg, implementation="triton",
                         interpret=interpret)
  assert rel_err(got[0], want[0]) < 5e-3
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_only
def test_mla_decode_checks_raise_eagerly():
  rng = np.random.default_rng(14)
  q, cache, qo, kvp, kvi, last = _aiter_case(rng, [1, 2], [21, 9], 16, 4)
  kw = dict(max_seqlen_q=2, checks=True, implementation="xla")
  mla_decode(q, cache, qo, kvp, kvi, last, **kw)  # valid metadata passes
  i32 = lambda *v: jnp.array(v, jnp.int32)  # noqa: E731
  bad = [
      ("qo_indptr must be non-decreasing", dict(qo=i32(0, 2, 1))),
      ("qo_indptr must lie in", dict(qo=i32(0, 1, 4))),
      ("kv_indptr must be non-decreasing", dict(kvp=i32(0, 6, 3))),
      ("kv_indptr must lie in", dict(kvp=i32(0, 6, 99))),
      ("kv_last_page_lens must lie in", dict(last=i32(5, 1))),
      ("kv_last_page_lens must lie in", dict(last=i32(1, 0))),
  ]
  for match, change in bad:
    a = {"qo": qo, "kvp": kvp, "last": last, **change}
    with pytest.raises(ValueError, match=match):
      mla_decode(q, cache, a["qo"], a["kvp"], kvi, a["last"], **kw)


@pytest.mark.cpu_only
def test_mla_decode_paged_checks_raise_eagerly():
  rng = np.random.default_rng(15)
  q, cache, bt, sl = _paged_case(rng, 2, 1, 16, 16, [20, 3])
  kw = dict(checks=True, implementation="xla")
  mla_decode_paged(q, cache, bt, sl, **kw)  # junk ids past each sequence are fine
  cap = bt.shape[1] * 16
  for match, args in [
      ("cache_seqlens must be >= 0", (bt, jnp.array([20, -1], jnp.int32))),
      ("cache_seqlens must be <=", (bt, jnp.array([cap + 1, 3], jnp.int32))),
      ("block_table ids used", (bt.at[0, 1].set(cache.shape[0]), sl)),
      ("block_table ids used", (bt.at[1, 0].set(-1), sl)),
  ]:
    with pytest.raises(ValueError, match=match):
      mla_decode_paged(q, cache, *args, **kw)


@pytest.mark.cpu_only  # host code; on a GPU test_ragged_kernel_matches_reference
def test_ragged_accepts_tpu_inference_kwargs(interpret):
  rng = np.random.default_rng(16)
  q_lens, kv_lens = [1, 3], [6, 5]
  args = _ragged_case(rng, q_lens, kv_lens, 2, 4, 2, 5, 2)
  dist = jnp.array([1, 2, 2], jnp.int32)
  copy = lambda a: jnp.array(a, copy=True)  # noqa: E731 - the cache is donated
  mask_value = -0.7 * float(np.finfo(np.float32).max)  # tpu-inference's DEFAULT_MASK_VALUE
  tpu_kw = dict(sliding_window=None, soft_cap=None, mask_value=mask_value, chunk_prefill_size=None,
                num_kv_pages_per_block=16, num_queries_per_block=4,
                vmem_limit_bytes=64 * 1024 * 1024, debug_mode=False)
  want, _ = mla_ragged_paged_attention(*args[:4], copy(args[4]), *args[5:], dist,
                                       implementation="xla")  # sm_scale defaults to 1.0
  got, _ = mla_ragged_paged_attention(*args[:4], copy(args[4]), *args[5:], dist, sm_scale=1.0,
                                      implementation="triton", interpret=interpret, **tpu_kw)
  assert rel_err(got, want) < 1e-2
  for kw, match in [(dict(sliding_window=128), "sliding_window"),
                    (dict(soft_cap=50.0), "soft_cap"), (dict(debug_mode=True), "debug_mode"),
                    (dict(sm_scale=jnp.float32(0.1)), "sm_scale")]:
    with pytest.raises((ValueError, TypeError), match=match):
      mla_ragged_paged_attention(*args[:4], copy(args[4]), *args[5:], dist, **kw)


@pytest.mark.cpu_only
def test_jit_composes():
  rng = np.random.default_rng(2)
  args = _aiter_case(rng, [1, 1], [5, 9], 8, 4)
  f = jax.jit(lambda *a: mla_decode(*a, max_seqlen_q=1, implementation="xla")[0])
  assert f(*args).shape == (2, 8, DV)
