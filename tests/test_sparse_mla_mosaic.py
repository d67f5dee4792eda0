"""Sparse MLA prefill and decode on the Mosaic GPU kernel vs the jax.numpy reference.

Mosaic GPU has no interpreter, so the kernel tests need a Hopper GPU
(``@pytest.mark.gpu``); the input checks run anywhere. Head counts up to 32 that are
not 64 (8, 16, 20, 24, 32) run the transposed kernel (mosaic_transposed.py) in tiles of
16 or 32 rows; the others the head-block kernel (mosaic.py) in blocks of 64 heads. A
last tile or block of fewer heads goes as it is where they are a multiple of 8 (8, 24,
48, 80; ``mosaic_gather.ragged_block``), else padded (20 to 32, 100 to 128).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lowers_for_cuda, rel_err
from sparse_cases import decode_inputs, random_indices

from jax_mla import _mosaic
from jax_mla.cache.formats import resolve
from jax_mla.sparse_mla import mosaic, sparse_mla_decode, sparse_mla_prefill
from jax_mla.sparse_mla.mosaic_gather import tail_parts


def _rows(rng, num_slots, d_qk, idx):
  """``[num_slots, d_qk]`` float32 latents with NaN in every row no index names."""
  rows = (rng.standard_normal((num_slots, d_qk)) / 3).astype(np.float32)
  used = np.zeros(num_slots, bool)
  used[idx[(idx >= 0) & (idx < num_slots)]] = True
  rows[~used] = np.nan
  return rows


def _case(rng, s_q, h_q, d_qk, s_kv, topk):
  q = (rng.standard_normal((s_q, h_q, d_qk)) / 3).astype(np.float32)
  idx = random_indices(rng, (s_q, topk), s_kv)
  kv = _rows(rng, s_kv, d_qk, idx)
  return jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), jnp.asarray(idx)


def _check(q, kv, idx, config=None, **kw):
  kw.setdefault("sm_scale", q.shape[-1] ** -0.5)
  got = sparse_mla_prefill(q, kv, idx, implementation="mosaic", config=config, **kw)
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
  return out, r_out


# The prefill tests share s_q 8 and s_kv 512; topk, heads, d_qk and which optional inputs
# are given pick the kernel, so tests that differ only in values reuse one compile.
S_Q, S_KV = 8, 512


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [64, 128, 8, 16, 48, 80, 100])
def test_random_with_invalid_indices(d_qk, h_q):
  rng = np.random.default_rng(d_qk + h_q)
  _check(*_case(rng, S_Q, h_q, d_qk, S_KV, 256))


# The wrapper pads topk to a multiple of 64 and the kernel steps over 64 keys at a time:
# one padded step, one exact step, a second step holding one key.
@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 64, 65])
@pytest.mark.parametrize("h_q", [64, 16])
def test_odd_topk(topk, h_q):
  _check(*_case(np.random.default_rng(topk), S_Q, h_q, 576, S_KV, topk))


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [190, 192])  # the XLA pre-pass; the kernel's own masking
@pytest.mark.parametrize("h_q", [128, 24])
def test_topk_length_short_zero_and_over(h_q, topk):
  rng = np.random.default_rng(3)
  q, kv, idx = _case(rng, S_Q, h_q, 576, S_KV, topk)
  lengths = jnp.asarray([0, 1, 63, 64, 65, 190, 500, -3], jnp.int32)
  # Sinks of -inf change nothing; given, the kernel is test_sinks[576]'s.
  _check(q, kv, idx, topk_length=lengths, attn_sink=jnp.full((h_q,), -jnp.inf, jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [64, 32])
def test_all_invalid_rows(h_q):
  rng = np.random.default_rng(4)
  q, kv, idx = _case(rng, S_Q, h_q, 512, S_KV, 256)
  idx = idx.at[1].set(-1).at[3].set(S_KV)
  _check(q, kv, idx)


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [128, 48, 24])
def test_sinks(d_qk, h_q):
  rng = np.random.default_rng(5)
  q, kv, idx = _case(rng, S_Q, h_q, d_qk, S_KV, 190)
  sink = rng.standard_normal(h_q).astype(np.float32)
  sink[::3], sink[1::3] = np.inf, -np.inf
  lengths = jnp.asarray([190, 0, 77, 190, 3, 64, 65, 1], jnp.int32)
  _check(q, kv, idx, attn_sink=jnp.asarray(sink), topk_length=lengths)


HALF_STAGES = mosaic.Config(consumer_registers=200, producer_registers=104, half_stages=True)
WHOLE_STAGES = mosaic.Config(consumer_registers=232, producer_registers=40)


# name: (s_q, d_qk, topk, lengths and sinks given, rows 1 and 3 wholly invalid)
HALF_STAGE_CASES = {
    "invalid_576": (S_Q, 576, 256, False, False), "invalid_512": (S_Q, 512, 256, False, False),
    "topk_1": (S_Q, 576, 1, False, False), "topk_65": (S_Q, 576, 65, False, False),
    "lengths_190": (S_Q, 576, 190, True, False), "lengths_192": (S_Q, 512, 192, True, False),
    "all_invalid": (S_Q, 512, 256, False, True),
    "more_tokens_than_sms": (271, 576, 192, True, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("halves", [True, False])
@pytest.mark.parametrize("h_q", [128, 64])
@pytest.mark.parametrize("case", list(HALF_STAGE_CASES))
def test_half_stages(case, h_q, halves):
  """``Config.half_stages`` (the pair loop over per-half stages, prefill's default), and
  whole stages (bf16 decode's loop), with two head blocks a token or one, against the
  reference: invalid indices and NaN in unused rows, a one-key and a partial step,
  lengths from -3 to past topk with +-inf sinks, whole rows invalid, more tokens than
  SMs."""
  s_q, d_qk, topk, with_lengths, all_invalid = HALF_STAGE_CASES[case]
  rng = np.random.default_rng(len(case) + topk + h_q)
  q, kv, idx = _case(rng, s_q, h_q, d_qk, S_KV, topk)
  if all_invalid:
    idx = idx.at[1].set(-1).at[3].set(S_KV)
  kw = {}
  if with_lengths:
    lengths = rng.integers(-3, topk + 100, s_q)
    lengths[:3] = 0, topk, 1
    sink = rng.standard_normal(h_q).astype(np.float32)
    sink[::3], sink[1::3] = np.inf, -np.inf
    kw = {"topk_length": jnp.asarray(lengths, jnp.int32), "attn_sink": jnp.asarray(sink)}
  _check(q, kv, idx, config=HALF_STAGES if halves else WHOLE_STAGES, **kw)


@pytest.mark.parametrize("d_qk", [576, 512])
def test_half_stages_lower(d_qk):
  """The half-stage prefill kernel lowers for CUDA (two head blocks a token, or one),
  its copies arriving on the halves' mbarriers; without the option, on whole stages.
  Runs without a GPU."""
  s = jax.ShapeDtypeStruct
  for h_q, config, halves in ((128, HALF_STAGES, True), (64, HALF_STAGES, True),
                              (64, WHOLE_STAGES, False)):
    lowered = lowers_for_cuda(
        lambda q, kv, idx, lens, config=config: mosaic.sparse_prefill(
            q, kv, idx, None, lens, sm_scale=0.1, config=config),
        s((3, h_q, d_qk), jnp.bfloat16), s((100, d_qk), jnp.bfloat16), s((3, 64), jnp.int32),
        s((3,), jnp.int32))
    assert ("cp.async.mbarrier.arrive.noinc" in lowered.as_text()) == halves


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [16, 32])
@pytest.mark.parametrize("slope", [4, 10])
def test_scores_far_above_the_last_max(h_q, slope):
  """Key rows grow along each token's indices (ascending on even tokens, descending on
  odd ones): a step's max passes the last one's by up to about 14 (base 2; ``slope``
  4), so the accumulators are rescaled by tiny factors, or by about 2^-5 (``slope``
  10), or stays far below it (tiny ``P``)."""
  rng = np.random.default_rng(h_q)
  topk = 256
  idx = np.sort(np.stack([rng.permutation(S_KV)[:topk] for _ in range(S_Q)]), axis=1)
  idx[1::2] = idx[1::2, ::-1]
  growth = 1.0 + np.arange(S_KV, dtype=np.float32)[:, None] / slope
  kv = rng.standard_normal((S_KV, 576)).astype(np.float32) / 3 * growth
  q = rng.standard_normal((S_Q, h_q, 576)).astype(np.float32) / 3
  _check(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16), jnp.asarray(idx))


DECODE_CASES = [
    # dtype, b, s_q, h_q, topk, blocks, block_size, sink, lengths, extra (topk, blocks, bs)
    ("fp8_ds_mla", 3, 2, 64, 200, 11, 64, False, False, None),
    ("fp8_ds_mla", 5, 2, 128, 130, 10, 61, True, True, None),
    ("auto", 3, 2, 128, 200, 301, 2, True, True, None),
    ("auto", 2, 2, 64, 100, 5, 61, False, True, (70, 40, 2)),
    ("fp8_model1", 3, 2, 128, 130, 3, 256, True, True, (200, 12, 64)),
    ("fp8_model1", 4, 2, 64, 19, 30, 2, False, True, (150, 3, 64)),
    ("fp8_model1", 2, 1, 128, 64, 2, 64, True, False, (65, 2, 128)),
    # The transposed kernel: TP head counts, and one that pads (20 -> 32); 48 heads
    # run the head-block kernel's 64-head block unpadded.
    ("fp8_ds_mla", 3, 2, 16, 200, 11, 64, True, True, None),
    ("fp8_ds_mla", 2, 2, 8, 130, 10, 61, False, False, None),
    ("fp8_model1", 3, 2, 16, 130, 3, 256, True, True, (200, 12, 64)),
    ("fp8_model1", 2, 2, 32, 19, 30, 2, False, True, (150, 3, 64)),
    ("auto", 2, 2, 48, 100, 5, 61, True, True, (70, 40, 2)),
    ("fp8_ds_mla", 2, 1, 20, 64, 4, 64, True, False, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-h{c[3]}-bs{c[6]}-x{c[9]}")
def test_decode_matches_reference(case):
  """Small batches: the head-block cases run split (default_num_splits) and combined."""
  _check_decode(case)


# topk a multiple of 64 with lengths: the gather refuses the positions past them itself
# (no index pre-pass); head-block (with and without the 2-CTA pair), transposed, padded
# heads, an extra set, every split count.
MASKED_CASES = [
    ("fp8_ds_mla", 5, 2, 128, 192, 10, 61, True, True, None),
    ("fp8_model1", 3, 2, 128, 128, 3, 256, True, True, (192, 12, 64)),
    ("fp8_ds_mla", 3, 2, 16, 256, 11, 64, True, True, None),
    ("auto", 2, 2, 48, 128, 5, 61, True, True, (64, 40, 2)),
    ("fp8_ds_mla", 3, 2, 24, 192, 10, 61, True, True, None),  # 24 of a 32-row tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("case", MASKED_CASES, ids=lambda c: f"{c[0]}-h{c[3]}-x{c[9]}")
def test_decode_lengths_masked_in_the_gather(case, num_splits):
  fmt = resolve(case[0])
  _check_decode(case, dataclasses.replace(mosaic.default_config(fmt, case[3]),
                                          num_splits=num_splits))
  if case[3] == 128 and num_splits is None:
    cfg = mosaic.default_config(fmt, 128)
    _check_decode(case, dataclasses.replace(cfg, pair=not cfg.pair))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("case", [DECODE_CASES[i] for i in (1, 2, 4, 7, 9)],
                         ids=lambda c: f"{c[0]}-h{c[3]}-bs{c[6]}-x{c[9]}")
def test_decode_split_counts_match_reference(case, num_splits):
  """Every split count, including splits left without a step (8 splits of 3 steps) and
  none (1), with sinks, topk lengths and the extra key set; head-block and transposed
  (16 heads) kernels."""
  fmt = resolve(case[0])
  _check_decode(case, dataclasses.replace(mosaic.default_config(fmt, case[3]),
                                          num_splits=num_splits))


def _check_decode(case, config=None):
  q, cache, idx, kw, _ = decode_inputs(sum(case[1:7]), case)
  got = sparse_mla_decode(q, cache, idx, implementation="mosaic", config=config, **kw)
  ref = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
  (out, lse), (r_out, r_lse) = ([np.asarray(x, np.float32) for x in y] for y in (got, ref))
  assert out.shape == r_out.shape and lse.shape == r_lse.shape
  assert np.isfinite(out).all()
  assert rel_err(out, r_out) < 1e-2
  empty = np.isposinf(r_lse)
  np.testing.assert_array_equal(np.isposinf(lse), empty)
  np.testing.assert_allclose(lse[~empty], r_lse[~empty], rtol=1e-4, atol=1e-5)
  assert np.all(out.transpose(0, 2, 1, 3)[empty] == 0)


# More tokens (times head blocks) than an H100 has SMs: persistent CTAs, each taking two
# or more items, their ring and query buffers running on from one into the next.
MANY_TOKEN_CASES = [
    ("fp8_ds_mla", 150, 2, 16, 130, 40, 64, True, True, None),
    ("fp8_model1", 150, 2, 8, 130, 3, 256, False, True, (200, 12, 64)),
    ("fp8_ds_mla", 150, 2, 64, 130, 40, 64, True, True, None),
    ("auto", 70, 2, 128, 100, 5, 61, True, True, (70, 40, 2)),
    # Unpadded last head blocks: one of 48 heads a token; 64 + 16 heads a token.
    ("fp8_ds_mla", 150, 2, 48, 130, 40, 64, True, True, None),
    ("fp8_model1", 70, 2, 80, 130, 3, 256, True, True, (200, 12, 64)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MANY_TOKEN_CASES, ids=lambda c: f"{c[0]}-h{c[3]}")
def test_decode_more_tokens_than_sms(case):
  _check_decode(case)


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [16, 64])
def test_prefill_more_tokens_than_sms(d_qk, h_q):
  rng = np.random.default_rng(d_qk + h_q)
  s_q = 271
  q, kv, idx = _case(rng, s_q, h_q, d_qk, S_KV, 192)
  lengths = jnp.asarray(rng.integers(-1, 200, s_q), jnp.int32)
  sink = jnp.asarray(rng.standard_normal(h_q), jnp.float32)
  _check(q, kv, idx, topk_length=lengths, attn_sink=sink)


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_prefill_tail_shares(d_qk, h_q):
  """The SMs' count plus 3 tokens: the last items (3 tokens, or with 128 heads 6 head
  blocks) are taken in shares of their 16 key steps by CTAs that would idle, then
  combined: one token without keys, one whose 5 keys fall in one share, one full,
  under +-inf and finite sinks."""
  rng = np.random.default_rng(d_qk + h_q)
  s_q, topk = _mosaic.num_sms() + 3, 1024
  q, kv, idx = _case(rng, s_q, h_q, d_qk, S_KV, topk)
  lengths = rng.integers(0, topk + 1, s_q)
  lengths[-3:] = 0, 5, topk
  sink = rng.standard_normal(h_q).astype(np.float32)
  sink[::5], sink[1::5] = np.inf, -np.inf
  out, ref = _check(q, kv, idx, topk_length=jnp.asarray(lengths, jnp.int32),
                    attn_sink=jnp.asarray(sink))
  assert rel_err(out[-2:], ref[-2:]) < 1e-2  # the tail tokens with keys, on their own


@pytest.mark.gpu
def test_prefill_tail_with_empty_shares():
  """The SMs' count plus 9 tokens of 64 heads and 16 key steps: the last 9 items go in
  14 shares of 2 steps, so shares 8-13 are empty and start at their index row's end,
  where the half-stage producer's early index loads must not read."""
  s_q, topk = _mosaic.num_sms() + 9, 1024
  r, parts = tail_parts(s_q, _mosaic.num_sms(), topk // 64)
  assert r == 9 and -(-(topk // 64) // parts) * parts > topk // 64  # some shares empty
  rng = np.random.default_rng(9)
  q, kv, idx = _case(rng, s_q, 64, 576, S_KV, topk)
  sink = jnp.asarray(rng.standard_normal(64), jnp.float32)
  out, ref = _check(q, kv, idx, attn_sink=sink)
  assert rel_err(out[-9:], ref[-9:]) < 1e-2  # the tail tokens, on their own


@pytest.mark.gpu
def test_prefill_tail_shares_from_a_later_head_block(monkeypatch):
  """A tail whose first item is a token's second head block, so the combine's rows
  start at head 64 and the sinks are rolled to meet them. On 132 SMs that needs 5 or
  more head blocks a token; here the grid is told the GPU has 7 SMs: 12 tokens of 2
  head blocks are 3 rounds and 3 items, taken in 2 shares each."""
  tokens, h_q, topk, ctas = 12, 128, 1024, 7
  r, parts = tail_parts(tokens * 2, ctas, topk // 64)
  assert (r, parts) == (3, 2) and (tokens * 2 - r) % 2 == 1  # starts at head block 1
  monkeypatch.setattr(mosaic, "num_sms", lambda: ctas)
  jax.clear_caches()  # no program traced for the real SM count may serve this call
  rng = np.random.default_rng(7)
  q, kv, idx = _case(rng, tokens, h_q, 576, S_KV, topk)
  lengths = rng.integers(0, topk + 1, tokens)
  lengths[-2:] = 5, topk
  sink = rng.standard_normal(h_q).astype(np.float32)
  sink[::5], sink[1::5] = np.inf, -np.inf
  out, ref = _check(q, kv, idx, topk_length=jnp.asarray(lengths, jnp.int32),
                    attn_sink=jnp.asarray(sink))
  assert rel_err(out[-2:], ref[-2:]) < 1e-2  # the tail tokens, on their own
  jax.clear_caches()


@pytest.mark.gpu
@pytest.mark.parametrize("h_q", [128, 64, 16, 20])
def test_default_picks_mosaic_on_hopper_for_every_head_count(h_q):
  q = jnp.zeros((2, h_q, 576), jnp.bfloat16)
  assert _mosaic.default_for(mosaic.check_supported, q) == _mosaic.on_hopper()


@pytest.mark.parametrize(("h_q", "blocks"), [(8, (1, 16)), (16, (1, 16)), (20, (1, 32)),
                                             (32, (1, 32)), (48, (2, 32)), (100, (4, 32))])
def test_transposed_tiles(h_q, blocks):
  """The transposed kernels' row tiles: the fewest of at most 32, a multiple of 16."""
  assert _mosaic.transposed_tiles(h_q) == blocks


@pytest.mark.parametrize("h_q", [128, 48, 16, 20])
def test_split_decode_lowers(h_q):
  """The split decode (head-block or transposed kernel, 3 splits, then the Mosaic GPU
  combine) lowers for CUDA; runs without a GPU."""
  fmt = resolve("fp8_ds_mla")
  config = dataclasses.replace(mosaic.default_config(fmt, h_q), num_splits=3)
  s = jax.ShapeDtypeStruct
  lowered = lowers_for_cuda(
      lambda q, cache, idx, sink: mosaic.sparse_decode(
          q, [(cache, idx, None)], sink, fmts=(fmt,), sm_scale=0.1, config=config),
      s((4, h_q, 576), jnp.bfloat16), s((8, 64, 656), jnp.uint8), s((4, 256), jnp.int32),
      s((h_q,), jnp.float32))
  assert lowered.as_text().count("mosaic_gpu_v2") == 2


@pytest.mark.parametrize(("h_q", "pair", "producers"), [(128, True, 1), (128, False, 1),
                                                       (16, False, 1), (16, False, 2)])
def test_decode_with_lengths_lowers(h_q, pair, producers):
  """The gather that masks positions past the lengths itself (topk a multiple of 64):
  head-block with and without the 2-CTA pair, transposed with one and two producers, a
  main and an extra set; runs without a GPU."""
  fmt = resolve("fp8_ds_mla")
  if h_q == 16:  # the transposed kernel with two consumers
    consumer, producer = (168, 88) if producers == 2 else (176, 152)
    config = mosaic.Config(consumer_registers=consumer, producer_registers=producer,
                           producers=producers)
  else:
    config = dataclasses.replace(mosaic.default_config(fmt, h_q), pair=pair)
  s = jax.ShapeDtypeStruct
  text = lowers_for_cuda(
      lambda q, cache, idx, n, e_idx: mosaic.sparse_decode(
          q, [(cache, idx, n), (cache, e_idx, n)], None, fmts=(fmt, fmt), sm_scale=0.1,
          config=config),
      s((4, h_q, 576), jnp.bfloat16), s((8, 64, 656), jnp.uint8), s((4, 256), jnp.int32),
      s((4,), jnp.int32), s((4, 128), jnp.int32)).as_text()
  assert "stablehlo.select" not in text  # no index pre-pass


@pytest.mark.parametrize(("h_q", "sink", "lengths"),
                         [(16, True, False), (16, False, True), (32, True, False),
                          (128, False, False), (128, True, True)])
def test_decode_program_is_the_kernel_alone(h_q, sink, lengths):
  """A decode that needs nothing prepared (no lengths, topk a multiple of 64, one split,
  16, 32 or 128 heads, with or without sinks and per-request lengths) is its kernel
  alone: no lengths or sinks are built for it (the kernel reads a request's lengths for
  each of its query tokens), and the kernel writes the LSE in FlashMLA's ``[b, h_q,
  s_q]`` layout itself, so no transpose follows; runs without a GPU."""
  fmt = resolve("fp8_ds_mla")
  config = dataclasses.replace(mosaic.default_config(fmt, h_q), num_splits=1)
  s = jax.ShapeDtypeStruct
  text = lowers_for_cuda(
      lambda q, cache, idx, sink, n: mosaic.sparse_decode(
          q, [(cache, idx, n)], sink, fmts=(fmt,), sm_scale=0.1, config=config,
          query_len=2)[2],
      s((4, h_q, 576), jnp.bfloat16), s((8, 64, 656), jnp.uint8), s((4, 256), jnp.int32),
      s((h_q,), jnp.float32) if sink else None, s((2,), jnp.int32) if lengths else None
  ).as_text()
  ops = set(re.findall(r"= (stablehlo\.[a-z_]+)", text))
  assert ops <= {"stablehlo.custom_call", "stablehlo.reshape"}, ops


# The transposed kernel's warpgroups: consumers and producers (the defaults are 1c2p at
# 16 heads a CTA and 1c1p at 32; 2c1p was the default before).
TRANSPOSED_CONFIGS = {
    "1c1p": mosaic.Config(consumer_registers=256, producer_registers=256, consumers=1),
    "1c2p": mosaic.Config(consumer_registers=184, producer_registers=160, consumers=1,
                          producers=2),
    "2c1p": mosaic.Config(consumer_registers=176, producer_registers=152),
    "2c2p": mosaic.Config(consumer_registers=168, producer_registers=88, producers=2)}


@pytest.mark.parametrize("name", ["1c1p", "1c2p"])
def test_single_consumer_lowers(name):
  """The transposed kernel with one consumer warpgroup (Config.consumers), decode with
  lengths on a main and an extra set and prefill; runs without a GPU."""
  fmt, config = resolve("fp8_ds_mla"), TRANSPOSED_CONFIGS[name]
  s = jax.ShapeDtypeStruct
  lowers_for_cuda(
      lambda q, cache, idx, n, e_idx: mosaic.sparse_decode(
          q, [(cache, idx, n), (cache, e_idx, n)], None, fmts=(fmt, fmt), sm_scale=0.1,
          config=config),
      s((4, 16, 576), jnp.bfloat16), s((8, 64, 656), jnp.uint8), s((4, 256), jnp.int32),
      s((4,), jnp.int32), s((4, 128), jnp.int32))
  lowers_for_cuda(
      lambda q, kv, idx, lens: mosaic.sparse_prefill(q, kv, idx, None, lens, sm_scale=0.1,
                                                     config=config),
      s((3, 16, 512), jnp.bfloat16), s((100, 512), jnp.bfloat16), s((3, 64), jnp.int32),
      s((3,), jnp.int32))


def test_default_num_splits_fills_the_sms():
  """Small batches split their keys until the CTAs fill the SMs (each split >= 4 steps);
  a batch whose head blocks fill them runs one split."""
  sms = _mosaic.num_sms()
  assert _mosaic.default_num_splits(8, 32) > 1
  assert 8 * _mosaic.default_num_splits(8, 32) <= max(sms, 8)
  assert _mosaic.default_num_splits(sms, 32) == 1
  assert _mosaic.default_num_splits(4, 3) == 1  # under 4 steps a split: none
  assert _mosaic.default_num_splits(4, 3, min_blocks=1) > 1


@pytest.mark.parametrize("h_q,d_qk", [(128, 576), (16, 512), (48, 576), (80, 512)])
def test_prefill_kernels_lower(h_q, d_qk):
  """The prefill kernels (head-block, transposed, head-block with an unpadded last head
  block of 48 or 16 heads) lower for CUDA; runs without a GPU."""
  s_q = 3
  s = jax.ShapeDtypeStruct
  config = mosaic.default_config(None, h_q)
  lowers_for_cuda(
      lambda q, kv, idx, lens: mosaic.sparse_prefill(q, kv, idx, None, lens, sm_scale=0.1,
                                                     config=config),
      s((s_q, h_q, d_qk), jnp.bfloat16), s((100, d_qk), jnp.bfloat16),
      s((s_q, 64), jnp.int32), s((s_q,), jnp.int32))


def test_ragged_heads_read_as_they_are():
  """Which head counts the kernels take unpadded (:func:`mosaic.ragged_heads`, the
  head-block kernel's 64-head blocks; the transposed kernel's 16- or 32-row tiles), and
  that those lower with no copy of the query (a pad) or of the output (a bf16 slice)
  around the kernel (only the sinks are padded, to a whole block); runs without a GPU."""
  idx = [jnp.zeros((8, 1024), jnp.int32)]
  assert mosaic.ragged_heads(48, 8, idx, num_splits=1, query_len=2)
  assert mosaic.ragged_heads(80, 8, idx, num_splits=3, query_len=2)
  assert mosaic.ragged_heads(48, 8, idx, num_splits=1, query_len=None)  # no tail: 8 items
  assert not mosaic.ragged_heads(100, 8, idx, num_splits=1, query_len=2)  # a block of 36
  assert not mosaic.ragged_heads(56, 1, idx, num_splits=1, query_len=1)  # under one box
  tokens = _mosaic.num_sms() + 5  # a persistent prefill's tail shares: whole blocks
  tail_idx = [jnp.zeros((tokens, 1024), jnp.int32)]
  assert not mosaic.ragged_heads(48, tokens, tail_idx, num_splits=1, query_len=None)
  assert mosaic.ragged_heads(48, tokens, tail_idx, num_splits=1, query_len=2)  # a decode

  s = jax.ShapeDtypeStruct
  fmt = resolve("fp8_ds_mla")

  def copies(h_q, tokens, sink=False, num_splits=1):
    text = lowers_for_cuda(
        lambda q, cache, idx, sink: mosaic.sparse_decode(
            q, [(cache, idx, None)], sink if sink.shape else None, fmts=(fmt,),
            sm_scale=0.1, query_len=tokens // 2, config=dataclasses.replace(
                mosaic.default_config(fmt, h_q), num_splits=num_splits)),
        s((tokens, h_q, 576), jnp.bfloat16), s((8, 64, 656), jnp.uint8),
        s((tokens, 256), jnp.int32), s((h_q,) if sink else (), jnp.float32)).as_text()
    return (len(re.findall(r"stablehlo\.pad\b", text)),
            len(re.findall(r"stablehlo\.slice\b.*bf16", text)))

  assert copies(48, 4) == (0, 0)
  assert copies(48, 4, sink=True) == (1, 0)  # the sinks'
  assert copies(100, 4) == (1, 1)  # 36 heads in the last block: padded
  assert copies(8, 4) == copies(24, 4) == (0, 0)  # transposed: 16- and 32-row tiles
  assert copies(8, 4, sink=True) == (1, 0)
  assert copies(20, 4) == (1, 1)  # 20 of a 32-row tile: padded
  assert copies(8, 4, num_splits=3) == (1, 1)  # the split combine reads whole tiles


def test_rejects_interpret():
  q = jnp.zeros((2, 64, 576), jnp.bfloat16)
  with pytest.raises(ValueError, match="no interpreter"):
    sparse_mla_prefill(q, jnp.zeros((8, 576), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32),
                       sm_scale=0.1, implementation="mosaic", interpret=True)


def test_config_register_rule():
  # bf16 prefill: the stages arrive in halves; bf16 decode rows: whole stages.
  assert mosaic.default_config(None) == HALF_STAGES
  assert mosaic.default_config(resolve("auto"), 128) == WHOLE_STAGES
  with pytest.raises(ValueError, match="504 or the kernel hangs"):
    mosaic.Config(consumer_registers=224, producer_registers=64)
  with pytest.raises(ValueError, match="num_stages"):
    mosaic.Config(num_stages=3)
  with pytest.raises(ValueError, match="multiples of 8"):
    mosaic.Config(consumer_registers=210, producer_registers=84)
  # Two producers (the transposed kernel's option): four warpgroups share 512.
  assert _mosaic.register_budget(4) == 512
  assert mosaic.Config(consumer_registers=168, producer_registers=88, producers=2)
  # The transposed kernel: one consumer; two producers beside it at 16 heads a CTA.
  assert _mosaic.register_budget(3) == 504
  assert _mosaic.register_budget(2) == 512
  assert mosaic.default_config(None, 16) == mosaic.Config(
      consumer_registers=232, producer_registers=136, consumers=1, producers=2)
  assert mosaic.default_config(resolve("fp8_ds_mla"), 8).producers == 2
  assert mosaic.default_config(resolve("fp8_ds_mla"), 24) == mosaic.Config(
      consumer_registers=256, producer_registers=256, consumers=1)
  with pytest.raises(ValueError, match="1 \\* consumer_registers"):
    mosaic.Config(consumer_registers=176, producer_registers=152, consumers=1)
  with pytest.raises(ValueError, match="consumers must be 1 or 2"):
    mosaic.Config(consumers=3)
  with pytest.raises(ValueError, match="512 or the kernel hangs"):
    mosaic.Config(consumer_registers=104, producer_registers=144, producers=2)
  with pytest.raises(ValueError, match="num_stages 2"):
    mosaic.Config(num_stages=1, consumer_registers=104, producer_registers=152, producers=2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TRANSPOSED_CONFIGS))
@pytest.mark.parametrize(("d_qk", "h_q"), [(576, 16), (512, 16), (576, 32)])
def test_transposed_configs(d_qk, h_q, name):
  """The transposed kernel's warpgroup splits, lengths from 0 to past topk and an odd
  number of steps (two producers' step counts differ)."""
  rng = np.random.default_rng(8)
  q, kv, idx = _case(rng, S_Q, h_q, d_qk, S_KV, 190)
  lengths = jnp.asarray([190, 0, 77, 190, 3, 64, 65, 1], jnp.int32)
  _check(q, kv, idx, topk_length=lengths, config=TRANSPOSED_CONFIGS[name])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TRANSPOSED_CONFIGS))
