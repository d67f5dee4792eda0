"""torch bridge: zero-copy interop, torch-callable ops, FlashMLA drop-ins, library callers."""

import ctypes
import dataclasses
import functools
import importlib
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

torch = pytest.importorskip("torch")

import jax_mla  # noqa: E402
import torch_bridge  # noqa: E402
from jax_mla import cache as jcache  # noqa: E402
from jax_mla import indexing, merge, sparse_mla  # noqa: E402
from torch_bridge import _interop, aiter, flashmla, ops, to_jax, to_torch  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint8, torch.int8, torch.int16, torch.int32, torch.bool]
XLA = {"implementation": "xla"}


def _sample(dtype, shape=(3, 5), device="cpu"):
  g = torch.Generator().manual_seed(0)
  x = torch.randn(shape, generator=g) * 4
  return x.to(dtype).to(device) if dtype != torch.bool else (x > 0).to(device)


def _bytes(t):
  return t.cpu().contiguous().view(torch.uint8).numpy() if t.dtype.itemsize == 1 \
      else t.cpu().float().numpy() if t.dtype == torch.bfloat16 else t.cpu().numpy()


def _jax_bytes(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.astype(np.float32) \
      if a.dtype == jnp.bfloat16 else a


# ----------------------------------------------------------------------------
# to_jax / to_torch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_zero_copy(dtype):
  t = _sample(dtype)
  a = to_jax(t)
  assert a.dtype == _interop.TORCH_TO_JAX_DTYPE[dtype]
  assert a.shape == tuple(t.shape)
  assert a.unsafe_buffer_pointer() == t.data_ptr()
  back = to_torch(a)
  assert back.dtype == dtype
  assert back.data_ptr() == t.data_ptr()
  np.testing.assert_array_equal(_bytes(back), _bytes(t))
  # Values as JAX sees them (fp8 through its float32 view).
  ref = t.float().numpy() if t.dtype.is_floating_point else t.numpy()
  np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)) if t.dtype.is_floating_point
                                else np.asarray(a), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_jax_to_torch_shares_memory(dtype):
  a = to_jax(_sample(dtype, (4, 7)))
  b = jnp.asarray(a) + 0 if dtype != torch.bool else ~a  # a fresh JAX-owned buffer
  t = to_torch(b)
  assert t.data_ptr() == b.unsafe_buffer_pointer()
  np.testing.assert_array_equal(_bytes(t), _jax_bytes(b))


def test_torch_writes_are_visible_to_jax():
  t = torch.zeros(8, dtype=torch.float32)
  a = to_jax(t)
  t[3] = 5.0
  assert float(np.asarray(a)[3]) == 5.0  # same memory, no copy


def test_odd_shapes():
  assert to_jax(torch.zeros(0, 5)).shape == (0, 5)
  assert float(to_jax(torch.tensor(2.5))) == 2.5
  assert to_torch(jnp.float32(1.5)).item() == 1.5
  # Contiguous tensors with unusual strides on size-1 axes are still shared.
  w = torch.arange(4.0).as_strided((1, 4), (100, 1))
  a = to_jax(w)
  assert a.unsafe_buffer_pointer() == w.data_ptr()
  np.testing.assert_array_equal(np.asarray(a), w.numpy())
  # requires_grad is dropped: values cross, autograd does not.
  g = torch.ones(3, requires_grad=True)
  np.testing.assert_array_equal(np.asarray(to_jax(g)), np.ones(3, np.float32))


@pytest.mark.parametrize("make", [lambda: torch.zeros(4, 6).T, lambda: torch.zeros(8)[::2],
                                  lambda: torch.zeros(4, 6)[:, 1:]],
                         ids=["transposed", "strided", "column-slice"])
def test_non_contiguous_is_refused(make):
  with pytest.raises(ValueError, match="contiguous"):
    to_jax(make())


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.complex64], ids=str)
def test_unsupported_dtype_is_refused(dtype):
  with pytest.raises(TypeError, match="does not carry"):
    to_jax(torch.zeros(3, dtype=dtype))


def test_int64_error_suggests_int32():
  with pytest.raises(TypeError, match="int32"):
    to_jax(torch.zeros(3, dtype=torch.int64))


def test_wrong_types_are_refused():
  with pytest.raises(TypeError, match="torch.Tensor"):
    to_jax(np.zeros(3))
  with pytest.raises(TypeError, match="jax.Array"):
    to_torch(torch.zeros(3))
  with pytest.raises(TypeError, match="does not carry"):
    to_torch(jnp.zeros(3, jnp.uint32))


JAX_OPS = {
    indexing: ("convert_req_index_to_global_index", "expand_page_indices", "req_id_per_token",
               "filter_prefill_indices"),
    merge: ("merge_attn_states", "lse2_to_lse"),
    jcache: ("concat_and_cache_mla", "quantize_fp8_ds_mla", "dequantize_fp8_ds_mla",
             "quantize_fp8_model1", "dequantize_fp8_model1", "quantize_fp8_model1_cache",
             "dequantize_fp8_model1_cache"),
    sparse_mla: ("sparse_mla_prefill", "sparse_mla_decode"),
    jax_mla: ("mla_decode", "mla_decode_paged", "mla_ragged_paged_attention", "mla_prefill",
              "paged_attention"),
}


def test_package_exports():
  assert torch_bridge.__all__ == ["set_direct_launch", "to_jax", "to_torch"]
  for module, names in JAX_OPS.items():
    for n in names:  # one wrapper per jax_mla op, with the op's signature and docs
      op = getattr(ops, n)
      assert n in ops.__all__ and op.jax_op is getattr(module, n)
      assert op.__wrapped__ is op.jax_op and op.jax_op.__doc__ in op.__doc__


def test_missing_torch_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
  for name in [m for m in sys.modules if m == "torch_bridge" or m.startswith("torch_bridge.")]:
    monkeypatch.delitem(sys.modules, name)
  extra_and_wheel = r'pip install "jax-mla\[torch\]".*download\.pytorch\.org/whl/cpu'
  with pytest.raises(ImportError, match=extra_and_wheel):
    importlib.import_module("torch_bridge")


# ----------------------------------------------------------------------------
# torch_bridge.ops against the JAX call


def _rng(seed):
  return np.random.default_rng(seed)


def _bf16(x):
  return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)


def _i32(x):
  return torch.from_numpy(np.asarray(x, np.int32))


def _assert_same(out_t, out_j):
  out_t = out_t if isinstance(out_t, tuple) else (out_t,)
  out_j = out_j if isinstance(out_j, tuple) else (out_j,)
  assert len(out_t) == len(out_j)
  for t, j in zip(out_t, out_j, strict=True):
    assert isinstance(t, torch.Tensor)
    assert _interop.TORCH_TO_JAX_DTYPE[t.dtype] == j.dtype and tuple(t.shape) == j.shape
    np.testing.assert_array_equal(_bytes(t), _jax_bytes(j))


def test_indexing_ops_match_jax():
  r = _rng(0)
  block_table = _i32(r.integers(0, 50, (3, 4)))
  req_id = _i32(r.integers(0, 3, (5,)))
  tok = _i32(r.integers(-2, 300, (5, 7)))
  got = ops.convert_req_index_to_global_index(req_id, block_table, tok, block_size=64)
  ref = indexing.convert_req_index_to_global_index(
      to_jax(req_id), to_jax(block_table), to_jax(tok), block_size=64)
  _assert_same(got, ref)
  seq_lens = _i32([5, 0, 9])
  got = ops.expand_page_indices(block_table, seq_lens, kernel_block_size=4, capacity=20, **XLA)
  ref = indexing.expand_page_indices(to_jax(block_table), to_jax(seq_lens), kernel_block_size=4,
                                     capacity=20, implementation="xla")
  _assert_same(got, ref)


def test_merge_ops_match_jax():
  r = _rng(1)
  oa, ob = _bf16(r.normal(size=(3, 2, 8))), _bf16(r.normal(size=(3, 2, 8)))
  la = torch.from_numpy(r.normal(size=(3, 2)).astype(np.float32))
  lb = torch.from_numpy(r.normal(size=(3, 2)).astype(np.float32))
  lb[0, 0] = float("inf")
  _assert_same(ops.merge_attn_states(oa, la, ob, lb),
               merge.merge_attn_states(to_jax(oa), to_jax(la), to_jax(ob), to_jax(lb)))
  _assert_same(ops.lse2_to_lse(la), merge.lse2_to_lse(to_jax(la)))


