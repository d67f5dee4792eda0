"""Index conversion and metadata helpers: Triton (interpret) vs reference vs numpy."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import has_gpu

import jax_mla.indexing as ix
from jax_mla.merge import lse2_to_lse

INT_MIN, INT_MAX = -(2**31), 2**31 - 1


def np_convert(req_id, block_table, tok, bs):
  out = np.full(tok.shape, -1, np.int64)
  R, B = block_table.shape
  for t in range(tok.shape[0]):
    for k in range(tok.shape[1]):
      v = int(tok[t, k])
      r = int(req_id[t])
      if v < 0 or v // bs >= B or not 0 <= r < R:
        continue
      out[t, k] = block_table[r, v // bs] * bs + v % bs
  return out.astype(np.int32)


def np_expand(block_table, seq_lens, K, capacity):
  out = np.full(capacity, -1, np.int32)
  indptr = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
  for r, n in enumerate(seq_lens):
    for t in range(n):
      p = indptr[r] + t
      if p < capacity and t // K < block_table.shape[1]:
        out[p] = block_table[r, t // K] * K + t % K
  return out, indptr


def test_convert_hand_checked(interpret):
  bt = jnp.array([[7, 3], [5, 0]], jnp.int32)
  req = jnp.array([0, 1], jnp.int32)
  tok = jnp.array([[0, 5, -1], [4, 9, 8]], jnp.int32)
  # block_size 4: (0,0)->7*4+0; (0,5)->3*4+1; (1,4)->0*4+0; (1,9), (1,8): block 2 is past the table
  want = np.array([[28, 13, -1], [0, -1, -1]], np.int32)
  for impl in ("xla", "triton"):
    got = ix.convert_req_index_to_global_index(req, bt, tok, block_size=4, implementation=impl,
                                               interpret=interpret)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed,T,K,R,B,bs", [
    (0, 5, 37, 3, 4, 16), (1, 9, 300, 4, 7, 64), (2, 1, 1, 1, 1, 2), (3, 17, 64, 5, 3, 61)])
def test_convert_random(seed, T, K, R, B, bs, interpret):
  rng = np.random.default_rng(seed)
  bt = rng.integers(0, 1000, (R, B)).astype(np.int32)
  req = rng.integers(-1, R + 1, T).astype(np.int32)  # includes out-of-range request ids
  tok = rng.integers(-2, B * bs + bs * 2, (T, K)).astype(np.int32)
  tok.flat[rng.integers(0, T * K, 4)] = [INT_MIN, INT_MAX, -1, B * bs]
  want = np_convert(req, bt, tok, bs)
  for impl in ("xla", "triton"):
    got = ix.convert_req_index_to_global_index(
        jnp.asarray(req), jnp.asarray(bt), jnp.asarray(tok), block_size=bs,
        implementation=impl, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=impl)


def test_expand_hand_checked(interpret):
  bt = jnp.array([[2, 5], [9, 1]], jnp.int32)
  lens = jnp.array([3, 0], jnp.int32)
  for impl in ("xla", "triton"):
    pages, indptr = ix.expand_page_indices(bt, lens, kernel_block_size=2, capacity=6,
                                           implementation=impl, interpret=interpret)
    np.testing.assert_array_equal(indptr, [0, 3, 3])
    np.testing.assert_array_equal(pages, [4, 5, 10, -1, -1, -1])


@pytest.mark.parametrize("seed,R,B,K,extra", [
    (0, 4, 5, 16, 7), (1, 7, 3, 1, 0), (2, 1, 9, 4, 100), (3, 6, 2, 3, 5)])
def test_expand_random(seed, R, B, K, extra, interpret):
  rng = np.random.default_rng(seed)
  bt = rng.integers(0, 500, (R, B)).astype(np.int32)
  lens = rng.integers(0, B * K + 1, R).astype(np.int32)
  lens[0] = 0  # a zero-length request
  if R > 2:
    lens[1] = B * K + 3  # tokens whose block lies past the table
  cap = int(lens.sum()) + extra
  want, want_indptr = np_expand(bt, lens, K, cap)
  for impl in ("xla", "triton"):
    pages, indptr = ix.expand_page_indices(jnp.asarray(bt), jnp.asarray(lens),
                                           kernel_block_size=K, capacity=cap,
                                           implementation=impl, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(indptr), want_indptr, err_msg=impl)
    np.testing.assert_array_equal(np.asarray(pages), want, err_msg=impl)


def test_expand_capacity_smaller_than_total_drops_tail(interpret):
  bt = jnp.array([[1, 2], [3, 4]], jnp.int32)
  lens = jnp.array([4, 4], jnp.int32)
  want, _ = np_expand(np.asarray(bt), np.asarray(lens), 2, 5)
  for impl in ("xla", "triton"):
    pages, _ = ix.expand_page_indices(bt, lens, kernel_block_size=2, capacity=5,
                                      implementation=impl, interpret=interpret)
    np.testing.assert_array_equal(pages, want)


@pytest.mark.cpu_only
def test_req_id_per_token():
  qsl = jnp.array([0, 3, 3, 5], jnp.int32)
  got = ix.req_id_per_token(qsl, num_tokens=8)
  np.testing.assert_array_equal(got, [0, 0, 0, 2, 2, 0, 0, 0])


@pytest.mark.cpu_only
def test_filter_prefill_indices():
  idx = jnp.array([[0, 4, 7, -1], [2, 3, 1, 5]], jnp.int32)
  ctx = jnp.array([5, 2], jnp.int32)
  context, new = ix.filter_prefill_indices(idx, ctx)
  np.testing.assert_array_equal(context, [[0, 4, -1, -1], [-1, -1, 1, -1]])
  np.testing.assert_array_equal(new, [[-1, -1, 2, -1], [0, 1, -1, 3]])


@pytest.mark.cpu_only
def test_lse2_to_lse():
  got = lse2_to_lse(jnp.array([1.0, -2.0, jnp.inf], jnp.bfloat16))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, [np.log(2), -2 * np.log(2), np.inf], rtol=1e-6)


@pytest.mark.cpu_only
@pytest.mark.parametrize("call,match", [
    (lambda: ix.convert_req_index_to_global_index(
        jnp.zeros(3, jnp.int32), jnp.zeros((2, 2), jnp.int32), jnp.zeros((4, 2), jnp.int32)),
     "token_indices"),
    (lambda: ix.convert_req_index_to_global_index(
        jnp.zeros(3, jnp.int32), jnp.zeros((2, 2), jnp.float32), jnp.zeros((3, 2), jnp.int32)),
     "block_table"),
    (lambda: ix.convert_req_index_to_global_index(
        jnp.zeros(3, jnp.int32), jnp.zeros((2, 2), jnp.int32), jnp.zeros((3, 2), jnp.int32),
        implementation="cuda"), "implementation"),
    (lambda: ix.convert_req_index_to_global_index(
        jnp.zeros(3, jnp.int32), jnp.zeros((2, 2), jnp.int32), jnp.zeros((3, 2), jnp.int32),
        block_size=jnp.int32(4)), "block_size"),
    (lambda: ix.req_id_per_token([0, 3], num_tokens=4), "query_start_loc"),
    (lambda: ix.expand_page_indices(jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32),
                                    kernel_block_size=1, capacity=4, config=object(),
                                    implementation="triton", interpret=True), "config"),
    (lambda: ix.expand_page_indices(jnp.zeros((2, 2), jnp.int32), jnp.zeros(3, jnp.int32),
                                    kernel_block_size=1, capacity=4), "seq_lens"),
    (lambda: ix.expand_page_indices(jnp.zeros((2,), jnp.int32), jnp.zeros(2, jnp.int32),
                                    kernel_block_size=1, capacity=4), "block_table"),
    (lambda: ix.filter_prefill_indices(jnp.zeros((3, 2), jnp.int32), jnp.zeros(2, jnp.int32)),
     "indices"),
])
def test_bad_input_names_argument(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call()


@pytest.mark.cpu_only  # the cast is host code
def test_int64_metadata_is_cast(interpret):
  rng = np.random.default_rng(5)
  bt = rng.integers(0, 100, (3, 4)).astype(np.int64)
  req = np.array([0, 2, 1, 5], np.int64)
  tok = rng.integers(-1, 70, (4, 9)).astype(np.int64)
  want = np_convert(req, bt, tok, 16)
  for impl in ("xla", "triton"):
    got = ix.convert_req_index_to_global_index(req, bt, tok, block_size=16, implementation=impl,
                                               interpret=interpret)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
    pages, _ = ix.expand_page_indices(bt, np.array([5, 0, 9], np.int64), kernel_block_size=4,
                                      capacity=16, implementation=impl, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(pages),
                                  np_expand(bt, np.array([5, 0, 9]), 4, 16)[0])
  np.testing.assert_array_equal(ix.req_id_per_token(np.array([0, 3, 3, 5]), num_tokens=6),
                                [0, 0, 0, 2, 2, 0])
  ctx, new = ix.filter_prefill_indices(np.array([[0, 4]]), np.array([2]))
  np.testing.assert_array_equal(ctx, [[0, -1]])
  np.testing.assert_array_equal(new, [[-1, 2]])


@pytest.mark.skipif(has_gpu(), reason="checks the error given on a machine without a GPU")
def test_pallas_without_gpu_needs_interpret():
  with pytest.raises(ValueError, match="interpret=True"):
    ix.convert_req_index_to_global_index(
        jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
        implementation="pallas")