@pytest.mark.parametrize("case", [DECODE_CASES[-4], DECODE_CASES[-5]], ids=["m1-x", "ds"])
def test_transposed_configs_decode(case, name):
  """The warpgroup splits across a main and an extra set (two producers: 3 + 4 steps, so
  the set boundary falls between their turns), and on one set."""
  _check_decode(case, TRANSPOSED_CONFIGS[name])


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "pair"), [
    (DECODE_CASES[1], True), (DECODE_CASES[4], False),
    (("fp8_model1", 2, 2, 256, 130, 3, 64, True, True, (70, 5, 64)), True)],
    ids=["ds-pair", "m1-no-pair", "m1-h256-pair"])
def test_pair_setting_decode(case, pair):
  """Config.pair against its per-format default: fp8_ds_mla with the 2-CTA cluster
  (its RoPE columns copied through registers into both CTAs), fp8_model1 without it,
  and h 256 (two clusters per token). The defaults run in test_decode_matches_reference."""
  _check_decode(case, dataclasses.replace(mosaic.default_config(resolve(case[0]), case[3]),
                                          pair=pair))


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "fp8_model1", "fp8_v41", "fp4_v41"])
def test_early_loads_lower(fmt):
  """16 heads (two producers at 160 registers): each quantized format's row loads go out
  as an asm of their own, issued before the producer waits for the slot (its valid
  flag is operand n + 2, after the n loaded words), and the whole decode, with an
  extra set and lengths, lowers for CUDA; runs without a GPU."""
  from jax_mla.cache.formats import kv_cache_shape, kv_cache_storage_dtype
  from jax_mla.sparse_mla import mosaic_gather
  f = resolve(fmt)
  config = mosaic.default_config(f, 16)
  assert config.producers == 2 and config.producer_registers >= mosaic_gather.EARLY_MIN_REGISTERS
  d_qk = 576 if fmt == "fp8_ds_mla" else 512
  s = jax.ShapeDtypeStruct
  cache = s(kv_cache_shape(8, 64, d_qk, fmt), kv_cache_storage_dtype(fmt))
  text = lowers_for_cuda(
      lambda q, c, idx, n, e_idx: mosaic.sparse_decode(
          q, [(c, idx, n), (c, e_idx, n)], None, fmts=(f, f), sm_scale=0.1, config=config),
      s((4, 16, d_qk), jnp.bfloat16), cache, s((4, 256), jnp.int32), s((4,), jnp.int32),
      s((4, 128), jnp.int32)).as_text()
  words = len(mosaic_gather._dequant_asm(f, 0).loaded)
  assert f"setp.ne.b32 p0, ${words + 2}, 0;" in text