def _ds_mla_cache(seed, num_blocks=3, block_size=8):
  x = _bf16(_rng(seed).normal(size=(num_blocks, block_size, 576)))
  return ops.quantize_fp8_ds_mla(x, pow2_scales=True), x


def test_cache_ops_match_jax():
  cache_t, x = _ds_mla_cache(2)
  _assert_same(cache_t, jcache.quantize_fp8_ds_mla(to_jax(x), pow2_scales=True))
  _assert_same(ops.dequantize_fp8_ds_mla(cache_t), jcache.dequantize_fp8_ds_mla(to_jax(cache_t)))
  assert ops.kv_cache_shape(3, 8, 576, "fp8_ds_mla") == (3, 8, 656)

  r = _rng(3)
  kv_cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
  kv_c, k_pe = _bf16(r.normal(size=(3, 512))), _bf16(r.normal(size=(3, 64)))
  slots = _i32([5, -1, 0])
  ref = jcache.concat_and_cache_mla(to_jax(kv_c), to_jax(k_pe), to_jax(kv_cache), to_jax(slots),
                                    implementation="xla")
  ptr = kv_cache.data_ptr()
  new = ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slots)
  assert new is kv_cache and kv_cache.data_ptr() == ptr  # written in place
  _assert_same(kv_cache, ref)
  assert torch.equal(kv_cache[1, 1, :512], kv_c[0])


@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8_ds_mla", "fp8_model1", "fp8_v41", "fp4_v41"])
@pytest.mark.parametrize("slots", [[5, -1, 0, 7, 40], [-1, -3, 99], []],
                         ids=["some", "none", "empty"])
def test_concat_and_cache_in_place(fmt, slots):
  """Byte-exact with jax_mla's writer in every format, vLLM's positional form with int64
  slots, skipped slots (slot < 0 or past the cache), no valid slot; untouched slots keep
  their bytes and the cache its memory."""
  r = _rng(11)
  widths = (448, 64) if fmt in ("fp8_model1", "fp8_v41", "fp4_v41") else (512, 64)
  shape = jcache.kv_cache_shape(3, 4, sum(widths), fmt)
  dtype = torch.bfloat16 if fmt == "auto" else torch.uint8
  before = torch.from_numpy(r.integers(0, 120, shape).astype(np.uint8))
  kv_cache = before.to(dtype) if fmt == "auto" else before.clone()
  kv_c, k_pe = (_bf16(r.normal(size=(max(len(slots), 1), w))) for w in widths)
  scale = torch.tensor(0.5)
  ref = jcache.concat_and_cache_mla(to_jax(kv_c), to_jax(k_pe), to_jax(kv_cache.clone()),
                                    jnp.asarray(slots, jnp.int32), kv_cache_dtype=fmt,
                                    scale=0.5, implementation="xla")
  ptr = kv_cache.data_ptr()
  ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, torch.tensor(slots, dtype=torch.int64), fmt,
                           scale)
  assert kv_cache.data_ptr() == ptr
  _assert_same(kv_cache, ref)


def test_decode_ops_match_jax():
  r = _rng(4)
  b, s_q, h_q, nb, bs = 2, 1, 4, 6, 4
  q = _bf16(r.normal(size=(b, s_q, h_q, 576)))
  kv_cache = _bf16(r.normal(size=(nb, bs, 576)))
  block_table = _i32(r.permutation(nb)[:4].reshape(2, 2))
  seqlens = _i32([5, 8])
  got = ops.mla_decode_paged(q, kv_cache, block_table, seqlens, sm_scale=0.1, **XLA)
  ref = jax_mla.mla_decode_paged(to_jax(q), to_jax(kv_cache), to_jax(block_table),
                                    to_jax(seqlens), sm_scale=0.1, implementation="xla")
  _assert_same(got, ref)
  # Another static value compiles another executable (and gives another result).
  other = ops.mla_decode_paged(q, kv_cache, block_table, seqlens, sm_scale=0.2, **XLA)
  assert not torch.equal(other[0], got[0])


def test_sparse_ops_and_flashmla_drop_ins_match_jax():
  r = _rng(5)
  cache_t, _ = _ds_mla_cache(6, num_blocks=4, block_size=8)
  b, s_q, h_q, topk = 2, 2, 3, 5
  q = _bf16(r.normal(size=(b, s_q, h_q, 576)))
  idx = _i32(r.integers(-1, 32, (b, s_q, topk)))
  sink = torch.tensor([0.5, -np.inf, 1.0], dtype=torch.float32)
  got = ops.sparse_mla_decode(q, cache_t, idx, sm_scale=0.05, attn_sink=sink, **XLA)
  ref = sparse_mla.sparse_mla_decode(to_jax(q), to_jax(cache_t), to_jax(idx), sm_scale=0.05,
                                     attn_sink=to_jax(sink), implementation="xla")
  _assert_same(got, ref)
  # FlashMLA's drop-in on FlashMLA's cache view [nb, bs, 1, 656] (fp8 dtype, as its tests).
  meta, none = ops.get_mla_metadata()
  assert none is None
  drop = ops.flash_mla_with_kvcache(q, cache_t.view(torch.float8_e4m3fn).unsqueeze(2), None,
                                    None, 512, meta, None, softmax_scale=0.05,
                                    is_fp8_kvcache=True, indices=idx, attn_sink=sink)
  _assert_same(drop, ref)
  with pytest.raises(ValueError, match="differ from the first call"):
    ops.flash_mla_with_kvcache(q[:1], cache_t.unsqueeze(2), None, None, 512, meta,
                               is_fp8_kvcache=True, indices=idx[:1])

  # Sparse prefill: FlashMLA's [s_kv, 1, d] / [s_q, 1, topk] shapes.
  s_q, s_kv = 4, 10
  qp = _bf16(r.normal(size=(s_q, h_q, 576)))
  kv = _bf16(r.normal(size=(s_kv, 1, 576)))
  ip = _i32(r.integers(-1, s_kv + 2, (s_q, 1, topk)))
  tl = _i32([5, 2, 0, 3])
  ref = sparse_mla.sparse_mla_prefill(to_jax(qp), to_jax(kv), to_jax(ip), sm_scale=0.07,
                                      topk_length=to_jax(tl), implementation="xla")
  _assert_same(ops.flash_mla_sparse_fwd(qp, kv, ip, 0.07, topk_length=tl), ref)


def test_flashmla_dense_drop_in_matches_jax():
  r = _rng(7)
  q = _bf16(r.normal(size=(2, 1, 4, 576)))
  k_cache = _bf16(r.normal(size=(5, 4, 1, 576)))
  bt, sl = _i32([[4, 0], [2, 3]]), _i32([7, 3])
  meta, _ = ops.get_mla_metadata(sl, 4, 1)
  out, lse = ops.flash_mla_with_kvcache(q, k_cache, bt, sl, 512, meta, causal=False)
  ref = jax_mla.mla_decode_paged(to_jax(q), to_jax(k_cache.squeeze(2)), to_jax(bt),
                                    to_jax(sl), sm_scale=576 ** -0.5)
  _assert_same((out, lse), ref)
  with pytest.raises(ValueError, match="need sparse attention"):
    ops.flash_mla_with_kvcache(q, k_cache, bt, sl, 512, ops.get_mla_metadata()[0],
                               topk_length=sl)
  with pytest.raises(ValueError, match="num_splits"):
    ops.flash_mla_with_kvcache(q, k_cache, bt, sl, 512, meta, sl)
  # FlashMLA's earlier interface, as vLLM's backends call it: scheduler tensors, ignored.
  old = ops.flash_mla_with_kvcache(q, k_cache, bt, sl, 512, torch.zeros(8, 8, dtype=torch.int32),
                                   torch.zeros(3, dtype=torch.int32), causal=False)
  _assert_same(old, ref)
  with pytest.raises(TypeError, match="num_splits"):
    ops.flash_mla_with_kvcache(q, k_cache, bt, sl, 512, torch.zeros(8, dtype=torch.int32), 3)


