"""Dense MLA decode on the Mosaic GPU kernel vs the jax.numpy reference.

Mosaic GPU has no interpreter, so the kernel tests need a Hopper GPU
(``@pytest.mark.gpu``); the input checks and the CUDA lowering run anywhere.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lowers_for_cuda, rel_err

import jax_mla
from jax_mla import _mosaic
from jax_mla.dense_decode import mla_decode_paged, mosaic, triton

D = 576
PAGE = 64


def _case(rng, s_q, h_q, seqlens, *, bad_id_at=None, max_blocks=None):
  """Shuffled block table; NaN in every slot past each sequence; junk ids past it.

  ``bad_id_at=(i, j)`` also puts an invalid id inside request ``i``'s sequence
  (its keys are masked, as the reference does).
  """
  b = len(seqlens)
  max_blocks = max_blocks or max(1, max(-(-s // PAGE) for s in seqlens))
  num_blocks = b * max_blocks + 3
  bt = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
  cache = (rng.standard_normal((num_blocks, PAGE, D)) / 4).astype(np.float32)
  used = set(bt.ravel().tolist())
  cache[[i for i in range(num_blocks) if i not in used]] = np.nan
  for i, s in enumerate(seqlens):
    n = -(-s // PAGE)
    for j in range(n, max_blocks):
      cache[bt[i, j]] = np.nan
      bt[i, j] = [2147480000, -1, -(2**31)][j % 3]
    if s % PAGE:
      cache[bt[i, n - 1], s % PAGE:] = np.nan
  if bad_id_at is not None:
    i, j = bad_id_at
    bt[i, j] = num_blocks + 5
  q = (rng.standard_normal((b, s_q, h_q, D)) / 4).astype(np.float32)
  return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16), jnp.asarray(bt),
          jnp.asarray(np.asarray(seqlens, np.int32)))


def _check(args, *, causal=False, num_kv_splits=None, sm_scale=None):
  out, lse = mla_decode_paged(*args, causal=causal, num_kv_splits=num_kv_splits,
                              sm_scale=sm_scale, implementation="mosaic")
  ref_out, ref_lse = mla_decode_paged(*args, causal=causal, sm_scale=sm_scale,
                                      implementation="xla")
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  ref_out, ref_lse = np.asarray(ref_out, np.float32), np.asarray(ref_lse)
  assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
  assert np.isfinite(out).all()
  assert rel_err(out, ref_out) < 1e-2
  empty = np.isposinf(ref_lse)
  np.testing.assert_array_equal(np.isposinf(lse), empty)
  np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=1e-4, rtol=0)
  # Rows without keys are exactly zero.
  assert np.all(out.transpose(0, 2, 1, 3)[empty] == 0)


# The one-query tests share one shape (7 requests, 24 blocks of 64 in the table); lengths,
# ids and NaN are values, so each (h_q, splits, sm_scale) compiles once (kernel and reference).
MAX_BLOCKS = 24
EDGE_LENGTHS = [0, 1, 63, 64, 65, 333, MAX_BLOCKS * PAGE]  # the last one fills its table row


def _shared_case(rng, h_q, seqlens, **kw):
  """``_case`` with s_q 1 in the shared shape; zero-length requests pad ``seqlens``."""
  seqlens = list(seqlens) + [0] * (len(EDGE_LENGTHS) - len(seqlens))
  return _case(rng, 1, h_q, seqlens, max_blocks=MAX_BLOCKS, **kw)


@pytest.mark.parametrize("b,s_q,h_q,causal,num_kv_splits", [
    (3, 1, 128, False, 1), (2, 2, 64, True, 3), (132, 4, 16, False, 1), (2, 2, 32, True, 2),
    (132, 1, 16, False, 1), (3, 2, 16, True, 3), (2, 1, 8, False, 1), (2, 3, 40, True, 2)])
def test_kernel_lowers(b, s_q, h_q, causal, num_kv_splits):
  """The kernel lowers for CUDA, with and without KV splits, in both forms (64-row tiles;
  transposed, rows not a multiple of 64), tiles spanning tokens with ``causal``; runs
  without a GPU."""
  s = jax.ShapeDtypeStruct
  config = mosaic.with_defaults(None, num_kv_splits=num_kv_splits, batch=b, s_q=s_q, h_q=h_q,
                                max_blocks=4)
  lowers_for_cuda(functools.partial(mosaic.paged_decode, sm_scale=0.1, causal=causal,
                                    config=config),
                  s((b, s_q, h_q, 576), jnp.bfloat16), s((16, 64, 576), jnp.bfloat16),
                  s((b, 4), jnp.int32), s((b,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,num_kv_splits,sm_scale", [
    (64, 1, None), (64, 3, None), (128, None, 0.07), (128, 1, 0.07)])  # None: 6 splits
def test_edge_lengths(h_q, num_kv_splits, sm_scale):
  args = _shared_case(np.random.default_rng(h_q + (num_kv_splits or 0)), h_q, EDGE_LENGTHS)
  _check(args, num_kv_splits=num_kv_splits, sm_scale=sm_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_kv_splits", [None, 1])
def test_two_queries(causal, num_kv_splits):
  # One split: the kernel writes the LSE as [b, h_q, s_q] itself, a row per thread.
  args = _case(np.random.default_rng(7), 2, 128, [0, 1, 2, 65, 130, 511])
  _check(args, causal=causal, num_kv_splits=num_kv_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_small_heads_span_tokens(causal):
  # h_q 16, s_q 4: one 64-row tile holds four query tokens, each masked at its own length.
  args = _case(np.random.default_rng(3), 4, 16, [5, 200, 64, 2])
  _check(args, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("h_q,num_kv_splits", [(16, 1), (8, 3), (32, None), (48, 1), (100, 2)])
def test_transposed_and_padded_edge_lengths(h_q, num_kv_splits):
  # Rows not a multiple of 64: 8, 16 and 32 on the transposed kernel (one tile of 16 or
  # 32 rows), 48 and 100 in 64-row tiles whose last one has zero padding rows.
  args = _shared_case(np.random.default_rng(20 + h_q), h_q, EDGE_LENGTHS, bad_id_at=(5, 1))
  _check(args, num_kv_splits=num_kv_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("s_q,h_q,num_kv_splits", [(2, 16, 1), (3, 40, 2), (3, 40, 1),
                                                   (2, 24, 3)])
def test_causal_tiles_span_tokens(s_q, h_q, num_kv_splits):
  # Tiles holding rows of two query tokens, each masked at its own length: transposed
  # (2 x 16 rows), padded 64-row tiles (3 x 40, 2 x 24 rows).
  args = _case(np.random.default_rng(30 + h_q), s_q, h_q, [0, 1, 2, 65, 130, 511])
  _check(args, causal=True, num_kv_splits=num_kv_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_invalid_id_inside_sequence(num_kv_splits):
  args = _shared_case(np.random.default_rng(11), 64, [300, 129], bad_id_at=(0, 2))
  _check(args, num_kv_splits=num_kv_splits)


@pytest.mark.gpu
def test_random_lengths_and_scale():
  rng = np.random.default_rng(5)
  seqlens = rng.integers(0, MAX_BLOCKS * PAGE + 1, size=len(EDGE_LENGTHS)).tolist()
  q, cache, bt, sl = _shared_case(rng, 128, seqlens)
  out, lse = mla_decode_paged(q, cache, bt, sl, sm_scale=0.07, implementation="mosaic")
  ref_out, ref_lse = mla_decode_paged(q, cache, bt, sl, sm_scale=0.07, implementation="xla")
  assert rel_err(out, ref_out) < 1e-2
  assert rel_err(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("implementation,num_kv_splits", [
    ("xla", None), ("triton", 1), ("triton", 3),
    pytest.param("mosaic", 1, marks=pytest.mark.gpu),
    pytest.param("mosaic", 3, marks=pytest.mark.gpu)])
def test_nan_query_row_is_nan(implementation, num_kv_splits, interpret):
  # A NaN query row is not an empty row: its out and lse are NaN on every backend.
  q, cache, bt, sl = _shared_case(np.random.default_rng(4), 64, [130, 70, 0])
  q = q.at[1].set(jnp.nan)
  out, lse = (np.asarray(x, np.float32) for x in mla_decode_paged(
      q, cache, bt, sl, num_kv_splits=num_kv_splits, implementation=implementation,
      interpret=interpret and implementation == "triton"))
  assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
  assert not np.isnan(out[[0, 2]]).any() and not np.isnan(lse[[0, 2]]).any()
  assert np.all(out[2] == 0) and np.isposinf(lse[2]).all()  # no keys: still empty


@pytest.mark.cpu_only
@pytest.mark.parametrize("s_q,h_q,page,causal", [(1, 128, 32, False), (2, 16, 16, True)])
def test_rejects_unsupported_shapes(s_q, h_q, page, causal):
  q = jnp.zeros((2, s_q, h_q, D), jnp.bfloat16)
  cache = jnp.zeros((4, page, D), jnp.bfloat16)
  bt = jnp.zeros((2, 2), jnp.int32)
  with pytest.raises(ValueError, match="implementation='triton'"):
    mla_decode_paged(q, cache, bt, jnp.ones((2,), jnp.int32), causal=causal,
                     implementation="mosaic")


@pytest.mark.gpu
def test_default_picks_mosaic_on_hopper_only_for_supported_shapes():
  q, cache, bt, sl = _case(np.random.default_rng(2), 1, 64, [100, 7])
  hopper = jax.devices()[0].compute_capability.startswith("9")
  def default_for(q):
    return _mosaic.default_for(mosaic.check_supported, q, cache, causal=False)
  assert default_for(q) == (hopper and jax.__version_info__ >= (0, 11))
  assert default_for(q[:, :, :16]) == default_for(q)  # the transposed kernel
  assert not _mosaic.default_for(mosaic.check_supported, q, cache[:, :32], causal=False)


@pytest.mark.gpu
def test_config():
  args = _shared_case(np.random.default_rng(9), 64, [300, 129, 0])
  cfg = mosaic.Config(num_splits=2, consumer_registers=224, producer_registers=56)
  out, lse = mla_decode_paged(*args, config=cfg, implementation="mosaic")
  ref_out, ref_lse = mla_decode_paged(*args, implementation="xla")
  assert rel_err(out, ref_out) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)
  with pytest.raises(TypeError, match="config"):
    mla_decode_paged(*args, config=triton.Config(), implementation="mosaic")


@pytest.mark.cpu_only
def test_config_checks_register_split():
  with pytest.raises(ValueError, match="register split"):
    mosaic.Config(consumer_registers=240, producer_registers=40)  # 520 > 504
  with pytest.raises(ValueError, match="register split"):  # 512: would hang
    mosaic.Config(consumer_registers=240, producer_registers=32)
  with pytest.raises(ValueError, match="register split"):  # 496: a valid split wastes none
    mosaic.Config(consumer_registers=224, producer_registers=48)
  assert mosaic.Config(consumer_registers=240, producer_registers=24)
  with pytest.raises(ValueError, match="register split"):
    mosaic.Config(consumer_registers=230)


def test_mosaic_is_refused_where_it_cannot_run():
  q = jnp.zeros((1, 1, 64, D), jnp.bfloat16)
  cache = jnp.zeros((2, PAGE, D), jnp.bfloat16)
  bt, sl = jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32)
  with pytest.raises(ValueError, match="no interpreter"):
    mla_decode_paged(q, cache, bt, sl, implementation="mosaic", interpret=True)
  with pytest.raises(ValueError, match="no Mosaic GPU kernel"):  # AITER's mla_decode has none
    one = jnp.asarray([0, 1], jnp.int32)
    jax_mla.mla_decode(q[0, 0, :16][None], cache.reshape(-1, 1, D), one, one,
                       jnp.asarray([0], jnp.int32), jnp.asarray([1], jnp.int32), max_seqlen_q=1,
                       implementation="mosaic")
  if jax.default_backend() == "cpu":
    with pytest.raises(ValueError, match="needs a GPU"):
      mla_decode_paged(q, cache, bt, sl, implementation="mosaic")


@pytest.mark.parametrize("s_q,h_q,tiles", [
    (1, 128, (2, 64)), (4, 16, (1, 64)), (1, 16, (1, 16)), (1, 8, (1, 16)), (1, 20, (1, 32)),
    (2, 16, (1, 32)), (2, 24, (1, 64)), (1, 48, (1, 64)), (1, 100, (2, 64))])
def test_row_tiles(s_q, h_q, tiles):
  """Up to 32 rows: one transposed tile; more: 64-row tiles, the last one padded."""
  assert mosaic.row_tiles(s_q, h_q) == tiles
