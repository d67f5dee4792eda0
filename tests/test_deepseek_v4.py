"""DeepSeek V4 sparse attention backend: index helpers and whole-layer decode/prefill.

The layer is checked against a dense numpy reference written from the model's
rule alone: a token at position ``pos`` attends to raw tokens
``max(0, pos - window + 1) .. pos`` of its request and to its compressed entries
(ratio 4: the indexer's valid picks; ratio 128: entries ``0 .. (pos+1)//128 - 1``),
in one softmax with the head's sink. Caches start as all-0xFF bytes (NaN in every
fp8/bf16 field) and only the slots the layer may read are written.
"""

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

from jax_mla.backends import DeepseekV4Sparse, split_decodes_and_prefills
from jax_mla.backends import deepseek_v4 as v4
from jax_mla.backends import deepseek_v4_indices as idx
from jax_mla.cache import (
  concat_and_cache_mla,
  dequantize_fp4_v41,
  dequantize_fp8_model1,
  dequantize_fp8_v41,
  kv_cache_shape,
  quantize_fp4_v41,
  quantize_fp8_model1,
  quantize_fp8_v41,
)

# Per-token codec of each layer cache format: what the cache gives back for a latent.
CODECS = {"fp8_model1": (quantize_fp8_model1, dequantize_fp8_model1),
          "fp8_v41": (quantize_fp8_v41, dequantize_fp8_v41),
          "fp4_v41": (quantize_fp4_v41, dequantize_fp4_v41)}

# ---------------------------------------------------------------------------
# Index helpers against per-token numpy loops