def test_model1_flashmla_view_round_trips():
  bs, nb = 64, 2
  width = jcache.kv_cache_shape(nb, bs, 512, "fp8_model1")[2]
  ours = torch.from_numpy(_rng(8).integers(0, 255, (nb, bs, width), dtype=np.uint8))
  # FlashMLA's view: [nb, bs, 1, 584], block stride = padded block bytes.
  view = ours.as_strided((nb, bs, 1, 584), (bs * width, 584, 584, 1))
  back = ops._as_cache(view.view(torch.float8_e4m3fn), "k_cache", "fp8_model1")
  assert back.data_ptr() == ours.data_ptr() and torch.equal(back, ours)
  with pytest.raises(ValueError, match="padded blocks"):
    ops._as_cache(ours[:, :, :584].unsqueeze(2), "k_cache", "fp8_model1")


def test_other_ops_match_jax():
  r = _rng(9)
  # paged attention, 4-D caches.
  q = _bf16(r.normal(size=(2, 4, 16)))
  kc, vc = _bf16(r.normal(size=(3, 2, 4, 16))), _bf16(r.normal(size=(3, 2, 4, 16)))
  bt, sl = _i32([[0, 2], [1, 0]]), _i32([6, 3])
  _assert_same(ops.paged_attention(q, kc, vc, bt, sl, scale=0.25, **XLA),
               jax_mla.paged_attention(to_jax(q), to_jax(kc), to_jax(vc), to_jax(bt),
                                               to_jax(sl), scale=0.25, implementation="xla"))
  # AITER-convention dense decode over a page_size-1 flat cache.
  qd = _bf16(r.normal(size=(2, 4, 576)))
  flat = _bf16(r.normal(size=(9, 1, 576)))
  args = (qd, flat, _i32([0, 1, 2]), _i32([0, 3, 7]), _i32([4, 0, 8, 1, 2, 3, 5]), _i32([1, 1]))
  _assert_same(ops.mla_decode(*args, max_seqlen_q=1, **XLA),
               jax_mla.mla_decode(*map(to_jax, args), max_seqlen_q=1, implementation="xla"))


def test_op_argument_errors():
  x = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
  lse = torch.zeros(3, 2)
  with pytest.raises(ValueError, match="out_b must be contiguous"):
    ops.merge_attn_states(x, lse, x.transpose(0, 1).contiguous().transpose(0, 1), lse)
  with pytest.raises(TypeError, match="does not carry"):
    ops.merge_attn_states(x, lse.double(), x, lse)
  with pytest.raises(TypeError, match="capacity: got a ndarray"):
    ops.expand_page_indices(_i32([[0]]), _i32([1]), kernel_block_size=1, capacity=np.int32([4]))
  with pytest.raises(TypeError, match="hashable"):
    ops.expand_page_indices(_i32([[0]]), _i32([1]), kernel_block_size=1, capacity={4})


@pytest.mark.parametrize("bad", [[[0, 1]], ((0, 1),), np.zeros((1, 2), np.int32)],
                         ids=["list", "tuple", "numpy"])
def test_non_tensor_arrays_are_refused_by_name(bad):
  with pytest.raises(TypeError, match=r"block_table: got a (list|tuple|ndarray); pass a torch"):
    ops.expand_page_indices(bad, _i32([1]), kernel_block_size=1, capacity=4)
  with pytest.raises(TypeError, match=r"seq_lens: got a"):
    ops.expand_page_indices(_i32([[0]]), bad, kernel_block_size=1, capacity=4)
  q = _bf16(np.zeros((2, 1, 4, 576)))
  k_cache = _bf16(np.zeros((3, 4, 1, 576)))
  meta, _ = ops.get_mla_metadata()
  with pytest.raises(TypeError, match="block_table must be a torch.Tensor; got"):
    ops.flash_mla_with_kvcache(q, k_cache, bad, _i32([1, 1]), 512, meta)
  with pytest.raises(TypeError, match="indices must be a torch.Tensor; got"):
    ops.flash_mla_sparse_fwd(q[0], k_cache[0], bad, 0.1)


# ----------------------------------------------------------------------------
# FlashMLA / AITER callers: clear errors without the library or the device.


def test_flashmla_missing_library(monkeypatch):
  monkeypatch.setitem(sys.modules, "flash_mla", None)
  q = jnp.zeros((1, 1, 64, 576), jnp.bfloat16)
  with pytest.raises(ImportError, match="FlashMLA is not installed.*FlashMLA"):
    flashmla.sparse_mla_decode(q, jnp.zeros((1, 64, 656), jnp.uint8),
                               jnp.zeros((1, 1, 64), jnp.int32))
  with pytest.raises(ImportError, match="FlashMLA is not installed"):
    flashmla.mla_decode_paged(q, jnp.zeros((1, 64, 576), jnp.bfloat16),
                              jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))


def test_flashmla_needs_a_cuda_device(monkeypatch):
  monkeypatch.setitem(sys.modules, "flash_mla", types.ModuleType("flash_mla"))
  cpu = jax.devices("cpu")[0]
  q = jax.device_put(jnp.zeros((1, 1, 64, 576), jnp.bfloat16), cpu)
  with pytest.raises(RuntimeError, match="FlashMLA runs on CUDA GPUs; q is on"):
    flashmla.sparse_mla_decode(q, jax.device_put(jnp.zeros((1, 64, 656), jnp.uint8), cpu),
                               jax.device_put(jnp.zeros((1, 1, 64), jnp.int32), cpu))
  with pytest.raises(ValueError, match="fp8"):
    flashmla.sparse_mla_decode(q, q, q, kv_cache_dtype="auto")


def test_aiter_missing_library_or_device(monkeypatch):
  args = (jnp.zeros((1, 16, 576), jnp.bfloat16), jnp.zeros((4, 1, 576), jnp.bfloat16),
          jnp.array([0, 1], jnp.int32), jnp.array([0, 4], jnp.int32),
          jnp.arange(4, dtype=jnp.int32), jnp.ones((1,), jnp.int32))
  monkeypatch.setitem(sys.modules, "aiter", None)
  monkeypatch.setitem(sys.modules, "aiter.mla", None)
  with pytest.raises(ImportError, match="AITER is not installed"):
    aiter.mla_decode(*args, max_seqlen_q=1)
  monkeypatch.setitem(sys.modules, "aiter.mla", types.ModuleType("aiter.mla"))
  cpu = jax.devices("cpu")[0]
  with pytest.raises(RuntimeError, match="AITER runs on ROCM GPUs"):
    aiter.mla_decode(*(jax.device_put(a, cpu) for a in args), max_seqlen_q=1)


def test_ops_reuse_imported_views_and_never_keep_tensors_alive():
  x = torch.arange(64, dtype=torch.float32)
  view = x[16:]
  uses = torch._C._storage_Use_Count(x.untyped_storage()._cdata)
  np.testing.assert_allclose(_bytes(ops.lse2_to_lse(view)), np.arange(16, 64) * np.log(2.0),
                             rtol=1e-6)
  keys = [k for k in _interop._imports if k[1] == view.data_ptr()]
  assert len(keys) == 1
  # The cache holds no reference to the memory: dropping the tensors frees it.
  assert torch._C._storage_Use_Count(x.untyped_storage()._cdata) == uses
  x[16] = 100.0  # torch writes in place: the reused view reads the new value
  assert float(ops.lse2_to_lse(view)[0]) == pytest.approx(100.0 * np.log(2.0))
  assert [k for k in _interop._imports if k[1] == view.data_ptr()] == keys


def test_import_cache_hits_through_fresh_view_objects():
  """A new Python object over the same memory hits: a dtype view of a view of a root
  that nothing references any more (FlashMLA's fp8 cache seen as uint8)."""
  cache = torch.zeros(3, 4, 8, 16, dtype=torch.uint8)[1].view(torch.float8_e4m3fn).view(
      4, 8, 1, 16)
  device = _interop.jax_device(cache)
  imported = [_interop.import_cached(cache.view(torch.uint8).squeeze(2), device, None)[1]
              for _ in range(3)]
  assert imported == [True, False, False]


