"""paged_attention: Pallas kernel vs the jax.numpy reference, reference vs numpy.

Caches are built from dense per-sequence keys/values and every slot not written
(tail of the last block, unused blocks) holds NaN, so any read past ``seq_len``
shows up as NaN in the output.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import rel_err

from jax_mla._common import FP8_E4M3_MAX
from jax_mla.paged import mosaic, paged_attention
from jax_mla.paged.triton import Config, default_num_kv_splits

FP8 = jnp.float8_e4m3fn


def _cast(x, dtype):
  """Rounds on the host (to float32 first, as ``jnp.asarray`` does): on a GPU each
  ``jnp.asarray`` of a new shape would be one more compile."""
  return np.asarray(x, np.float32).astype(jnp.dtype(dtype))


@dataclasses.dataclass
class Case:
  query: np.ndarray
  key_cache: np.ndarray
  value_cache: np.ndarray
  block_tables: np.ndarray
  seq_lens: np.ndarray
  dense_k: list  # per sequence [L, Hkv, D] float64 (dequantised)
  dense_v: list
  query_start_loc: np.ndarray | None
  kwargs: dict


def make_case(seed, seq_lens, *, hq=4, hkv=2, d=32, bs=16, layout="vllm", dtype=jnp.bfloat16,
              fp8_kv=False, query_lens=None, sinks=False, alibi=False, window=0,
              out_scale=None, fp8_dtype=FP8):
  rng = np.random.default_rng(seed)
  num_seqs = len(seq_lens)
  blocks_per_seq = [-(-n // bs) for n in seq_lens]
  max_blocks = max(max(blocks_per_seq), 1) + 1  # one spare column past every sequence
  num_blocks = sum(blocks_per_seq) + 3
  perm = rng.permutation(num_blocks)
  # Unused table entries point at other sequences' blocks: reading them would be a bug.
  block_tables = rng.integers(0, num_blocks, (num_seqs, max_blocks)).astype(np.int32)
  kv_dtype = fp8_dtype if fp8_kv else dtype
  k_scale, v_scale = (0.05, 0.03) if fp8_kv else (1.0, 1.0)
  kc = np.full((num_blocks, hkv, bs, d), np.nan, np.float32)
  vc = np.full((num_blocks, hkv, bs, d), np.nan, np.float32)
  dense_k, dense_v, used = [], [], 0
  for s, n in enumerate(seq_lens):
    k = _cast(rng.standard_normal((n, hkv, d)) * 0.7 / k_scale, kv_dtype).astype(np.float32)
    v = _cast(rng.standard_normal((n, hkv, d)) / v_scale, kv_dtype).astype(np.float32)
    dense_k.append(k.astype(np.float64) * k_scale)
    dense_v.append(v.astype(np.float64) * v_scale)
    for b in range(blocks_per_seq[s]):
      block_tables[s, b] = perm[used]
      used += 1
    for t in range(n):
      kc[block_tables[s, t // bs], :, t % bs] = k[t]
      vc[block_tables[s, t // bs], :, t % bs] = v[t]
  x = 16 // jnp.dtype(kv_dtype).itemsize
  if layout == "vllm":  # K [nb, Hkv, D//x, bs, x], V [nb, Hkv, D, bs]
    kc = kc.reshape(num_blocks, hkv, bs, d // x, x).transpose(0, 1, 3, 2, 4)
    vc = vc.transpose(0, 1, 3, 2)
  if query_lens is None:
    qsl, num_tokens = None, num_seqs
  else:
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + 1  # one trailing row that belongs to no sequence
  query = _cast(rng.standard_normal((num_tokens, hq, d)), dtype)
  kwargs = dict(scale=1.0 / np.sqrt(d), k_scale=k_scale, v_scale=v_scale,
                sliding_window=window)
  if sinks:
    kwargs["sinks"] = jax.device_put(_cast(rng.standard_normal(hq) * 2.0, jnp.float32))
  if alibi:
    kwargs["alibi_slopes"] = jax.device_put(_cast(2.0 ** (-np.arange(1, hq + 1) / 2.0),
                                                  jnp.float32))
  if out_scale is not None:
    kwargs["out_scale"] = out_scale
  return Case(query, _cast(kc, kv_dtype), _cast(vc, kv_dtype), block_tables,
              np.asarray(seq_lens, np.int32), dense_k, dense_v, qsl, kwargs)


def run(case, **kw):
  # device_put, not jnp.asarray: no compile per shape on a GPU.
  qsl = None if case.query_start_loc is None else jax.device_put(case.query_start_loc)
  return paged_attention(*jax.device_put((case.query, case.key_cache, case.value_cache,
                                          case.block_tables, case.seq_lens)),
                         query_start_loc=qsl, **case.kwargs, **kw)


def numpy_oracle(case, masked_positions=()):
  """Dense float64 softmax over exactly the keys each sequence attends."""
  kw = {k: np.asarray(v) if k in ("sinks", "alibi_slopes") else v
        for k, v in case.kwargs.items()}
  q = case.query.astype(np.float64)
  num_tokens, hq, d = q.shape
  hkv = case.dense_k[0].shape[1] if case.dense_k else 1
  out = np.zeros((num_tokens, hq, d))
  for s, n in enumerate(case.seq_lens):
    if case.query_start_loc is None:
      row = s
    else:
      row = case.query_start_loc[s]
      if case.query_start_loc[s + 1] - row != 1:
        continue
    pos = np.arange(n)
    keep = np.ones(n, bool)
    if kw["sliding_window"]:
      keep &= (n - 1 - pos) < kw["sliding_window"]
    for sp, p in masked_positions:
      if sp == s:
        keep &= pos != p
    for h in range(hq):
      kv = h // (hq // hkv)
      k, v = case.dense_k[s][keep, kv], case.dense_v[s][keep, kv]
      logits = kw["scale"] * (k @ q[row, h])
      if "alibi_slopes" in kw:
        logits = logits + float(kw["alibi_slopes"][h]) * (pos[keep] - (n - 1))
      parts = [logits]
      if "sinks" in kw:
        parts.append([float(kw["sinks"][h])])
      allv = np.concatenate(parts)
      if allv.size == 0:
        continue
      w = np.exp(allv - allv.max())
      out[row, h] = (w[:logits.size] @ v) / w.sum()
  if "out_scale" in kw:
    out = np.clip(out / kw["out_scale"], -FP8_E4M3_MAX, FP8_E4M3_MAX)
    out = out.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return out


def f32(x):
  return np.asarray(x).astype(np.float32)


FEATURES = {
    "plain": dict(),
    "gqa8": dict(hq=16, hkv=2),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "window": dict(window=20),
    "fp8_kv": dict(fp8_kv=True),
    "fp8_out": dict(out_scale=0.02),
    "query_start_loc": dict(query_lens=[1, 3, 1, 0]),
    "all": dict(hq=6, hkv=2, alibi=True, sinks=True, window=33, fp8_kv=True, out_scale=0.02,
                query_lens=[1, 1, 2, 1]),
}
SEQ_LENS = [0, 1, 37, 70]  # other tests reuse these shapes (and compiles) where they can
# Both cache layouts for a few features, the vLLM one for the rest (keeps CI fast).
CASES = [(f, "vllm") for f in FEATURES] + [(f, "flat") for f in ("plain", "fp8_kv", "all")]


@pytest.mark.parametrize("feature,layout", [
    # fp8 outputs are rounded by the device: those cases also run in the GPU suite.
    pytest.param(f, lay, marks=() if "out_scale" in FEATURES[f] else pytest.mark.cpu_only)
    for f, lay in CASES])
def test_reference_matches_numpy(feature, layout):
  case = make_case(1, SEQ_LENS, layout=layout, **FEATURES[feature])
  out = run(case, implementation="xla")
  want = numpy_oracle(case)
  tol = 0.07 if "out_scale" in case.kwargs else 2e-3  # one fp8 step vs bf16 rounding
  assert rel_err(f32(out), want) < tol
  assert out.dtype == (FP8 if "out_scale" in case.kwargs else jnp.bfloat16)


# The kernel tests compare with the numpy oracle, which the reference tests (CPU suite)
# compare the reference with: on a GPU only the kernels compile.


@pytest.mark.parametrize("feature,layout", CASES)
def test_kernel_matches_reference(feature, layout, interpret):
  case = make_case(2, SEQ_LENS, layout=layout, **FEATURES[feature])
  want = numpy_oracle(case)
  out = f32(run(case, implementation="triton", interpret=interpret))
  assert np.isfinite(out).all()
  tol = 0.07 if "out_scale" in case.kwargs else 1e-2
  assert rel_err(out, want) < tol
  # seq_len 0 gives exactly 0; rows of skipped (prefill) sequences too.
  assert (out[want == 0] == 0).all()
  assert (out[0] == 0).all()


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.cpu_only), "pallas"])
def test_skipped_rows_are_zero(impl, interpret):  # "pallas": the old name of "triton"
  # The shapes of the "query_start_loc" case: the same compiles.
  case = make_case(3, SEQ_LENS, query_lens=[2, 1, 2, 0])
  out = f32(run(case, implementation=impl, interpret=interpret))
  zero_rows = [0, 1, 3, 4, 5]  # prefill rows and the trailing row of no sequence
  assert (out[zero_rows] == 0).all()
  assert np.abs(out[2]).sum() > 0


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("tokens,out_scale", [(0, None), (3, None), (3, 0.5)])
def test_no_sequence(impl, interpret, tokens, out_scale):
  """An empty batch (no sequence; tokens of none with ``query_start_loc``) gives zeros of
  the output dtype without a kernel launch."""
  cache = jnp.zeros((4, 2, 16, 128), jnp.bfloat16)
  out = paged_attention(
      jnp.ones((tokens, 8, 128), jnp.bfloat16), cache, cache, jnp.zeros((0, 3), jnp.int32),
      jnp.zeros((0,), jnp.int32), scale=0.1, out_scale=out_scale,
      query_start_loc=jnp.zeros((1,), jnp.int32) if tokens else None,
      implementation=impl, interpret=interpret and impl == "triton")
  assert out.shape == (tokens, 8, 128)
  assert out.dtype == (jnp.bfloat16 if out_scale is None else jnp.float8_e4m3fn)
  assert not np.asarray(out, np.float32).any()


# name: (make_case arguments, the kernel's extra arguments)
EDGE_CASES = {
    "kv_splits": (dict(seed=4, seq_lens=[1, 150, 129], sinks=True), dict(num_kv_splits=3)),
    # Window edge at a tile edge (64-token tiles) and one past it; wider than sequence 1.
    "window64": (dict(seed=5, seq_lens=[200, 40], window=64, hkv=1, hq=2),
                 dict(num_kv_splits=2)),
    "window65": (dict(seed=5, seq_lens=[200, 40], window=65, hkv=1, hq=2),
                 dict(num_kv_splits=2)),
    # Blocks of 544 tokens: 1088 tokens fill 2, the table has 3 columns.
    "block544": (dict(seed=6, seq_lens=[600, 1, 1088], hq=2, hkv=1, d=16, bs=544, sinks=True),
                 dict(physical_block_size=544)),
    "head80_vllm": (dict(seed=7, seq_lens=[1, 45], d=80, layout="vllm", alibi=True), {}),
    "head80_flat": (dict(seed=7, seq_lens=[1, 45], d=80, layout="flat", alibi=True), {}),
    "head256_vllm": (dict(seed=7, seq_lens=[1, 45], d=256, layout="vllm", alibi=True), {}),
    # D == bs: V layout follows K (4-D K -> token-major V, 5-D K -> dim-major V).
    "f32_square_vllm": (dict(seed=9, seq_lens=[30, 17], d=16, bs=16, layout="vllm",
                             dtype=jnp.float32), {}),
    "f32_square_flat": (dict(seed=9, seq_lens=[30, 17], d=16, bs=16, layout="flat",
                             dtype=jnp.float32), {}),
}


@pytest.mark.cpu_only
@pytest.mark.parametrize("name", [n for n in EDGE_CASES if n != "kv_splits"])  # the kernel's
def test_reference_edge_cases(name):
  case = make_case(**EDGE_CASES[name][0])
  tol = 1e-5 if case.query.dtype == np.float32 else 2e-3
  assert rel_err(f32(run(case, implementation="xla")), numpy_oracle(case)) < tol


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_kernel_edge_cases(name, interpret):
  case_kw, kernel_kw = EDGE_CASES[name]
  case = make_case(**case_kw)
  out = f32(run(case, implementation="triton", interpret=interpret, **kernel_kw))
  tol = 1e-3 if case.query.dtype == np.float32 else 1e-2
  assert rel_err(out, numpy_oracle(case)) < tol


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.cpu_only), "triton"])
def test_invalid_block_ids_are_masked(impl, interpret):
  case = make_case(8, SEQ_LENS)  # the "plain" case's shapes: the same compiles
  case.block_tables[2, 1] = -1  # tokens 16..31 of sequence 2
  case.block_tables[3, 0] = 2**31 - 1  # tokens 0..15 of sequence 3
  want = numpy_oracle(case, masked_positions=[(2, p) for p in range(16, 32)]
                      + [(3, p) for p in range(16)])
  out = f32(run(case, implementation=impl, interpret=interpret))
  assert rel_err(out, want) < (2e-3 if impl == "xla" else 1e-2)


def test_jit_with_traced_scales(interpret):
  case = make_case(10, [12, 33], fp8_kv=True)
  kw = {k: v for k, v in case.kwargs.items() if k not in ("scale", "k_scale", "v_scale")}

  @jax.jit
  def f(scale, k_scale, v_scale):
    return paged_attention(jnp.asarray(case.query), jnp.asarray(case.key_cache),
                           jnp.asarray(case.value_cache), jnp.asarray(case.block_tables),
                           jnp.asarray(case.seq_lens), scale=scale, k_scale=k_scale,
                           v_scale=v_scale, implementation="triton", interpret=interpret, **kw)

  out = f32(f(case.kwargs["scale"], case.kwargs["k_scale"], case.kwargs["v_scale"]))
  assert rel_err(out, numpy_oracle(case)) < 1e-2


@pytest.mark.cpu_only
def test_default_num_kv_splits():
  assert default_num_kv_splits(128, 8, 64, 132) == 1  # 1024 programs already fill 132 SMs
  assert default_num_kv_splits(2, 8, 512, 132) == 32  # 512 programs
  assert default_num_kv_splits(2, 8, 4, 132) == 1  # too short to split


@pytest.mark.cpu_only
def test_validation():
  case = make_case(11, [5, 9])
  args = [jnp.asarray(a) for a in (case.query, case.key_cache, case.value_cache,
                                   case.block_tables, case.seq_lens)]

  def call(*a, **kw):
    return paged_attention(*a, **{"scale": 0.1, "implementation": "xla", **kw})

  with pytest.raises(ValueError, match="query must have rank 3"):
    call(args[0][None], *args[1:])
  with pytest.raises(TypeError, match="block_tables must have an integer dtype"):
    call(*args[:3], args[3].astype(jnp.float32), args[4])
  with pytest.raises(TypeError, match="value_cache must have dtype"):
    call(args[0], args[1], args[2].astype(jnp.float32), *args[3:])
  with pytest.raises(ValueError, match="value_cache must have shape"):
    call(args[0], args[1], args[2][..., :8], *args[3:])
  with pytest.raises(ValueError, match="head size"):
    call(args[0][..., :16], *args[1:])
  with pytest.raises(ValueError, match="one row per sequence"):
    call(args[0][:1], *args[1:])
  with pytest.raises(ValueError, match="physical_block_size"):
    call(*args, physical_block_size=32)
  with pytest.raises(ValueError, match="sinks must have shape"):
    call(*args, sinks=jnp.zeros((3,), jnp.float32))
  with pytest.raises(ValueError, match="multiple of kv heads"):
    call(args[0][:, :3], *args[1:])
  with pytest.raises(TypeError, match="config"):
    call(*args, config=object(), implementation="triton", interpret=True)


@pytest.mark.cpu_only  # the cast is host code
def test_int64_metadata_is_cast(interpret):
  case = make_case(12, [5, 40, 9], query_lens=[1, 1, 2])
  want = f32(run(case, implementation="triton", interpret=interpret))
  got = f32(paged_attention(
      jnp.asarray(case.query), jnp.asarray(case.key_cache), jnp.asarray(case.value_cache),
      case.block_tables.astype(np.int64), case.seq_lens.astype(np.int64),
      query_start_loc=case.query_start_loc.astype(np.int64), **case.kwargs,
      implementation="triton", interpret=interpret))
  np.testing.assert_array_equal(got, want)


def test_config(interpret):
  case = make_case(13, [1, 150, 129], sinks=True)
  out = f32(run(case, implementation="triton", interpret=interpret,
                config=Config(block_n=16, num_warps=2, num_stages=1, num_splits=5)))
  assert rel_err(out, numpy_oracle(case)) < 1e-2
  with pytest.raises(ValueError, match="block_n"):
    Config(block_n=24)


@pytest.mark.cpu_only
def test_checks_raise_eagerly():
  case = make_case(14, [5, 40])
  nb, bs = case.key_cache.shape[0], 16
  cap = case.block_tables.shape[1] * bs
  run(case, implementation="xla", checks=True)  # ids past each sequence may be anything
  bad_id = case.block_tables.copy()
  bad_id[1, 2] = nb  # sequence 1 uses blocks 0..2
  neg_id = case.block_tables.copy()
  neg_id[0, 0] = -1
  for match, bt, lens in [
      ("seq_lens must be >= 0", case.block_tables, np.array([5, -1], np.int32)),
      ("seq_lens must be <=", case.block_tables, np.array([5, cap + 1], np.int32)),
      ("block_tables ids used", bad_id, case.seq_lens),
      ("block_tables ids used", neg_id, case.seq_lens),
  ]:
    with pytest.raises(ValueError, match=match):
      paged_attention(jnp.asarray(case.query), jnp.asarray(case.key_cache),
                      jnp.asarray(case.value_cache), jnp.asarray(bt), jnp.asarray(lens),
                      **case.kwargs, checks=True, implementation="xla")


# --- the Mosaic GPU kernel (Hopper): checked on the GPU, its lowering and checks on the CPU.

# name: (make_case arguments, the kernel's extra arguments); what the kernel takes: bf16 or
# fp16, vLLM's layout, head sizes a multiple of 32, blocks a multiple of 16, groups <= 16.
MOSAIC_CASES = {
    **{f: (dict(seed=20, seq_lens=SEQ_LENS, **FEATURES[f]), {})
       for f in ("plain", "gqa8", "alibi", "sinks", "window", "fp8_out", "query_start_loc")},
    "all": (dict(seed=21, seq_lens=SEQ_LENS, hq=6, hkv=2, alibi=True, sinks=True, window=33,
                 out_scale=0.02, query_lens=[1, 1, 2, 1]), {}),
    "kv_splits": EDGE_CASES["kv_splits"],
    "window64": EDGE_CASES["window64"],
    "window65": EDGE_CASES["window65"],
    "head256": (dict(seed=22, seq_lens=[1, 45], d=256, alibi=True), {}),
    # 16 heads a KV head fill the mma's rows; 12 leave rows 12..15 of the second half.
    "group16": (dict(seed=23, seq_lens=[3, 77, 16], hq=32, hkv=2, d=128, sinks=True), {}),
    "group12": (dict(seed=24, seq_lens=[3, 77, 16], hq=24, hkv=2, d=64), dict(num_kv_splits=2)),
    # Groups past 16 take several warps, adjacent: 32 in two full blocks, 20 in 16 + 4.
    "group32": (dict(seed=34, seq_lens=[3, 77, 16], hq=64, hkv=2, d=64, sinks=True), {}),
    "group20_fp8": (dict(seed=35, seq_lens=[50, 1], hq=20, hkv=1, d=64, fp8_kv=True, alibi=True),
                    dict(num_kv_splits=2)),
    "group1_fp16": (dict(seed=25, seq_lens=[40, 1], hq=3, hkv=3, d=96, dtype=jnp.float16), {}),
    # Blocks of 48 tokens (3 steps each), a sequence ending mid-step and one long enough
    # for many steps per split.
    "block48": (dict(seed=26, seq_lens=[100, 47, 700], hq=8, hkv=1, d=64, bs=48, sinks=True),
                dict(num_kv_splits=3)),
    "splits_past_steps": (dict(seed=27, seq_lens=[20, 5], hq=8, hkv=2, d=32),
                          dict(num_kv_splits=8)),
    # Steps loaded ahead in twos and fours; a split's last iteration runs past its steps.
    "unroll2": (dict(seed=26, seq_lens=[100, 47, 700], hq=8, hkv=1, d=64, bs=48, sinks=True),
                dict(config=mosaic.Config(num_splits=3, unroll=2))),
    "unroll4_window": (dict(seed=33, seq_lens=[200, 40, 3], hq=4, hkv=2, d=128, window=65,
                            alibi=True), dict(config=mosaic.Config(num_splits=2, unroll=4))),
    # Loads an iteration ahead: one step at a time, and two with a window and fp8.
    "ahead1": (dict(seed=26, seq_lens=[100, 47, 700], hq=8, hkv=1, d=64, bs=48, sinks=True),
               dict(config=mosaic.Config(num_splits=3, unroll=1, ahead=True))),
    "ahead2_fp8_window": (dict(seed=36, seq_lens=[200, 40, 3], hq=12, hkv=1, d=128, window=65,
                               fp8_kv=True),
                          dict(config=mosaic.Config(num_splits=2, unroll=2, ahead=True))),
    # fp8 caches (head sizes a multiple of 64): widened to fp16 for the mma, the query too.
    "fp8_kv": (dict(seed=28, seq_lens=SEQ_LENS, d=64, fp8_kv=True), {}),
    "fp8_all": (dict(seed=29, seq_lens=SEQ_LENS, hq=6, hkv=2, d=64, alibi=True, sinks=True,
                     window=33, fp8_kv=True, out_scale=0.02, query_lens=[1, 1, 2, 1]), {}),
    "fp8_e5m2_group16": (dict(seed=30, seq_lens=[3, 77, 16], hq=32, hkv=2, d=128, fp8_kv=True,
                              fp8_dtype=jnp.float8_e5m2),
                         dict(config=mosaic.Config(num_splits=2, unroll=2))),
    "fp8_f16_query": (dict(seed=31, seq_lens=[40, 1], hq=8, hkv=1, d=192, fp8_kv=True,
                           dtype=jnp.float16), {}),
    "fp8_f32_query": (dict(seed=32, seq_lens=[40, 1], hq=4, hkv=2, d=64, bs=32, fp8_kv=True,
                           dtype=jnp.float32), {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MOSAIC_CASES))
def test_gpu_mosaic_matches_reference(name):
  from jax_mla import _mosaic

  case_kw, kernel_kw = MOSAIC_CASES[name]
  case = make_case(**case_kw)
  if not _mosaic.default_for(mosaic.check_supported, *jax.device_put(
      (case.query, case.key_cache, case.value_cache))):
    pytest.skip("the Mosaic GPU kernel runs on Hopper")
  want = numpy_oracle(case)
  out = f32(run(case, implementation="mosaic", **kernel_kw))
  assert np.isfinite(out).all()  # NaN in every unwritten cache slot
  assert rel_err(out, want) < (0.07 if "out_scale" in case.kwargs else 1e-2)
  assert (out[want == 0] == 0).all()
  # The default picks the kernel on Hopper.
  np.testing.assert_array_equal(f32(run(case, **kernel_kw)), out)


@pytest.mark.gpu
def test_gpu_mosaic_invalid_block_ids_are_masked():
  case = make_case(8, SEQ_LENS)
  case.block_tables[2, 1] = -1
  case.block_tables[3, 0] = 2**31 - 1
  want = numpy_oracle(case, masked_positions=[(2, p) for p in range(16, 32)]
                      + [(3, p) for p in range(16)])
  out = f32(run(case, implementation="mosaic"))
  assert rel_err(out, want) < 1e-2


@pytest.mark.cpu_only
@pytest.mark.parametrize("group,d,bs,dtype,kv_dtype", [
    (8, 128, 16, jnp.bfloat16, None), (16, 64, 32, jnp.float16, None),
    (3, 256, 48, jnp.bfloat16, None), (8, 128, 16, jnp.bfloat16, FP8),
    (12, 64, 16, jnp.float32, jnp.float8_e5m2), (8, 64, 16, jnp.float16, FP8),
    (24, 128, 16, jnp.bfloat16, None)])
def test_mosaic_kernel_lowers_for_cuda(group, d, bs, dtype, kv_dtype):
  from helpers import lowers_for_cuda

  from jax_mla.paged.layout import key_view, value_view

  hkv, sds = 2, jax.ShapeDtypeStruct
  kv_dtype = kv_dtype or dtype
  x = 16 // jnp.dtype(kv_dtype).itemsize

  # One split writes the output; bf16 splits at head sizes 128 / 256 are combined on
  # Mosaic GPU too (then no XLA op but reshapes); the rest in XLA.
  for splits in (1, 2):
    def f(q, k, v, bt, lens, sinks, alibi, splits=splits):
      return mosaic.paged_attention_mosaic(
          q, key_view(k), value_view(v, True), bt, lens, sm_scale=0.1, k_scale=1.0,
          v_scale=1.0, attn_sink=sinks, alibi_slopes=alibi, sliding_window=33,
          query_start_loc=None, out_scale=None, config=mosaic.Config(num_splits=splits))

    lowered = lowers_for_cuda(
        f, sds((4, hkv * group, d), dtype), sds((10, hkv, d // x, bs, x), kv_dtype),
        sds((10, hkv, d, bs), kv_dtype), sds((4, 5), jnp.int32), sds((4,), jnp.int32),
        sds((hkv * group,), jnp.float32), sds((hkv * group,), jnp.float32))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and "mma.sync.aligned.m16n8k16" in text
    assert text.count("mosaic_gpu") >= 1 + (splits > 1)
    all_mosaic = splits == 1 or (dtype == jnp.bfloat16 and d in (128, 256))
    xla_combine = "stablehlo.exponential" in text or "stablehlo.reduce" in text
    assert all_mosaic != xla_combine


@pytest.mark.cpu_only
def test_mosaic_default_num_kv_splits():
  # H100 (132 SMs): 2 bf16 CTAs or 3 fp8 CTAs resident a SM, 4 warps each.
  assert mosaic.default_num_kv_splits(128, 8, 256, 132, 2) == 1  # 256 CTAs: 0.97 waves
  assert mosaic.default_num_kv_splits(128, 8, 256, 132, 1) == 3  # 768 CTAs: 1.94 waves
  assert mosaic.default_num_kv_splits(4, 8, 4096, 132, 2) == 32
  assert mosaic.default_num_kv_splits(4, 8, 4096, 132, 1) == 48
  assert mosaic.default_num_kv_splits(1, 1, 20, 132, 2) == 2  # splits keep 8 steps
  assert mosaic.default_num_kv_splits(1, 1, 4, 132, 2) == 1
  assert mosaic.default_num_kv_splits(4096, 8, 256, 132, 2) == 1  # 31 waves


@pytest.mark.cpu_only
def test_mosaic_refuses_what_it_does_not_take():

  def check(q_shape, k_shape, v_shape, dtype=jnp.bfloat16, k_dtype=None):
    mosaic.check_supported(jnp.zeros(q_shape, dtype), jnp.zeros(k_shape, k_dtype or dtype),
                           jnp.zeros(v_shape, k_dtype or dtype))

  check((2, 16, 128), (4, 2, 16, 16, 8), (4, 2, 128, 16))  # takes
  check((2, 16, 128), (4, 2, 8, 16, 16), (4, 2, 128, 16), jnp.float32, FP8)
  for match, args in [
      ("bf16 or fp16", ((2, 16, 128), (4, 2, 32, 16, 4), (4, 2, 128, 16), jnp.float32)),
      ("key layout", ((2, 16, 128), (4, 2, 16, 16, 8), (4, 2, 128, 16), jnp.bfloat16, FP8)),
      ("multiple of 64", ((2, 16, 96), (4, 2, 6, 16, 16), (4, 2, 96, 16), jnp.bfloat16, FP8)),
      ("key layout", ((2, 16, 128), (4, 2, 16, 128), (4, 2, 16, 128))),
      ("value layout", ((2, 16, 128), (4, 2, 16, 16, 8), (4, 2, 16, 128))),
      ("multiple of 32", ((2, 16, 80), (4, 2, 10, 16, 8), (4, 2, 80, 16))),
      ("multiple of 16 tokens", ((2, 16, 128), (4, 2, 16, 8, 8), (4, 2, 128, 8))),
  ]:
    with pytest.raises(ValueError, match=match):
      check(*args)
  case = make_case(11, [5, 9], d=80)
  with pytest.raises(ValueError, match="multiple of 32"):
    run(case, implementation="mosaic")
  with pytest.raises(TypeError, match="config"):
    run(make_case(11, [5, 9]), implementation="xla", config=object())