def _block_table(rng, lens, block_size, extra_cols=1, first_pos=None, num_blocks=None):
  """Random physical blocks; block 0 is the never-written null block, which also
  stands for the freed blocks below ``first_pos[r]`` (as vLLM frees SWA blocks)."""
  need = [max(1, -(-n // block_size)) for n in lens]
  lo = [0] * len(lens) if first_pos is None else [p // block_size for p in first_pos]
  total = sum(k - a for k, a in zip(need, lo, strict=True)) + 1
  num_blocks = num_blocks or total
  assert total <= num_blocks
  perm = rng.permutation(num_blocks - 1) + 1
  bt = np.zeros((len(lens), max(need) + extra_cols), np.int32)
  at = 0
  for r, (k, a) in enumerate(zip(need, lo, strict=True)):
    bt[r, a:k] = perm[at:at + k - a]
    at += k - a
  return bt, num_blocks


def _write(cache, rows, slots, pad_to=256, fmt="fp8_model1"):
  """concat_and_cache_mla with inputs padded to a fixed row count (one compile)."""
  n = len(slots)
  x = np.zeros((-(-max(n, 1) // pad_to) * pad_to, 512), np.float32)
  if n:
    x[:n] = np.asarray(rows)
  sl = np.full((len(x),), -1, np.int32)
  sl[:n] = slots
  return concat_and_cache_mla(jnp.asarray(x, jnp.bfloat16), jnp.zeros((len(x), 0), jnp.bfloat16),
                              cache, jnp.asarray(sl), kv_cache_dtype=fmt,
                              implementation="xla")


def _quant_round_trip(x, pad_to=512, fmt="fp8_model1"):
  """What the cache gives back for latents ``x[n, 512]`` (rows padded: one compile)."""
  n = len(x)
  xp = np.zeros((-(-max(n, 1) // pad_to) * pad_to, 512), np.float32)
  xp[:n] = x
  quantize, dequantize = CODECS[fmt]
  return np.asarray(dequantize(quantize(jnp.asarray(xp, jnp.bfloat16))), np.float64)[:n]


def _slot(bt, r, i, bs):
  return int(bt[r, i // bs]) * bs + i % bs


@pytest.mark.cpu_only
def test_compute_swa_indices_and_lens():
  rng = np.random.default_rng(0)
  window, bs = 6, 4
  qlens, ctx = [1, 2, 1, 3], [0, 9, 3, 17]
  seq_lens = np.array([a + b for a, b in zip(ctx, qlens, strict=True)], np.int32)
  qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
  bt, _ = _block_table(rng, seq_lens, bs)
  t2r = np.repeat(np.arange(4), qlens).astype(np.int32)
  valid = np.ones(len(t2r), bool)
  valid[2] = False
  ind, lens = idx.compute_swa_indices_and_lens(
      jnp.asarray(qsl), jnp.asarray(seq_lens), jnp.asarray(t2r), jnp.asarray(valid),
      jnp.asarray(bt), window_size=window, block_size=bs)
  for t, r in enumerate(t2r):
    pos = ctx[r] + t - qsl[r]
    want = [_slot(bt, r, p, bs) for p in range(max(0, pos - window + 1), pos + 1)]
    if not valid[t]:
      want = []
    assert int(lens[t]) == len(want)
    np.testing.assert_array_equal(ind[t], want + [-1] * (window - len(want)))


@pytest.mark.cpu_only
def test_global_topk_dense_and_ragged():
  rng = np.random.default_rng(1)
  bs, k = 4, 7
  bt, _ = _block_table(rng, [20, 9, 13], bs, extra_cols=0)
  t2r = np.array([0, 1, 2, 0, 2], np.int32)
  topk = rng.integers(0, 9, (5, k)).astype(np.int32)
  topk[rng.random((5, k)) < 0.3] = -1
  topk[0, 0] = 4 * bt.shape[1] + 1  # block past the table -> dropped
  valid = np.array([True, True, False, True, True])
  dense, lens = idx.compute_global_topk_indices_and_lens(
      jnp.asarray(topk), jnp.asarray(t2r), jnp.asarray(bt), jnp.asarray(valid), block_size=bs)
  ragged, indptr, lens2 = idx.compute_global_topk_ragged_indices_and_indptr(
      jnp.asarray(topk), jnp.asarray(t2r), jnp.asarray(bt), bs, jnp.asarray(valid))
  flat = []
  for t in range(5):
    want = [] if not valid[t] else [
        _slot(bt, t2r[t], i, bs) for i in topk[t] if 0 <= i < bs * bt.shape[1]]
    assert int(lens[t]) == int(lens2[t]) == len(want)
    np.testing.assert_array_equal(dense[t], want + [-1] * (k - len(want)))
    assert int(indptr[t]) == len(flat)
    flat += want
  assert int(indptr[-1]) == len(flat)
  np.testing.assert_array_equal(ragged, flat + [-1] * (5 * k - len(flat)))


@pytest.mark.cpu_only
@pytest.mark.parametrize("ratio,topk", [(1, 0), (4, 3), (128, 2)])
def test_combine_topk_swa_indices(ratio, topk):
  rng = np.random.default_rng(2)
  window = 5
  n_cap = 8 if ratio > 1 else 0
  qlens, ctx = [4, 1, 6], [0, 300, 9]
  seq_lens = np.array([a + b for a, b in zip(ctx, qlens, strict=True)], np.int32)
  qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32) + 2  # two rows before
  gather = np.array([q + min(c, window - 1) for q, c in zip(qlens, ctx, strict=True)], np.int32)
  m = n_cap + window - 1 + 6
  rows = int(qsl[-1]) + 1  # plus one row after the last request
  width = max(topk, 1) if ratio > 1 else 0
  tk = rng.integers(-1, 90, (rows, width)).astype(np.int32)
  args = (jnp.asarray(tk), jnp.asarray(qsl), jnp.asarray(seq_lens), jnp.asarray(gather))
  kw = dict(window_size=window, compress_ratio=ratio, topk=topk, M=m, N=n_cap)
  dense, lens = idx.combine_topk_swa_indices(*args, **kw)
  ragged, indptr, lens2 = idx.combine_topk_swa_indices_ragged(*args, **kw)
  np.testing.assert_array_equal(lens, lens2)
  flat = []
  for t in range(rows):
    r = np.searchsorted(qsl, t, side="right") - 1
    want = []
    if 0 <= r < 3:
      pos = seq_lens[r] - qlens[r] + t - qsl[r]
      n = (pos + 1) // ratio
      tl = min(n, topk)
      want = [r * m + i if 0 <= i < n else -1 for i in tk[t, :tl]]
      start = seq_lens[r] - gather[r]
      want += [r * m + n_cap + p - start for p in range(max(0, pos - window + 1), pos + 1)]
    assert int(lens[t]) == len(want), t
    np.testing.assert_array_equal(dense[t], want + [-1] * (topk + window - len(want)))
    flat += want
  np.testing.assert_array_equal(indptr, np.concatenate([[0], np.cumsum(lens)]))
  np.testing.assert_array_equal(ragged[:len(flat)], flat)


@pytest.mark.cpu_only
def test_build_c128a_topk_metadata():
  rng = np.random.default_rng(3)
  bs, topk = 2, 5
  positions = np.array([127, 0, 300, 600, 255, 1000], np.int32)
  t2r = np.array([0, 1, 2, 0, 1, 2], np.int32)
  bt, _ = _block_table(rng, [5, 5, 5], bs)
  slots = np.array([3, -1, 5, 0, 0, 0], np.int32)
  g, lens, local = idx.build_c128a_topk_metadata(
      jnp.asarray(positions), jnp.asarray(t2r), jnp.asarray(bt), jnp.asarray(slots),
      compress_ratio=128, topk=topk, num_decode_tokens=3, block_size=bs)
  for t in range(6):
    n = min((positions[t] + 1) // 128, topk)
    if t < 3:
      n = n if slots[t] >= 0 else 0
      want = [_slot(bt, t2r[t], i, bs) for i in range(n)]
      assert int(lens[t]) == n
      np.testing.assert_array_equal(g[t], want + [-1] * (topk - n))
    else:
      np.testing.assert_array_equal(local[t - 3], list(range(n)) + [-1] * (topk - n))


@pytest.mark.cpu_only  # expected values come from the same device's dequantization
def test_dequantize_and_gather_k_cache_reads_only_the_gathered_tokens():
  rng = np.random.default_rng(4)
  bs = 4
  seq_lens = np.array([10, 3], np.int32)
  gather = np.array([6, 3], np.int32)
  bt, nb = _block_table(rng, seq_lens, bs)
  cache = jnp.full(kv_cache_shape(nb, bs, 512, "fp8_model1"), 0xFF, jnp.uint8)  # NaN
  x = [rng.standard_normal((n, 512)).astype(np.float32) for n in seq_lens]
  for r in range(2):  # write only the tokens that are gathered
    pos = np.arange(seq_lens[r] - gather[r], seq_lens[r])
    cache = _write(cache, x[r][pos], [_slot(bt, r, p, bs) for p in pos])
  out = jnp.full((2, 12, 512), 7.0, jnp.bfloat16)
  out = idx.dequantize_and_gather_k_cache(
      out, cache, jnp.asarray(seq_lens), jnp.asarray(gather), jnp.asarray(bt), offset=2,
      capacity=8)
  out = np.asarray(out, np.float32)
  for r in range(2):
    deq = _quant_round_trip(x[r])
    g = gather[r]
    np.testing.assert_array_equal(out[r, 2:2 + g], deq[seq_lens[r] - g:])
    assert (out[r, :2] == 7).all() and (out[r, 2 + g:] == 7).all()


@pytest.mark.cpu_only
def test_split_decodes_and_prefills():
  assert split_decodes_and_prefills(np.array([0, 1, 2, 7, 9])) == (2, 2, 2, 7)
  assert split_decodes_and_prefills(np.array([0, 1, 3, 7]), decode_threshold=2) == (2, 1, 3, 4)
  assert split_decodes_and_prefills(np.array([0, 1, 2])) == (2, 0, 2, 0)
  assert split_decodes_and_prefills(np.array([0, 5, 6])) == (0, 2, 0, 6)  # prefill first
  assert split_decodes_and_prefills(np.array([0])) == (0, 0, 0, 0)
  # require_uniform (AiterMLA): the decodes share the first request's length.
  uniform = functools.partial(split_decodes_and_prefills, decode_threshold=2,
                              require_uniform=True)
  assert uniform(np.array([0, 2, 4, 5, 9])) == (2, 2, 4, 5)  # the 1-token request: prefill
  assert split_decodes_and_prefills(np.array([0, 2, 4, 5, 9]), decode_threshold=2) == (
      3, 1, 5, 4)
  assert uniform(np.array([0, 2, 2, 4])) == (3, 0, 4, 0)  # a padded uniform batch (length 0)
  # Lengths <= 1 are all decodes in either mode (vLLM's shortcut), zero-length ones too.
  assert uniform(np.array([0, 1, 1]), decode_threshold=1) == (2, 0, 1, 0)


@pytest.mark.cpu_only  # the example runs the reference
def test_class_docstring_example_runs():
  test = doctest.DocTestParser().get_doctest(DeepseekV4Sparse.__doc__, {}, "DeepseekV4Sparse",
                                             None, 0)
  assert doctest.DocTestRunner().run(test).failed == 0


# ---------------------------------------------------------------------------
# Whole layer against the dense reference


def _make_case(seed, cfg, reqs, *, num_pad=1, decode_threshold=1, with_sink=True):
  """reqs: (context_len, query_len) per request, decodes first."""
  rng = np.random.default_rng(seed)
  ctx = np.array([a for a, _ in reqs], np.int32)
  qlens = np.array([b for _, b in reqs], np.int32)
  seq_lens = ctx + qlens
  qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
  num_tokens = int(qsl[-1]) + num_pad
  h, w, ratio = cfg.num_heads, cfg.window_size, cfg.compress_ratio
  raw = [rng.standard_normal((n, 512)).astype(np.float32) for n in seq_lens]

  sbs = cfg.swa_block_size
  # Context tokens the layer may read: the window of the first new token; blocks
  # wholly before it are freed (the null block).
  first = [max(0, a - w + 1) for a in ctx]
  swa_bt, nb = _block_table(rng, seq_lens, sbs, first_pos=first, num_blocks=48)
  fmt, cfmt = cfg.kv_cache_dtype, cfg.compressed_cache_dtype
  swa_cache = jnp.full(kv_cache_shape(nb, sbs, 512, fmt), 0xFF, jnp.uint8)  # NaN where unwritten
  pre = [(r, p) for r in range(len(reqs)) for p in range(first[r], ctx[r])]
  swa_cache = _write(swa_cache, [raw[r][p] for r, p in pre],
                     [_slot(swa_bt, r, p, sbs) for r, p in pre], fmt=fmt)
  kv = np.zeros((num_tokens, 512), np.float32)
  slot_mapping = np.full((num_tokens,), -1, np.int32)
  t2r = np.repeat(np.arange(len(reqs)), qlens)
  pos = np.array([ctx[r] + t - qsl[r] for t, r in enumerate(t2r)], np.int64)
  for t, r in enumerate(t2r):
    kv[t] = raw[r][pos[t]]
    slot_mapping[t] = _slot(swa_bt, r, pos[t], sbs)
  kv[len(t2r):] = rng.standard_normal((num_pad, 512))

  comp = cblock_table = topk = None
  ncomp = seq_lens // ratio
  comp_raw = [rng.standard_normal((n, 512)).astype(np.float32) for n in ncomp]
  if ratio > 1:
    cbs = cfg.compressed_block_size
    cblock_table, cnb = _block_table(rng, ncomp, cbs, num_blocks=24)
    comp = jnp.full(kv_cache_shape(cnb, cbs, 512, cfmt), 0xFF, jnp.uint8)
    ent = [(r, i) for r in range(len(reqs)) for i in range(ncomp[r])]
    comp = _write(comp, [comp_raw[r][i] for r, i in ent],
                  [_slot(cblock_table, r, i, cbs) for r, i in ent], fmt=cfmt)
  picks = [[] for _ in range(num_tokens)]
  if ratio == 4:
    k = cfg.index_topk
    # padding rows carry garbage the layer must ignore
    topk = rng.integers(0, 50, (num_tokens, k)).astype(np.int32)
    for t in range(len(t2r)):
      n = (pos[t] + 1) // 4
      row = rng.permutation(n)[:k]
      if len(row) > 2 and t % 2:
        row[rng.integers(len(row))] = -1  # an interior hole
      topk[t] = np.concatenate([row, -np.ones(k - len(row))]).astype(np.int32)
      picks[t] = [int(i) for i in row if i >= 0]
  elif ratio == 128:
    for t in range(len(t2r)):
      picks[t] = list(range(min((pos[t] + 1) // 128, cfg.topk)))

  q = (rng.standard_normal((num_tokens, h, 512))).astype(np.float32)
  sink = rng.standard_normal(h).astype(np.float32) if with_sink else None
  counts = split_decodes_and_prefills(qsl, decode_threshold=decode_threshold)

  # Dense reference: exactly the attended set, one softmax with the sink.
  qb = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float64)
  deq = [_quant_round_trip(x, fmt=fmt) for x in raw]
  cdeq = [_quant_round_trip(x, fmt=cfmt) for x in comp_raw]
  ref = np.zeros((num_tokens, h, 512))
  for t, r in enumerate(t2r):
    keys = [deq[r][p] for p in range(max(0, pos[t] - w + 1), pos[t] + 1)]
    keys += [cdeq[r][i] for i in picks[t]]
    kmat = np.array(keys)
    s = qb[t] @ kmat.T * cfg.sm_scale  # [h, n]
    mx = s.max(axis=1)
    if sink is not None:
      mx = np.maximum(mx, sink)
    e = np.exp(s - mx[:, None])
    den = e.sum(axis=1) + (np.exp(sink - mx) if sink is not None else 0.0)
    ref[t] = (e / den[:, None]) @ kmat

  inputs = dict(
      q=jnp.asarray(q, jnp.bfloat16), kv=jnp.asarray(kv, jnp.bfloat16), swa_cache=swa_cache,
      compressed_cache=comp, attn_sink=None if sink is None else jnp.asarray(sink),
      topk_indices=None if topk is None else jnp.asarray(topk))
  meta_args = (jnp.asarray(qsl), jnp.asarray(seq_lens), jnp.asarray(slot_mapping),
               jnp.asarray(swa_bt), None if cblock_table is None else jnp.asarray(cblock_table))
  return inputs, meta_args, counts, ref


def _run(cfg, inputs, meta_args, counts, **kw):
  md = v4.build_deepseek_v4_metadata(cfg, *meta_args, num_decodes=counts[0],
                                     num_decode_tokens=counts[2])
  out, cache = v4.deepseek_v4_sparse_forward(
      inputs["q"], inputs["kv"], inputs["swa_cache"], inputs["compressed_cache"], md,
      inputs["attn_sink"], inputs["topk_indices"], config=cfg, **kw)
  return np.asarray(out, np.float64), md


LAYER_CASES = {
    # window only; decodes below and above the window, prefills with and without context
    "ratio1_w8": (dict(compress_ratio=1, window_size=8),
                  [(0, 1), (5, 1), (20, 1), (0, 5), (3, 9), (30, 4)]),
    # indexer top-k 8 over ratio-4 entries: zero, few and more-than-topk entries
    "ratio4_w8": (dict(compress_ratio=4, window_size=8, index_topk=8, block_size=16,
                       max_model_len=128),
                  [(0, 1), (2, 1), (3, 1), (40, 1), (0, 12), (30, 20), (0, 3)]),
    # all ratio-128 entries: crossing 127 inside a prefill
    "ratio128_w16": (dict(compress_ratio=128, window_size=16, block_size=256,
                          max_model_len=512),
                     [(100, 1), (200, 1), (300, 1), (120, 20), (250, 10), (0, 3)]),
}


@pytest.mark.cpu_only  # on a GPU: test_layer_mosaic_gpu, the same cases on the kernels
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_matches_dense_reference_xla(name):
  over, reqs = LAYER_CASES[name]
  cfg = v4.DeepseekV4Config(num_heads=3, swa_block_size=8, prefill_chunk_size=2, **over)
  inputs, meta_args, counts, ref = _make_case(list(LAYER_CASES).index(name), cfg, reqs)
  out, md = _run(cfg, inputs, meta_args, counts, implementation="xla")
  assert np.isfinite(out).all()
  assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
  np.testing.assert_array_equal(out[-1], 0)  # the padding token
  # two prefill chunks; the second one's rows sit in a window clamped to the end
  assert md.prefill_chunk_capacity < md.num_prefill_tokens


# DeepSeek V4.1 caches: both in one format, or an fp8 window with an fp4 compressed cache.
V41_FORMATS = {"fp8_v41": dict(kv_cache_dtype="fp8_v41"),
               "fp4_v41": dict(kv_cache_dtype="fp4_v41"),
               "fp8_v41+fp4_v41": dict(kv_cache_dtype="fp8_v41",
                                       compressed_kv_cache_dtype="fp4_v41")}


@pytest.mark.cpu_only  # on a GPU: test_layer_v41_mosaic_gpu
@pytest.mark.parametrize("formats", list(V41_FORMATS))
@pytest.mark.parametrize("name", ["ratio4_w8", "ratio128_w16"])
def test_layer_v41_caches_match_dense_reference_xla(name, formats):
  over, reqs = LAYER_CASES[name]
  cfg = v4.DeepseekV4Config(num_heads=3, swa_block_size=8, prefill_chunk_size=2, **over,
                            **V41_FORMATS[formats])
  inputs, meta_args, counts, ref = _make_case(41 + list(LAYER_CASES).index(name), cfg, reqs)
  out, _ = _run(cfg, inputs, meta_args, counts, implementation="xla")
  assert np.isfinite(out).all()
  assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
  np.testing.assert_array_equal(out[-1], 0)  # the padding token


@pytest.mark.parametrize("formats", ["fp8_v41+fp4_v41", "fp4_v41"])
def test_layer_v41_triton_interpret(formats, interpret):
  cfg = v4.DeepseekV4Config(num_heads=2, swa_block_size=8, compress_ratio=4, window_size=8,
                            index_topk=4, block_size=16, max_model_len=64,
                            **V41_FORMATS[formats])
  inputs, meta_args, counts, ref = _make_case(51, cfg, [(3, 1), (20, 1), (6, 5)])
  out, _ = _run(cfg, inputs, meta_args, counts, implementation="triton", interpret=interpret)
  assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("formats", list(V41_FORMATS))
def test_layer_v41_mosaic_gpu(formats):
  over, reqs = LAYER_CASES["ratio4_w8"]
  cfg = v4.DeepseekV4Config(num_heads=64, swa_block_size=8, prefill_chunk_size=2, **over,
                            **V41_FORMATS[formats])
  inputs, meta_args, counts, ref = _make_case(61, cfg, reqs)
  out, _ = _run(cfg, inputs, meta_args, counts, implementation="mosaic")
  assert np.isfinite(out).all()
  assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
  np.testing.assert_array_equal(out[-1], 0)


@pytest.mark.cpu_only
def test_layer_mtp_decodes_without_sink_xla():
  cfg = v4.DeepseekV4Config(num_heads=2, window_size=8, compress_ratio=4, index_topk=4,
                            block_size=16, max_model_len=64, swa_block_size=8)
  reqs = [(9, 2), (0, 2), (30, 1), (17, 6)]
  inputs, meta_args, counts, ref = _make_case(7, cfg, reqs, decode_threshold=2,
                                              with_sink=False)
  assert counts == (3, 1, 5, 6)
  out, md = _run(cfg, inputs, meta_args, counts, implementation="xla")
  assert md.prefill_chunk_capacity == md.num_prefill_tokens  # one chunk spans every row
  assert rel_err(out, ref) < 1e-2
  np.testing.assert_array_equal(out[-1], 0)  # the padding token


@pytest.mark.cpu_only
def test_metadata_builds_under_jit():
  """Inside jit (traced query_start_loc) the arrays match and a chunk may hold every token."""
  over, reqs = LAYER_CASES["ratio128_w16"]
  cfg = v4.DeepseekV4Config(num_heads=3, swa_block_size=8, prefill_chunk_size=2, **over)
  _, meta_args, counts, _ = _make_case(11, cfg, reqs)
  build = lambda *a: v4.build_deepseek_v4_metadata(cfg, *a, num_decodes=counts[0],
                                                   num_decode_tokens=counts[2])
  eager, traced = build(*meta_args), jax.jit(build)(*meta_args)
  assert traced.prefill_chunk_capacity == traced.num_prefill_tokens
  assert eager.prefill_chunk_capacity == 32 < traced.prefill_chunk_capacity
  for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(traced),
                  strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("ratio", [1, 4])
def test_layer_triton_interpret(ratio, interpret):
  over = dict(compress_ratio=ratio, window_size=8)
  if ratio == 4:
    over.update(index_topk=4, block_size=16, max_model_len=64)
  cfg = v4.DeepseekV4Config(num_heads=2, swa_block_size=8, **over)
  inputs, meta_args, counts, ref = _make_case(21 + ratio, cfg, [(3, 1), (20, 1), (6, 5)])
  out, _ = _run(cfg, inputs, meta_args, counts, implementation="triton", interpret=interpret)
  assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_mosaic_gpu(name):
  """The whole layer on the Mosaic GPU kernel (64 heads: decode with both key sets,
  chunked prefill with sink and per-token lengths) against the dense reference."""
  over, reqs = LAYER_CASES[name]
  cfg = v4.DeepseekV4Config(num_heads=64, swa_block_size=8, prefill_chunk_size=2, **over)
  inputs, meta_args, counts, ref = _make_case(31 + list(LAYER_CASES).index(name), cfg, reqs)
  out, _ = _run(cfg, inputs, meta_args, counts, implementation="mosaic")
  assert np.isfinite(out).all()
  assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
  np.testing.assert_array_equal(out[-1], 0)  # the padding token


@pytest.mark.cpu_only
def test_config_and_input_validation():
  with pytest.raises(ValueError, match="compress_ratio"):
    v4.DeepseekV4Config(num_heads=2, window_size=8, compress_ratio=8)
  with pytest.raises(ValueError, match="block_size"):
    v4.DeepseekV4Config(num_heads=2, window_size=8, compress_ratio=128, block_size=64)
  with pytest.raises(ValueError, match="kv_cache_dtype"):
    v4.DeepseekV4Config(num_heads=2, window_size=8, kv_cache_dtype="fp8_ds_mla")
  # V4.1 pairs: fp4 compressed cache only behind an fp8_v41 window cache
  with pytest.raises(ValueError, match="compressed_kv_cache_dtype.*'fp4_v41' with kv_cache_dtype="
                                       "'fp8_v41'"):
    v4.DeepseekV4Config(num_heads=2, window_size=8, compressed_kv_cache_dtype="fp4_v41")
  with pytest.raises(ValueError, match="compressed_kv_cache_dtype"):
    v4.DeepseekV4Config(num_heads=2, window_size=8, kv_cache_dtype="fp4_v41",
                        compressed_kv_cache_dtype="fp8_v41")
  fp4 = v4.DeepseekV4Config(num_heads=2, window_size=8, kv_cache_dtype="fp4_v41",
                            compressed_kv_cache_dtype="fp4_v41")
  assert fp4.compressed_cache_dtype == "fp4_v41"
  cfg = v4.DeepseekV4Config(num_heads=2, window_size=8, compress_ratio=4, index_topk=4,
                            block_size=16, max_model_len=64, swa_block_size=8)
  inputs, meta_args, counts, _ = _make_case(5, cfg, [(3, 1), (6, 5)])
  with pytest.raises(ValueError, match="topk_indices"):
    _run(cfg, {**inputs, "topk_indices": None}, meta_args, counts, implementation="xla")
  with pytest.raises(ValueError, match="block_table"):
    v4.build_deepseek_v4_metadata(cfg, *meta_args[:4], None, num_decodes=1,
                                  num_decode_tokens=1)