def test_copied_imports_are_not_reused():
  x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
  view = x[1:]  # 16-byte offset: JAX's CPU client copies it
  a, imported = _interop.import_cached(view, _interop.jax_device(view), None)
  if a.unsafe_buffer_pointer() == view.data_ptr():
    pytest.skip("this jaxlib shares a 16-byte-aligned view without a copy")
  assert imported and not any(k[1] == view.data_ptr() for k in _interop._imports)
  x[1, 0] = 7.0
  assert float(ops.lse2_to_lse(view)[0, 0]) == pytest.approx(7.0 * np.log(2.0))


# ----------------------------------------------------------------------------
# Direct launch (torch_bridge._direct): plans made from programs lowered for CUDA on
# any machine, run here with a stand-in kernel that records what it is given.


class _RecordingKernel:
  """Stands in for a compiled Mosaic GPU module: records each launch's pointers and
  fills every result buffer with byte ``FILL`` (CPU memory: the plan ran on CPU tensors)."""
  FILL = 0x3F

  def __init__(self, module, device):
    assert module and device.type == "cpu"
    self.launches, self.result_bytes = [], []

  def launch(self, pointers, stream):
    self.launches.append((pointers, stream))
    for ptr, nbytes in zip(pointers[len(pointers) - len(self.result_bytes):], self.result_bytes,
                           strict=True):
      ctypes.memset(ptr, self.FILL, nbytes)


def _decode_plan(b, h_q, topk, lengths=False, nb=4, num_splits=1, sink=False):
  """The plan of the Mosaic GPU sparse decode program (fp8_ds_mla) on CPU tensors; its
  arguments are q, cache, indices, then the lengths and the sinks where asked for."""
  pytest.importorskip("absl")
  from jax_mla.cache.formats import resolve
  from jax_mla.sparse_mla import api as sparse_api
  from jax_mla.sparse_mla import mosaic
  from torch_bridge import _direct
  fmt = resolve("fp8_ds_mla")
  config = dataclasses.replace(mosaic.default_config(fmt, h_q), num_splits=num_splits)
  decode = functools.partial(sparse_api._decode, fmt=fmt, extra_fmt=None, sm_scale=0.1, d_v=512,
                             impl="mosaic", config=config, interpret=False)
  s = jax.ShapeDtypeStruct
  structs = [s((b, 1, h_q, 576), jnp.bfloat16), s((nb, 64, 656), jnp.uint8),
             s((b, 1, topk), jnp.int32)] + [s((b,), jnp.int32)] * lengths + [
                 s((h_q,), jnp.float32)] * sink

  def program(q, c, i, *rest):
    return decode(q, c, i, rest[0] if lengths else None, None, None, None,
                  rest[-1] if sink else None)

  _, block, treedef = _direct.lowered_main(program, structs, None)
  return _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel)


def test_direct_plan_of_sparse_decode_is_one_kernel_on_the_callers_memory():
  """The sparse decode's program (every entry counting, topk a multiple of 64, no sink)
  is one kernel launch and nothing else: the kernel reads the caller's own q, cache and
  indices and nothing more (no lengths, no sinks: no constants); the outputs come back
  in FlashMLA's shapes, written by the kernel."""
  b, h_q, topk = 3, 64, 128
  plan = _decode_plan(b, h_q, topk)
  [step] = plan.kernels
  kernel = step.kernel
  kernel.result_bytes = [math.prod(shape) * dtype.itemsize for shape, dtype in step.types]
  # out and lse are allocated as returned; max_logits, which the op drops, is scratch.
  assert [kind for kind, _ in step.buffers] == ["alloc", "scratch", "alloc"]
  assert plan.steps == [step]  # no torch op around the launch
  q = torch.randn(b, 1, h_q, 576).bfloat16()
  cache = torch.zeros(4, 64, 656, dtype=torch.uint8)
  idx = torch.randint(-1, 300, (b, 1, topk), dtype=torch.int32)
  out, lse = plan([q, cache, idx], 7)
  [(pointers, stream)] = kernel.launches
  assert stream == 7 and len(pointers) == 3 + 3
  assert pointers[:3] == [q.data_ptr(), idx.data_ptr(), cache.data_ptr()]
  assert out.shape == (b, 1, h_q, 512) and out.dtype == torch.bfloat16
  assert lse.shape == (b, h_q, 1) and lse.dtype == torch.float32
  assert out.data_ptr() in pointers[3:] and lse.data_ptr() in pointers[3:]
  assert (out.view(torch.uint8) == _RecordingKernel.FILL).all()
  assert (lse.view(torch.uint8) == _RecordingKernel.FILL).all()
  # A second call launches again, into new outputs.
  out2, _ = plan([q, cache, idx], 8)
  assert len(kernel.launches) == 2 and kernel.launches[1][0][:3] == pointers[:3]
  assert out2.data_ptr() != out.data_ptr()


def test_direct_plan_pads_without_reading_the_gpu(monkeypatch):
  """A program that pads a call's tensor (20 heads' sinks, padded to the kernel's 32
  heads with -inf) reads the padding value once, when the plan is made: a call never
  takes a value to the host (``.item()`` of a CUDA tensor waits for the GPU)."""
  h_q = 20
  plan = _decode_plan(2, h_q, 128, sink=True)
  [step] = plan.kernels
  step.kernel.result_bytes = [math.prod(shape) * dtype.itemsize for shape, dtype in step.types]

  def no_item(self):
    raise AssertionError("a plan call read a tensor's value on the host")

  rows, launch = [], step.kernel.launch

  def read_sinks(pointers, stream):  # the padded sinks (after q), while the call holds them
    rows.append(list((ctypes.c_float * 32).from_address(pointers[1])))
    launch(pointers, stream)

  monkeypatch.setattr(step.kernel, "launch", read_sinks)
  monkeypatch.setattr(torch.Tensor, "item", no_item)
  sink = torch.randn(h_q)
  plan([torch.randn(2, 1, h_q, 576).bfloat16(), torch.zeros(4, 64, 656, dtype=torch.uint8),
        torch.randint(-1, 256, (2, 1, 128), dtype=torch.int32), sink], 7)
  [row] = rows
  assert row[:h_q] == sink.tolist() and row[h_q:] == [-math.inf] * (32 - h_q)


@pytest.mark.parametrize("h_q", [64, 16])
def test_direct_plan_of_split_decode_keeps_the_parts_per_stream(h_q):
  """A split decode is two launches (the split kernel, the combine) and nothing else (16
  heads: the combine reads the kernel's padded per-head rows as they are, no slice
  copies); the parts pass between them in buffers kept per stream: the same memory on
  every call on one stream, other memory on another stream."""
  plan = _decode_plan(2, h_q, 256, num_splits=3)
  split, combine = plan.kernels
  assert plan.steps == [split, combine]
  assert [kind for kind, _ in split.buffers] == ["stream"] * 3
  assert [kind for kind, _ in combine.buffers] == ["alloc", "scratch", "alloc"]
  for step in (split, combine):
    step.kernel.result_bytes = [math.prod(shape) * dtype.itemsize for shape, dtype in step.types]
  args = [torch.randn(2, 1, h_q, 576).bfloat16(), torch.zeros(4, 64, 656, dtype=torch.uint8),
          torch.randint(-1, 256, (2, 1, 256), dtype=torch.int32)]
  for stream in (7, 7, 8):
    plan(args, stream)
  parts = [pointers[-3:] for pointers, _ in split.kernel.launches]
  assert parts[0] == parts[1] and not set(parts[0]) & set(parts[2])
  # The combine reads the parts (out, lse, max_logits) where the split kernel wrote them.
  for (pointers, _), written in zip(combine.kernel.launches, parts, strict=True):
    assert pointers[:3] == [written[0], written[2], written[1]]