def test_early_rope_copies_need_early_loads_and_rope_columns():
  """A gather issues its RoPE copies apart from the rest (``early_rope``: the transposed
  kernel's producers issue them once the consumer has the slot's ``S^T``) only with early
  loads of rows that have RoPE columns: ``kernel_inputs`` turns it on for fp8_ds_mla at
  d_qk 576 and leaves it off at 512 or without early loads; ``gather_fn`` refuses it
  otherwise. Runs without a GPU."""
  from jax_mla.cache.formats import kv_cache_shape, kv_cache_storage_dtype
  from jax_mla.sparse_mla import mosaic_gather

  def early_rope(fmt, d_qk, early):
    f = resolve(fmt)
    cache = jnp.zeros(kv_cache_shape(8, 64, d_qk, fmt), kv_cache_storage_dtype(fmt))
    gathers, *_ = mosaic_gather.kernel_inputs(
        [(cache, jnp.zeros((4, 128), jnp.int32), None)], (f,), d_qk, early=early,
        early_rope=True)
    return gathers[0].early_rope

  assert early_rope("fp8_ds_mla", 576, early=True)
  assert not early_rope("fp8_ds_mla", 576, early=False)
  assert not early_rope("fp8_model1", 512, early=True)
  with pytest.raises(ValueError, match="early RoPE"):
    mosaic_gather.gather_fn(fmt=resolve("fp8_ds_mla"), num_slots=512, block_size=64,
                            row_bytes=656, d_qk=576, early_rope=True)