@pytest.mark.parametrize(("num_splits", "h_q"), [(1, 128), (2, 128), (2, 16)])
def test_direct_plan_of_dense_decode(num_splits, h_q):
  """``mla_decode_paged`` on Mosaic GPU (128 heads; 16 on the transposed tile, whose
  padded LSE rows the combine reads as they are): its kernel, and the combine kernel
  when split, with nothing around them (the lengths are clipped in the kernel)."""
  pytest.importorskip("absl")
  from jax_mla.dense_decode import mosaic as dense_mosaic
  from torch_bridge import _direct
  config = dense_mosaic.Config(num_splits=num_splits)
  s = jax.ShapeDtypeStruct
  _, block, treedef = _direct.lowered_main(
      lambda q, kv, bt, sl: dense_mosaic.paged_decode(q, kv, bt, sl, sm_scale=0.1, causal=False,
                                                      config=config),
      [s((4, 1, h_q, 576), jnp.bfloat16), s((64, 64, 576), jnp.bfloat16), s((4, 16), jnp.int32),
       s((4,), jnp.int32)], None)
  plan = _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel)
  assert plan.steps == plan.kernels and len(plan.kernels) == num_splits


@pytest.mark.parametrize("num_splits", [1, 2])
def test_direct_plan_of_paged_attention(num_splits):
  """``paged_attention`` on Mosaic GPU with Python-number scales (bf16, head size 128):
  its kernel, and when split the Mosaic GPU combine, with nothing around them (the rows
  and lengths are read in the kernel, the scales are a constant)."""
  pytest.importorskip("absl")
  from jax_mla.paged import api as paged_api
  from jax_mla.paged import mosaic as paged_mosaic
  from torch_bridge import _direct
  config = paged_mosaic.Config(num_splits=num_splits)
  s = jax.ShapeDtypeStruct
  _, block, treedef = _direct.lowered_main(
      lambda q, k, v, bt, sl, sinks: paged_api._paged_attention(
          q, k, v, bt, sl, 0.1, 1.0, 1.0, sinks, None, None, 1.0, sliding_window=0,
          config=config, interpret=False, has_out_scale=False, static_scales=(0.1, 1.0, 1.0)),
      [s((4, 64, 128), jnp.bfloat16), s((40, 8, 16, 16, 8), jnp.bfloat16),
       s((40, 8, 128, 16), jnp.bfloat16), s((4, 10), jnp.int32), s((4,), jnp.int32),
       s((64,), jnp.float32)], None)
  plan = _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel)
  assert plan.steps == plan.kernels and len(plan.kernels) == num_splits


def test_direct_plan_of_sparse_prefill():
  """``flash_mla_sparse_fwd``'s program (``topk`` a multiple of 64, with or without
  ``topk_length``) is the prefill kernel alone; another ``topk`` has the index pre-pass
  and no plan."""
  pytest.importorskip("absl")
  from jax_mla.sparse_mla import api as sparse_api
  from jax_mla.sparse_mla import mosaic
  from torch_bridge import _direct
  s = jax.ShapeDtypeStruct
  structs = [s((8, 64, 576), jnp.bfloat16), s((1000, 576), jnp.bfloat16), s((8, 128), jnp.int32)]
  prefill = functools.partial(sparse_api._prefill, sm_scale=0.1, d_v=512, impl="mosaic",
                              config=mosaic.default_config(None, 64), interpret=False)
  for lengths in ([], [s((8,), jnp.int32)]):
    module, block, treedef = _direct.lowered_main(
        lambda q, kv, i, *n: prefill(q, kv, i, None, *(n or [None])), structs + lengths, None)
    plan = _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel)
    assert plan.steps == plan.kernels and len(plan.kernels) == 1
    del module
  odd = _direct.lowered_main(lambda q, kv, i: prefill(q, kv, i[:, :100], None, None), structs,
                             None)
  with pytest.raises(_direct.Unsupported, match="op stablehlo"):
    _direct.build(*odd[1:], torch.device("cpu"), _RecordingKernel)
  del odd


def test_direct_plan_of_sparse_prefill_with_shares_updates_in_place():
  """A 16-head prefill of the SMs' count plus 3 tokens (its last round shared out, then
  combined): the prefill and combine kernels, and the three updates of the tail rows in
  the prefill's own buffers (output, max logits, LSE), written where the combine's
  results belong and nowhere else."""
  pytest.importorskip("absl")
  from jax_mla import _mosaic
  from jax_mla.sparse_mla import api as sparse_api
  from jax_mla.sparse_mla import mosaic
  from torch_bridge import _direct
  tokens, tail = _mosaic.num_sms() + 3, 3
  s = jax.ShapeDtypeStruct
  prefill = functools.partial(sparse_api._prefill, sm_scale=0.1, d_v=512, impl="mosaic",
                              config=mosaic.default_config(None, 16), interpret=False)
  _, block, treedef = _direct.lowered_main(
      lambda q, kv, i: prefill(q, kv, i, None, None),
      [s((tokens, 16, 576), jnp.bfloat16), s((1000, 576), jnp.bfloat16),
       s((tokens, 1024), jnp.int32)], None)
  plan = _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel)
  assert len(plan.kernels) == 2 and plan.steps != plan.kernels
  for step, fill in zip(plan.kernels, (0x3F, 0x41), strict=True):
    step.kernel.result_bytes = [math.prod(shape) * dtype.itemsize for shape, dtype in step.types]
    step.kernel.FILL = fill
  out, max_logits, lse = plan([torch.zeros(tokens, 16, 576, dtype=torch.bfloat16),
                               torch.zeros(1000, 576, dtype=torch.bfloat16),
                               torch.zeros(tokens, 1024, dtype=torch.int32)], 0)
  assert out.shape == (tokens, 16, 512) and max_logits.shape == lse.shape == (tokens, 16)
  for x in (out, max_logits, lse):
    raw = x.contiguous().view(torch.uint8).reshape(tokens, -1)
    assert (raw[:-tail] == 0x3F).all() and (raw[-tail:] == 0x41).all()


@pytest.mark.parametrize("shape,index,words", [
    ((3, 64, 16), (slice(None), slice(0, 48)), True),  # the 48-head slice of 64
    ((2, 5, 12), (slice(None), slice(1, 4), slice(4, 12)), True),
    ((3, 7, 6), (slice(None), slice(1, 5)), False),  # rows of 12 bytes
    ((4, 5, 8), (slice(None), slice(None), slice(1, 5)), False),  # rows 2 bytes off a word
])
def test_direct_copies_are_bitwise_as_words_or_elements(shape, index, words):
  """The plan's copies of strided views (``_row_major_copy``, ``_pad``) equal torch's
  ``contiguous()`` and ``F.pad`` bit for bit, NaN payloads included: as 8-byte words where
  the rows are whole aligned words, element by element where they are not."""
  from torch_bridge import _direct
  bits = torch.randint(-2**15, 2**15, shape, dtype=torch.int16,
                       generator=torch.Generator().manual_seed(sum(shape)))
  x = bits.view(torch.bfloat16)[index]
  assert not x.is_contiguous() and (_direct._as_words(x) is not None) == words
  got = _direct._row_major_copy(x)
  assert got.is_contiguous() and torch.equal(got.view(torch.int16),
                                             x.contiguous().view(torch.int16))
  for low, high, value in (((0, 0, 0), (1, 16, 0), 0.0), ((0, 2, 0), (0, 1, 0), float("-inf")),
                           ((0, 0, 1), (0, 0, 2), 1.5)):
    pads = [p for lo, hi in zip(reversed(low), reversed(high), strict=True) for p in (lo, hi)]
    want = torch.nn.functional.pad(x, pads, value=value)
    assert torch.equal(_direct._pad(x, low, high, value).view(torch.int16),
                       want.view(torch.int16))


def test_direct_plan_refuses_updates_of_a_calls_tensor():
  """An update in place is for a kernel's own buffer: into a call's tensor, the program
  takes the PJRT path (a call leaves its tensors as they were)."""
  pytest.importorskip("absl")
  from torch_bridge import _direct
  s = jax.ShapeDtypeStruct
  _, block, treedef = _direct.lowered_main(
      lambda x, u: jax.lax.dynamic_update_slice(x, u, (2,)),
      [s((8,), jnp.float32), s((3,), jnp.float32)], None)
  with pytest.raises(_direct.Unsupported, match="update of a call's tensor"):
    _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel)


def test_direct_plan_refuses_updates_of_a_kernel_output_read_elsewhere():
  """An update through a view of a kernel's output that the program also returns would
  change the returned value: no plan."""
  pytest.importorskip("absl")
  from jax_mla import merge_mosaic
  from torch_bridge import _direct

  def update_and_return(o, lse, ml):
    out = merge_mosaic.combine(o, lse, ml, None, heads=8)[0]
    return jax.lax.dynamic_update_slice(out.reshape(-1), jnp.zeros((4,), out.dtype), (0,)), out

  s = jax.ShapeDtypeStruct
  _, block, treedef = _direct.lowered_main(
      update_and_return,
      [s((2, 8, 512), jnp.bfloat16), s((2, 8), jnp.float32), s((2, 8), jnp.float32)], None)
  with pytest.raises(_direct.Unsupported, match="read elsewhere"):
    _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel)


@pytest.mark.parametrize("lengths", [False, True])
def test_direct_plan_refuses_programs_with_other_work(lengths):
  """A topk that is not a multiple of 64 needs the index pre-pass (an XLA fusion): no
  plan, the call takes the PJRT path."""
  from torch_bridge import _direct
  with pytest.raises(_direct.Unsupported, match="op stablehlo"):
    _decode_plan(2, 64, 100, lengths)


def test_direct_plan_of_sparse_decode_with_lengths():
  """Per-request lengths with topk a multiple of 64: the kernel masks the positions past
  them itself, so the program is the kernel alone, reading the caller's lengths."""
  plan = _decode_plan(3, 64, 128, lengths=True)
  [step] = plan.kernels
  assert plan.steps == [step] and step.operands[0].slot == 3  # q, cache, indices, lengths


def _cache_write_program(fmt, num_tokens, latent_rows, nb=3, bs=16):
  """``(module, main's block, treedef, argument structs)`` of the Mosaic GPU cache write,
  lowered for CUDA on any machine (the block lives as long as the module)."""
  pytest.importorskip("absl")
  from jax_mla.cache import api as cache_api
  from jax_mla.cache.formats import resolve
  from torch_bridge import _direct
  s = jax.ShapeDtypeStruct
  nope = 512 if fmt == "fp8_ds_mla" else 448
  write = functools.partial(cache_api._write, scale=None, fmt=resolve(fmt), kernel="mosaic",
                            config=None, interpret=False)
  structs = [s((latent_rows, nope), jnp.bfloat16), s((latent_rows, 64), jnp.bfloat16),
             s(jcache.kv_cache_shape(nb, bs, nope + 64, fmt), jnp.uint8),
             s((num_tokens,), jnp.int32)]
  return (*_direct.lowered_main(lambda *a: write(*a), structs, None), structs)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_model1"])
def test_direct_plan_of_cache_write_is_in_place(fmt):
  """The Mosaic GPU cache write is one launch whose output is the caller's cache: made
  in place it writes and returns that very tensor; a plan that must leave its tensors
  as they were refuses the program."""
  from torch_bridge import _direct
  module, block, treedef, structs = _cache_write_program(fmt, num_tokens=5, latent_rows=7)
  plan = _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel, in_place=True)
  [step] = plan.kernels
  assert plan.steps == [step] and step.buffers == (("alias", 3),)
  kv_c, k_pe = (torch.randn(t.shape).bfloat16() for t in structs[:2])
  cache = torch.zeros(structs[2].shape, dtype=torch.uint8)
  slots = torch.arange(5, dtype=torch.int32)
  out = plan([kv_c, k_pe, cache, slots], 7)
  [(pointers, stream)] = step.kernel.launches
  assert stream == 7 and pointers == [slots.data_ptr(), kv_c.data_ptr(), k_pe.data_ptr(),
                                      cache.data_ptr(), cache.data_ptr()]
  assert out.data_ptr() == cache.data_ptr() and out.shape == cache.shape
  with pytest.raises(_direct.Unsupported, match="writes into a call's tensor"):
    _direct.build(block, treedef, torch.device("cpu"), _RecordingKernel)
  del module


def test_direct_launch_can_be_turned_off():
  previous = torch_bridge.set_direct_launch(False)
  try:
    assert torch_bridge.set_direct_launch(True) is False
  finally:
    torch_bridge.set_direct_launch(previous)


# ----------------------------------------------------------------------------
# GPU: zero-copy on CUDA and stream ordering both ways.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_round_trip_is_zero_copy(dtype):
  t = _sample(dtype, (64, 33), device="cuda")
  a = to_jax(t)
  assert a.unsafe_buffer_pointer() == t.data_ptr()
  assert next(iter(a.sharding.device_set)).platform == "gpu"
  back = to_torch(a)
  assert back.data_ptr() == t.data_ptr() and back.device == t.device
  np.testing.assert_array_equal(_bytes(back), _bytes(t))


def _long_torch_work(n=2048, iters=300):
  """Queues ~100 ms of matmuls on torch's current stream; returns its last result."""
  w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5
  x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
  for _ in range(iters):
    x = torch.tanh(x @ w)
  return x


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["to_jax", "ops", "ops_seen_before"])
def test_torch_to_jax_waits_for_torch_stream(path):
  side = torch.cuda.Stream()
  with torch.cuda.stream(side):  # a non-default torch stream, as in serving engines
    t = torch.zeros(1 << 20, device="cuda", dtype=torch.float32)
    if path == "ops_seen_before":  # t's view is cached: the fence tensor must order the call
      assert float(ops.lse2_to_lse(t).sum().item()) == 0.0
    torch.cuda.synchronize()
    busy = _long_torch_work()
    t.copy_(busy.float().flatten()[: t.numel()].abs() * 0 + 1)  # ones, after the matmuls
    if path == "to_jax":
      total = float(jnp.sum(to_jax(t)))
    else:
      total = float(ops.lse2_to_lse(t).sum().item() / np.log(2.0))
  assert total == pytest.approx(t.numel(), rel=1e-5)