@pytest.mark.parametrize(("fmt", "h_q", "pair"), [
    ("fp8_model1", 128, True), ("fp8_v41", 256, True), ("fp4_v41", 128, True),
    ("fp8_ds_mla", 128, False), ("fp8_model1", 64, False), (None, 128, False)])
def test_pair_default(fmt, h_q, pair):
  """The 2-CTA cluster is the default where it was measured faster (Config.pair)."""
  assert mosaic.default_config(fmt and resolve(fmt), h_q).pair is pair


@pytest.mark.parametrize("cfg", [
    mosaic.Config(consumer_registers=104, producer_registers=152, producers=2),
    mosaic.Config(consumer_registers=256, producer_registers=256, consumers=1)])
def test_head_block_kernel_needs_one_producer_two_consumers(cfg):
  q = jnp.zeros((2, 64, 576), jnp.bfloat16)
  with pytest.raises(ValueError, match="one producer and two consumers"):
    mosaic.attend(q, [(jnp.zeros((1, 8, 576), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32),
                       jnp.full((2,), 4, jnp.int32))], None, fmts=(None,), sm_scale=0.1,
                  config=cfg)


@pytest.mark.gpu
def test_nan_query_row_is_nan():
  rng = np.random.default_rng(6)
  q, kv, idx = _case(rng, S_Q, 64, 576, S_KV, 65)  # test_odd_topk[65]'s kernel
  q = q.at[1].set(jnp.nan)
  out, ml, lse = (np.asarray(x, np.float32) for x in sparse_mla_prefill(
      q, kv, idx, sm_scale=576 ** -0.5, implementation="mosaic"))
  assert np.isnan(out[1]).all() and np.isnan(ml[1]).all() and np.isnan(lse[1]).all()
  assert not np.isnan(out[[0, 2]]).any()