@pytest.mark.gpu
def test_jax_to_torch_waits_for_jax_stream():
  n = 1 << 20

  @functools.partial(jax.jit, donate_argnums=1)
  def slow_fill(w, x):
    y = jax.lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ w), w)
    return x + 1.0 + 0.0 * y[0, 0].astype(jnp.float32)

  w = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.bfloat16) / 45.0
  slow_fill(w, jnp.zeros((n,), jnp.float32)).block_until_ready()  # compile
  for _ in range(3):
    # The output reuses the donated zeros, so a read before the loop ends sees 0s.
    x = jnp.zeros((n,), jnp.float32).block_until_ready()
    t = to_torch(slow_fill(w, x))  # the JAX loop is still running here
    assert t.sum().item() == n  # torch's stream waited for it on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_paged_attention_vllm_layout(fp8):
  """vLLM's caches from torch: the library's choice (the Mosaic GPU kernel on Hopper)
  through the bridge equals the same call from JAX, bit for bit, and the reference."""
  r = _rng(12)
  nb, hkv, bs, d, x = 12, 2, 16, 128, 16 if fp8 else 8
  dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
  q = _bf16(r.normal(size=(3, 16, d))).cuda()
  kc = torch.from_numpy(r.normal(size=(nb, hkv, d // x, bs, x)).astype(np.float32)).to(dtype).cuda()
  vc = torch.from_numpy(r.normal(size=(nb, hkv, d, bs)).astype(np.float32)).to(dtype).cuda()
  bt = _i32(r.permutation(nb)[:12].reshape(3, 4)).cuda()
  sl = _i32([50, 1, 64]).cuda()
  kw = dict(scale=d ** -0.5, k_scale=0.5, v_scale=0.25)
  out = ops.paged_attention(q, kc, vc, bt, sl, **kw)
  args = [to_jax(t) for t in (q, kc, vc, bt, sl)]
  _assert_same(out, jax_mla.paged_attention(*args, **kw))
  ref = np.asarray(jax_mla.paged_attention(*args, **kw, implementation="xla"), np.float32)
  assert rel_err(out.float().cpu().numpy(), ref) < 1e-2


# ----------------------------------------------------------------------------
# GPU with FlashMLA installed: FlashMLA's kernels against jax_mla on the same arguments.


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "fp8_model1"])
@pytest.mark.parametrize("impl", ["xla", None])
def test_flashmla_sparse_decode_matches_jax_mla(impl, kv_cache_dtype):
  pytest.importorskip("flash_mla")
  k = jax.random.split(jax.random.key(1), 8)
  b, s_q, h_q, topk, nb, bs = 4, 2, 64, 256, 64, 64
  idx = jax.random.randint(k[2], (b, s_q, topk), -1, nb * bs, jnp.int32)
  idx = idx.at[1, 0].set(-1)  # a query with no valid key
  sink = jax.random.normal(k[3], (h_q,), jnp.float32)
  kw = {"kv_cache_dtype": kv_cache_dtype, "attn_sink": sink}
  if kv_cache_dtype == "fp8_ds_mla":
    d = 576
    cache = jcache.quantize_fp8_ds_mla(
        jax.random.normal(k[0], (nb, bs, d), jnp.bfloat16), pow2_scales=True)
    # FlashMLA's sm90 V3.2 kernel takes no topk_length: shorter rows end in -1s.
    idx = jnp.where(jnp.arange(topk) < jnp.array([topk, 100, 7, 1])[:, None, None], idx, -1)
  else:  # DeepSeek V4: topk lengths and an extra key set with its own block size.
    d, enb, ebs, etopk = 512, 4, 256, 128
    cache = jcache.quantize_fp8_model1_cache(jax.random.normal(k[0], (nb, bs, d), jnp.bfloat16))
    eidx = jax.random.randint(k[4], (b, s_q, etopk), -1, enb * ebs, jnp.int32)
    kw |= {"topk_length": jnp.array([topk, 100, 7, 1], jnp.int32),
           "extra_kv_cache": jcache.quantize_fp8_model1_cache(
               jax.random.normal(k[5], (enb, ebs, d), jnp.bfloat16)),
           "extra_indices": eidx.at[1, 0].set(-1),
           "extra_topk_length": jnp.array([etopk, 0, 64, 5], jnp.int32)}
  q = jax.random.normal(k[1], (b, s_q, h_q, d), jnp.bfloat16)
  kw["sm_scale"] = d ** -0.5
  out, lse = flashmla.sparse_mla_decode(q, cache, idx, **kw)
  ref, ref_lse = sparse_mla.sparse_mla_decode(q, cache, idx, implementation=impl, **kw)
  assert out.shape == ref.shape and lse.shape == ref_lse.shape
  print(f"flashmla vs jax_mla sparse decode ({kv_cache_dtype}, {impl}): "
        f"out rel {rel_err(out, ref):.2e}")
  assert rel_err(out, ref) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_flashmla_dense_decode_and_sparse_prefill_match_jax_mla():
  pytest.importorskip("flash_mla")
  k = jax.random.split(jax.random.key(2), 6)
  b, s_q, h_q, nb, bs = 3, 1, 64, 24, 64
  q = jax.random.normal(k[0], (b, s_q, h_q, 576), jnp.bfloat16)
  kv = jax.random.normal(k[1], (nb, bs, 576), jnp.bfloat16)
  bt = jax.random.permutation(k[2], nb).astype(jnp.int32).reshape(b, nb // b)
  sl = jnp.array([1, 300, 512], jnp.int32)
  out, lse = flashmla.mla_decode_paged(q, kv, bt, sl, sm_scale=0.05)
  ref, ref_lse = jax_mla.mla_decode_paged(q, kv, bt, sl, sm_scale=0.05)
  print(f"flashmla vs jax_mla dense decode: out rel {rel_err(out, ref):.2e}")
  assert rel_err(out, ref) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-3, atol=1e-3)

  s_q, s_kv, topk = 64, 2048, 128
  qp = jax.random.normal(k[3], (s_q, h_q, 576), jnp.bfloat16)
  kvp = jax.random.normal(k[4], (s_kv, 1, 576), jnp.bfloat16)
  ip = jax.random.randint(k[5], (s_q, 1, topk), -1, s_kv, jnp.int32)
  got = flashmla.sparse_mla_prefill(qp, kvp, ip, sm_scale=0.05)
  want = sparse_mla.sparse_mla_prefill(qp, kvp, ip, sm_scale=0.05)
  print(f"flashmla vs jax_mla sparse prefill: out rel {rel_err(got[0], want[0]):.2e}")
  assert rel_err(got[0], want[0]) < 1e-2
  for g, w in zip(got[1:], want[1:], strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------
# GPU: direct launch (Mosaic GPU kernels on torch's stream, no PJRT).


def _direct_decode_inputs(kv_cache_dtype, h_q, b=3, s_q=2, topk=256, nb=16):
  """Torch CUDA tensors for a sparse decode: q, the cache in ``kv_cache_dtype`` and
  indices with invalid (-1), out-of-range and all-invalid rows."""
  k = jax.random.split(jax.random.key(5), 3)
  d = 512 if kv_cache_dtype == "fp8_model1" else 576
  latent = jax.random.normal(k[0], (nb, 64, d), jnp.bfloat16)
  cache = {"fp8_ds_mla": jcache.quantize_fp8_ds_mla, "fp8_model1": jcache.quantize_fp8_model1_cache,
           "auto": lambda x: x}[kv_cache_dtype](latent)
  idx = jax.random.randint(k[1], (b, s_q, topk), -1, nb * 64 + 50, jnp.int32)
  idx = idx.at[1, 0].set(-1)
  q = jax.random.normal(k[2], (b, s_q, h_q, d), jnp.bfloat16)
  return tuple(to_torch(a).to("cuda").clone() for a in (q, cache, idx))


@pytest.mark.gpu
@pytest.mark.parametrize(("kv_cache_dtype", "h_q", "launches"),
                         [("fp8_ds_mla", 128, 2), ("fp8_ds_mla", 16, 2), ("fp8_model1", 64, 2),
                          ("auto", 48, 2)])
def test_direct_launch_matches_pjrt_and_the_reference(kv_cache_dtype, h_q, launches,
                                                      monkeypatch):
  """The sparse decode launched directly on torch's stream: the same bits as the PJRT
  path (the same kernels), and the reference's values. 6 tokens of 4 key steps split
  in two (then the combine kernel), on the head-block kernel or, for 16 heads, the
  transposed one."""
  from torch_bridge import _direct
  plans = []
  run = _direct.Plan.__call__
  monkeypatch.setattr(_direct.Plan, "__call__",
                      lambda self, *a: plans.append(self) or run(self, *a))
  q, cache, idx = _direct_decode_inputs(kv_cache_dtype, h_q)
  kw = dict(kv_cache_dtype=kv_cache_dtype, sm_scale=q.shape[-1] ** -0.5)
  assert torch_bridge.set_direct_launch(True)
  out, lse = ops.sparse_mla_decode(q, cache, idx, **kw)
  assert len(plans) == 1 and len(plans[0].kernels) == launches
  torch_bridge.set_direct_launch(False)
  try:
    pjrt_out, pjrt_lse = ops.sparse_mla_decode(q, cache, idx, **kw)
  finally:
    torch_bridge.set_direct_launch(True)
  assert len(plans) == 1
  assert out.shape == pjrt_out.shape and lse.shape == pjrt_lse.shape
  assert out.stride() == pjrt_out.stride() and lse.stride() == pjrt_lse.stride()
  assert torch.equal(out, pjrt_out) and torch.equal(lse, pjrt_lse)
  ref, ref_lse = sparse_mla.sparse_mla_decode(to_jax(q), to_jax(cache), to_jax(idx),
                                              implementation="xla", **kw)
  assert rel_err(to_jax(out), ref) < 1e-2
  np.testing.assert_allclose(lse.cpu().numpy(), np.asarray(ref_lse), rtol=1e-3, atol=1e-3)
  assert torch.isinf(lse[1, :, 0]).all() and not out[1, 0].any()  # the row with no key


@pytest.mark.gpu
def test_direct_launch_of_prefill_with_shares_matches_pjrt(monkeypatch):
  """A 16-head prefill of the SMs' count plus 3 tokens (the last round shared out,
  combined, and the tail rows updated in the prefill's buffers) launched directly: the
  same bits as the PJRT path."""
  from jax_mla import _mosaic
  from torch_bridge import _direct
  plans = []
  run = _direct.Plan.__call__
  monkeypatch.setattr(_direct.Plan, "__call__",
                      lambda self, *a: plans.append(self) or run(self, *a))
  tokens, s_kv = _mosaic.num_sms() + 3, 4096
  g = torch.Generator().manual_seed(0)
  q = (torch.randn(tokens, 16, 576, generator=g) / 3).bfloat16().cuda()
  kv = (torch.randn(s_kv, 576, generator=g) / 3).bfloat16().cuda()
  idx = torch.randint(-1, s_kv, (tokens, 1024), generator=g, dtype=torch.int32).cuda()
  assert torch_bridge.set_direct_launch(True)
  direct = ops.sparse_mla_prefill(q, kv, idx, sm_scale=0.07)
  assert len(plans) == 1 and len(plans[0].kernels) == 2
  torch_bridge.set_direct_launch(False)
  try:
    pjrt = ops.sparse_mla_prefill(q, kv, idx, sm_scale=0.07)
  finally:
    torch_bridge.set_direct_launch(True)
  for a, b in zip(direct, pjrt, strict=True):
    assert a.shape == b.shape and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 200])
def test_direct_launch_of_dense_decode_matches_pjrt_and_the_reference(batch, monkeypatch):
  """``mla_decode_paged`` (128 heads, FlashMLA's dense drop-in): split and combined at
  batch 2, one split at 200; empty and over-long sequences."""
  from torch_bridge import _direct
  plans = []
  run = _direct.Plan.__call__
  monkeypatch.setattr(_direct.Plan, "__call__",
                      lambda self, *a: plans.append(self) or run(self, *a))
  k = jax.random.split(jax.random.key(7), 3)
  nb = 16 * batch
  q = jax.random.normal(k[0], (batch, 1, 128, 576), jnp.bfloat16)
  kv = jax.random.normal(k[1], (nb, 64, 576), jnp.bfloat16)
  bt = jax.random.permutation(k[2], nb).astype(jnp.int32).reshape(batch, 16)
  sl = jnp.tile(jnp.array([300, 0, 1024, 10_000], jnp.int32), batch)[:batch]
  args = [to_torch(a).to("cuda").clone() for a in (q, kv, bt, sl)]
  out, lse = ops.mla_decode_paged(*args, sm_scale=0.05)
  assert len(plans) == 1
  torch_bridge.set_direct_launch(False)
  try:
    pjrt = ops.mla_decode_paged(*args, sm_scale=0.05)
  finally:
    torch_bridge.set_direct_launch(True)
  assert torch.equal(out, pjrt[0]) and torch.equal(lse, pjrt[1])
  ref, ref_lse = jax_mla.mla_decode_paged(q, kv, bt, sl, sm_scale=0.05, implementation="xla")
  assert rel_err(to_jax(out), ref) < 1e-2
  np.testing.assert_allclose(lse.cpu().numpy(), np.asarray(ref_lse), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "widths"), [("fp8_ds_mla", (512, 64)), ("fp8_model1", (448, 64)),
                                             ("fp8_model1", (512, 0)), ("auto", (512, 64)),
                                             ("fp8", (512, 64)), ("fp8_v41", (448, 64)),
                                             ("fp4_v41", (512, 0))])
def test_direct_cache_write_in_place(fmt, widths, monkeypatch):
  """On Hopper the bridge's write is the Mosaic GPU writer launched on torch's stream into
  the cache's own memory: byte-exact with jax_mla's reference writer, from vLLM's strided
  kv_c / k_pe slices and int64 slots, the cache's memory unchanged and nothing waited for."""
  from jax_mla import _mosaic
  from torch_bridge import _direct
  if not _mosaic.on_hopper():
    pytest.skip("needs a Hopper GPU and jax >= 0.11 (Mosaic GPU)")
  plans = []
  run = _direct.Plan.__call__
  monkeypatch.setattr(_direct.Plan, "__call__",
                      lambda self, *a: plans.append(self) or run(self, *a))
  r = _rng(17)
  T = 40
  kv = torch.from_numpy(r.normal(size=(T, sum(widths) + 8)).astype(np.float32)).bfloat16()
  kv = kv.cuda()
  kv_c, k_pe = kv[:, :widths[0]], kv[:, widths[0]:sum(widths)]  # strided, as vLLM's
  shape = jcache.kv_cache_shape(5, 16, sum(widths), fmt)
  before = torch.from_numpy(r.integers(0, 256, shape).astype(np.uint8))
  if fmt == "auto":
    before = torch.from_numpy(r.normal(size=shape).astype(np.float32)).bfloat16()
  slots = r.permutation(80)[:T - 3].astype(np.int64)
  slots[[0, 5]] = (-1, 80)  # skipped
  scale = 0.3 if fmt == "fp8" else None
  ref = jcache.concat_and_cache_mla(to_jax(kv_c.contiguous().cpu()),
                                    to_jax(k_pe.contiguous().cpu()), to_jax(before.clone()),
                                    jnp.asarray(slots, jnp.int32), kv_cache_dtype=fmt,
                                    scale=scale, implementation="xla")
  kv_cache = before.cuda()
  ptr = kv_cache.data_ptr()
  for _ in range(2):  # the second call reuses the plan
    out = ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, torch.from_numpy(slots).cuda(), fmt,
                                   scale)
  assert out is kv_cache and kv_cache.data_ptr() == ptr
  assert len(plans) == 2 and plans[0] is plans[1] and plans[0].in_place
  np.testing.assert_array_equal(kv_cache.cpu().view(torch.uint8).numpy(),
                                np.asarray(ref).view(np.uint8))


@pytest.mark.gpu
def test_direct_launch_under_cuda_graph_capture():
  """vLLM captures its decode steps in CUDA graphs: the direct launches (a split decode:
  two kernels; the in-place cache write) are captured like torch's own, and a replay
  recomputes them from the inputs' new values."""
  from jax_mla import _mosaic
  if not _mosaic.on_hopper():
    pytest.skip("needs a Hopper GPU and jax >= 0.11 (Mosaic GPU)")
  q, cache, idx = _direct_decode_inputs("fp8_ds_mla", 128, s_q=1)
  kw = dict(kv_cache_dtype="fp8_ds_mla", sm_scale=0.05)
  kv = torch.randn(3, 576, device="cuda").bfloat16()
  slots = torch.tensor([5, 70, 300], dtype=torch.int32, device="cuda")

  def step():
    ops.concat_and_cache_mla(kv[:, :512], kv[:, 512:], cache, slots, "fp8_ds_mla")
    return ops.sparse_mla_decode(q, cache, idx, **kw)

  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):  # plans made, kernels loaded: nothing left to do at capture
    step()
  torch.cuda.current_stream().wait_stream(side)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    out, lse = step()
  new_q, new_idx = _direct_decode_inputs("fp8_ds_mla", 128, s_q=1, topk=256)[::2]
  q.copy_(new_q.flip(2))
  idx.copy_(new_idx.flip(2))
  kv.mul_(-2)
  graph.replay()
  torch.cuda.synchronize()
  want_cache = cache.clone()
  want = ops.sparse_mla_decode(q, want_cache, idx, **kw)
  assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
  ops.concat_and_cache_mla(kv[:, :512], kv[:, 512:], want_cache, slots, "fp8_ds_mla")
  assert torch.equal(cache, want_cache)  # the replay wrote the new latents


@pytest.mark.gpu
def test_direct_launch_is_ordered_by_torchs_stream_and_never_waits():
  """On a side stream busy with a sleep and then the write of q, the launch reads the
  written q, and the call returns while the stream is still busy."""
  q, cache, idx = _direct_decode_inputs("fp8_ds_mla", 64, s_q=1)
  kw = dict(kv_cache_dtype="fp8_ds_mla", sm_scale=0.05)
  want = ops.sparse_mla_decode(q, cache, idx, **kw)  # also makes the plan
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):
    q_late = torch.zeros_like(q)
    torch.cuda._sleep(200_000_000)
    q_late.copy_(q)
    got = ops.sparse_mla_decode(q_late, cache, idx, **kw)
    busy = not side.query()
  torch.cuda.synchronize()
  assert busy
  assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