@pytest.mark.parametrize("stats", [(4, 56), (3, 48), (4, 5, 16), (4, 3, 15), (4, 0, 16)])
def test_combine_refuses_stats_it_cannot_read(stats):
  """The combine's LSE and max parts: ``[S, n]``, or ``[S, m, pitch]`` with the first ``n /
  m`` of each row used; anything else is refused before the kernel is built (CPU)."""
  from jax_mla import merge_mosaic
  out = jnp.zeros((4, 48, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="lse and max parts"):
    merge_mosaic.combine(out, jnp.zeros(stats, jnp.float32), jnp.zeros(stats, jnp.float32), None,
                         heads=16)
  with pytest.raises(ValueError, match="lse and max parts"):  # max not shaped as the LSE
    merge_mosaic.combine(out, jnp.zeros((4, 3, 32), jnp.float32), jnp.zeros((4, 48), jnp.float32),
                         None, heads=16)


@pytest.mark.gpu
@pytest.mark.parametrize("pitch", [None, 32])
def test_gpu_mosaic_combine_matches_combine_splits(pitch):
  """The split decodes' Mosaic GPU combine against :func:`combine_splits` with the sinks
  applied as the sparse kernels do: parts without keys (+inf and -inf LSE), a row empty
  in every part, sinks of -inf, +inf and finite values, four parts. ``pitch``: the LSE
  and max parts come as the transposed kernels write them, 16 heads in rows of 32 (NaN
  in the 16 unused)."""
  from jax_mla import merge_mosaic
  from jax_mla.merge import combine_splits
  if not _mosaic.on_hopper():
    pytest.skip("needs a Hopper GPU and jax >= 0.11 (Mosaic GPU)")
  rng = np.random.default_rng(5)
  parts, n, d, heads = 4, 48, 512, 16
  out = jnp.asarray(rng.standard_normal((parts, n, d)), jnp.bfloat16)
  lse = rng.standard_normal((parts, n)).astype(np.float32) * 3
  lse[0, :5], lse[1, 3:9] = np.inf, -np.inf
  lse[:, 20] = np.inf  # empty in every part
  mx = rng.standard_normal((parts, n)).astype(np.float32)
  sink = rng.standard_normal(heads).astype(np.float32)
  sink[0], sink[1] = -np.inf, np.inf
  stats = [lse, mx]
  if pitch is not None:
    for k, x in enumerate(stats):
      stats[k] = np.full((parts, n // heads, pitch), np.nan, np.float32)
      stats[k][..., :heads] = x.reshape(parts, n // heads, heads)
  got = jax.jit(functools.partial(merge_mosaic.combine, heads=heads))(
      out, *map(jnp.asarray, stats), jnp.asarray(sink))
  want_out, want_lse = combine_splits(out, jnp.asarray(lse), jnp.float32)
  kept = 1 / (1 + np.exp(np.tile(sink, n // heads) - np.asarray(want_lse)))
  want_out = np.asarray(want_out) * np.where(np.isposinf(want_lse), 0, kept)[:, None]
  assert rel_err(got[0], want_out) < 1e-2
  np.testing.assert_array_equal(np.asarray(got[0], np.float32)[20], 0)
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got[1]), mx.max(0))


def test_tail_parts():
  """A persistent grid's last items share out to the CTAs that would idle, in at most
  one share a key step, where they leave more than half the last round idle and have
  16 steps or more."""
  assert tail_parts(4096, 132, 32) == (4, 32)
  assert tail_parts(4096, 132, 16) == (4, 16)
  assert tail_parts(4096, 132, 8) == (0, 1)  # short items
  assert tail_parts(4092, 132, 32) == (0, 1)  # whole rounds
  assert tail_parts(256, 132, 32) == (0, 1)  # 124 of 132 in the last round
  assert tail_parts(200, 132, 16) == (0, 1)  # 68 of 132: more than half full
  assert tail_parts(180, 132, 16) == (48, 2)


@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_prefill_tail_shares_lower(h_q):
  """A prefill whose tokens leave a short last round (the SMs plus 5) lowers for CUDA
  with the tail items' shares and their combine (transposed, head-block kernel with
  one and two head blocks a token): two Mosaic GPU kernels."""
  s = jax.ShapeDtypeStruct
  tokens = _mosaic.num_sms() + 5
  text = lowers_for_cuda(
      lambda q, kv, idx, sink, lens: mosaic.sparse_prefill(
          q, kv, idx, sink, lens, sm_scale=0.1, config=mosaic.default_config(None, h_q)),
      s((tokens, h_q, 576), jnp.bfloat16), s((1000, 576), jnp.bfloat16),
      s((tokens, 1024), jnp.int32), s((h_q,), jnp.float32), s((tokens,), jnp.int32)).as_text()
  assert text.count("mosaic_gpu_v2") == 2
