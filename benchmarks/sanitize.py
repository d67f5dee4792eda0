"""One call of each GPU kernel on small adversarial inputs, for ``compute-sanitizer``.

  compute-sanitizer --tool memcheck python -m benchmarks.sanitize [--only NAME,...]

No references and no timing: under memcheck every XLA kernel is instrumented too,
and a test file's reference computations made earlier runs too slow to finish.
Inputs name invalid indices and block ids of every kind (negative, ``-2**31``,
``2**31 - 1``, one past the end) and hold NaN in every slot no index names, so
a kernel that reads what it must not shows up as an error or a non-finite output.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import _mosaic
from jax_mla.cache import (
  concat_and_cache_mla,
  kv_cache_shape,
  quantize_fp4_v41,
  quantize_fp8_ds_mla,
  quantize_fp8_model1_cache,
  quantize_fp8_v41,
)
from jax_mla.cache.formats import resolve
from jax_mla.dense_decode import mla_decode_paged
from jax_mla.dense_prefill import mla_prefill
from jax_mla.paged import paged_attention
from jax_mla.sparse_mla import mosaic, sparse_mla_decode, sparse_mla_prefill

BAD = np.asarray([-1, -2**31, 2**31 - 1, -123456])


def _bad_indices(rng, shape, num_slots):
  idx = rng.integers(0, num_slots, shape)
  bad = np.concatenate([BAD, [num_slots, num_slots + 7]])
  return np.where(rng.random(shape) < 0.2, bad[rng.integers(0, bad.size, shape)], idx
                  ).astype(np.int32)


def _nan_unused(rows, idx):
  """``rows[num_slots, ...]`` float32 with NaN in every slot that ``idx`` does not name."""
  used = np.zeros(rows.shape[0], bool)
  used[idx[(idx >= 0) & (idx < rows.shape[0])]] = True
  rows[~used] = np.nan
  return rows


def sparse_prefill(impl):
  """Both ``d_qk``; 128 heads and 24 (Mosaic GPU: the transposed kernel, padded heads);
  topk 150 (Mosaic GPU: the index pre-pass) and 192 (the gather masks the lengths); topk
  1024 at 128 and 64 heads; 16 and 64 heads over 271 tokens; 16 and 128 heads over 135
  tokens of topk 1024; 64 heads over 141 full-length tokens of topk 1024."""
  rng = np.random.default_rng(0)
  for d_qk, h_q, topk in ((576, 128, 150), (512, 128, 150), (576, 24, 150), (576, 128, 192),
                          (576, 24, 192), (576, 128, 1024), (512, 64, 1024)):
    s_q, s_kv = 5, 300
    idx = _bad_indices(rng, (s_q, topk), s_kv)
    kv = _nan_unused(rng.standard_normal((s_kv, d_qk)).astype(np.float32) / 3, idx)
    q = rng.standard_normal((s_q, h_q, d_qk)) / 3
    lengths = np.asarray([topk, 0, 64, 65, 3 if topk == 150 else 500], np.int32)
    yield sparse_mla_prefill(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16),
                             jnp.asarray(idx), sm_scale=d_qk ** -0.5, topk_length=lengths,
                             attn_sink=jnp.zeros((h_q,), jnp.float32), implementation=impl)[0]
  # More tokens than an H100 has SMs (Mosaic GPU: persistent CTAs, each taking two or
  # more items of uneven length, the ring and query buffers running on between them);
  # 135 tokens of 16 steps: the last round's items taken in shares, combined after.
  s_kv = 300
  for s_q, topk, h_q in ((271, 192, 16), (271, 192, 64), (135, 1024, 16), (135, 1024, 128)):
    idx = _bad_indices(rng, (s_q, topk), s_kv)
    kv = _nan_unused(rng.standard_normal((s_kv, 576)).astype(np.float32) / 3, idx)
    q = rng.standard_normal((s_q, h_q, 576)) / 3
    yield sparse_mla_prefill(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16),
                             jnp.asarray(idx), sm_scale=576 ** -0.5,
                             topk_length=jnp.asarray(rng.integers(-1, topk + 68, s_q), jnp.int32),
                             attn_sink=jnp.zeros((h_q,), jnp.float32), implementation=impl)[0]
  # 141 tokens of 16 steps at 64 heads: the 9 items past 132 go in 14 shares of 2 steps,
  # so shares 8-13 are empty and start at their index row's end.
  s_q, topk = 141, 1024
  idx = _bad_indices(rng, (s_q, topk), s_kv)
  kv = _nan_unused(rng.standard_normal((s_kv, 576)).astype(np.float32) / 3, idx)
  q = rng.standard_normal((s_q, 64, 576)) / 3
  yield sparse_mla_prefill(jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16),
                           jnp.asarray(idx), sm_scale=576 ** -0.5, implementation=impl)[0]

QUANTIZE = {"fp8_ds_mla": quantize_fp8_ds_mla, "fp8_model1": quantize_fp8_model1_cache,
            "fp8_v41": quantize_fp8_v41, "fp4_v41": quantize_fp4_v41}


def sparse_decode(impl):
  """Each format, the V4 / V4.1 ones with an extra set (V4.1: also fp8 main + fp4 extra);
  64 heads; 128 on fp8_model1 and the V4.1 pair (Mosaic GPU: a 2-CTA cluster sharing
  the gather); 16 on fp8_ds_mla and fp8_model1 (Mosaic GPU: the transposed kernel);
  128 heads at s_q 1, whose keys split over CTAs."""
  rng = np.random.default_rng(1)
  b, s_q = 2, 2

  def cache(num_blocks, block_size, topk, fmt, d_qk, s_q=s_q):
    idx = _bad_indices(rng, (b, s_q, topk), num_blocks * block_size)
    rows = _nan_unused(rng.standard_normal((num_blocks * block_size, d_qk)).astype(np.float32),
                       idx.ravel())
    rows = jnp.asarray(rows.reshape(num_blocks, block_size, d_qk), jnp.bfloat16)
    return QUANTIZE[fmt](rows), jnp.asarray(idx)

  for fmt, extra_fmt, d_qk, bs, extra_bs, h_q in (
      ("fp8_ds_mla", None, 576, 64, None, 64), ("fp8_model1", "fp8_model1", 512, 64, 2, 64),
      ("fp8_v41", "fp8_v41", 512, 64, 2, 64), ("fp8_v41", "fp4_v41", 512, 64, 2, 64),
      ("fp4_v41", None, 512, 16, None, 64), ("fp8_model1", "fp8_model1", 512, 64, 2, 128),
      ("fp8_v41", "fp4_v41", 512, 64, 2, 128), ("fp8_ds_mla", None, 576, 64, None, 16),
      ("fp8_model1", "fp8_model1", 512, 64, 2, 16)):
    main, idx = cache(5, bs, 100, fmt, d_qk)
    extra = cache(7, extra_bs, 33, extra_fmt, d_qk) if extra_bs else (None, None)
    kw = {"extra_kv_cache_dtype": extra_fmt} if extra_bs else {}
    q = jnp.asarray(rng.standard_normal((b, s_q, h_q, d_qk)) / 3, jnp.bfloat16)
    yield sparse_mla_decode(q, main, idx, kv_cache_dtype=fmt, extra_kv_cache=extra[0],
                            extra_indices=extra[1], topk_length=jnp.asarray([100, 7], jnp.int32),
                            implementation=impl, **kw)[0]
  # Lengths the gather masks itself (topk and extra topk multiples of 64): head-block,
  # the 2-CTA pair (fp8_model1 at 128 heads) and transposed.
  for fmt, d_qk, h_q in (("fp8_ds_mla", 576, 64), ("fp8_model1", 512, 128),
                         ("fp8_ds_mla", 576, 16)):
    main, idx = cache(5, 64, 128, fmt, d_qk)
    extra = cache(7, 2, 64, fmt, d_qk)
    q = jnp.asarray(rng.standard_normal((b, s_q, h_q, d_qk)) / 3, jnp.bfloat16)
    yield sparse_mla_decode(q, main, idx, kv_cache_dtype=fmt, extra_kv_cache=extra[0],
                            extra_indices=extra[1], topk_length=jnp.asarray([100, 7], jnp.int32),
                            extra_topk_length=jnp.asarray([64, 3], jnp.int32),
                            implementation=impl)[0]
  # One split at 16, 20 (padded to 32), 8 and 48 heads with sinks, no lengths, topk a
  # multiple of 64: the kernel alone reads its sinks from GMEM and writes the LSE in
  # FlashMLA's [b, h_q, s_q] layout itself (Mosaic GPU: transposed; 48 heads on the
  # head-block kernel; at 8 and 48 the last head block is unpadded: its query copy reads
  # past the last token's heads and its stores stop at them).
  for h_q in (16, 20, 8, 48):
    main, idx = cache(5, 64, 128, "fp8_ds_mla", 576)
    q = jnp.asarray(rng.standard_normal((b, s_q, h_q, 576)) / 3, jnp.bfloat16)
    config = (dataclasses.replace(mosaic.default_config(resolve("fp8_ds_mla"), h_q),
                                  num_splits=1) if impl == "mosaic" else None)
    yield from sparse_mla_decode(q, main, idx, attn_sink=jnp.linspace(-2, 2, h_q),
                                 implementation=impl, config=config)
  # 16 heads, 150 x 2 tokens: persistent CTAs taking two or three tokens each.
  main, idx = cache(5, 64, 100, "fp8_ds_mla", 576)
  idx = jnp.tile(idx, (75, 1, 1))
  q = jnp.asarray(rng.standard_normal((150, s_q, 16, 576)) / 3, jnp.bfloat16)
  yield sparse_mla_decode(q, main, idx, topk_length=jnp.asarray(rng.integers(0, 110, 150),
                                                                 jnp.int32),
                          attn_sink=jnp.linspace(-2, 2, 16), implementation=impl)[0]
  # Small batches split each token's keys over CTAs (Mosaic GPU: then a combine kernel):
  # without topk lengths and topk a multiple of 64 (no index pre-pass), with them (masked
  # by the gather), and with a topk that needs the pre-pass.
  sink = jnp.asarray([-np.inf, np.inf] + [0.5] * 126, jnp.float32)
  for topk, lengths in ((512, None), (640, jnp.asarray([600, 9], jnp.int32)),
                        (600, jnp.asarray([600, 9], jnp.int32))):
    main, idx = cache(12, 64, topk, "fp8_ds_mla", 576, s_q=1)
    q = jnp.asarray(rng.standard_normal((b, 1, 128, 576)) / 3, jnp.bfloat16)
    yield sparse_mla_decode(q, main, idx, topk_length=lengths, attn_sink=sink,
                            implementation=impl)[0]


def dense_decode(impl):
  rng = np.random.default_rng(2)
  page, d = 64, 576
  seqlens = np.asarray([0, 1, 63, 65, 333], np.int32)
  b, max_blocks = seqlens.size, 6
  num_blocks = b * max_blocks + 3
  bt = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
  cache = np.full((num_blocks, page, d), np.nan, np.float32)
  for i, s in enumerate(seqlens):
    n = -(-s // page)
    for j in range(n):
      cache[bt[i, j], : min(page, s - j * page)] = rng.standard_normal((min(page, s - j * page), d))
    bt[i, n:] = BAD[np.arange(max_blocks - n) % BAD.size]
  cache, bt, seqlens = jnp.asarray(cache, jnp.bfloat16), jnp.asarray(bt), jnp.asarray(seqlens)
  q = jnp.asarray(rng.standard_normal((b, 1, 64, d)) / 3, jnp.bfloat16)
  yield mla_decode_paged(q, cache, bt, seqlens, causal=False, implementation=impl)[0]
  # Two query tokens in one split: the Mosaic GPU kernel stores the LSE row by row (the
  # empty request's is +inf, so only the output is checked for finiteness).
  q = jnp.asarray(rng.standard_normal((b, 2, 64, d)) / 3, jnp.bfloat16)
  yield mla_decode_paged(q, cache, bt, seqlens, causal=True, num_kv_splits=1,
                         implementation=impl)[0]


def dense_prefill(impl):
  rng = np.random.default_rng(3)
  lens = np.asarray([0, 1, 70, 129], np.int32)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
  t = int(lens.sum())
  q, k = (jnp.asarray(rng.standard_normal((t, 4, 192)), jnp.bfloat16) for _ in range(2))
  v = jnp.asarray(rng.standard_normal((t, 4, 128)), jnp.bfloat16)
  yield mla_prefill(q, k, v, cu, cu, max_seqlen_q=129, max_seqlen_k=129, sm_scale=None,
                    causal=True, implementation=impl)


def cache_write(impl):
  """Each format and input form; slots of every bad kind, the cache's last slot, fewer
  slots than tokens, a token count that leaves a CTA's warps idle."""
  rng = np.random.default_rng(4)
  nb, bs, T = 3, 16, 13
  slots = np.concatenate([[nb * bs - 1, nb * bs, 0], BAD, rng.integers(0, nb * bs, 3)])
  slots = jnp.asarray(slots.astype(np.int32))  # 10 < T
  for fmt, nope, rope in (("fp8_ds_mla", 512, 64), ("fp8_model1", 448, 64),
                          ("fp8_model1", 512, 0), ("auto", 512, 64), ("fp8", 512, 64),
                          ("fp8_v41", 448, 64), ("fp8_v41", 512, 0), ("fp4_v41", 448, 64)):
    kv_c, k_pe = (jnp.asarray(rng.standard_normal((T, w)), jnp.bfloat16) for w in (nope, rope))
    cache = jnp.zeros(kv_cache_shape(nb, bs, nope + rope, fmt),
                      jnp.bfloat16 if fmt == "auto" else jnp.uint8)
    yield concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype=fmt, scale=0.5,
                               implementation=impl)


def paged(impl):
  """bf16 and fp8 caches, 8 and 20 heads a KV head (20: two warps, the second with 4),
  head sizes 64 and 128, 1 and 2 splits; block ids of every bad kind past and inside the
  sequences; NaN in every slot no sequence owns; a sequence of 0 tokens and one ending
  mid-step."""
  rng = np.random.default_rng(5)
  for d in (64, 128):  # 128: the output written by the kernel (1 split) or by the combine
    yield from _paged_cases(rng, impl, d)


def _paged_cases(rng, impl, d):
  bs, hkv = 16, 2
  lens = np.asarray([0, 1, 37, 70, 129], np.int32)
  max_blocks = 10
  nb = lens.size * max_blocks + 2
  bt = rng.permutation(nb)[: lens.size * max_blocks].reshape(lens.size, max_blocks)
  for i, n in enumerate(lens):
    bt[i, -(-n // bs):] = BAD[np.arange(max_blocks - (-(-n // bs))) % BAD.size]
  bt[3, 1] = -1  # inside sequence 3
  k = np.full((nb, hkv, bs, d), np.nan, np.float32)
  v = np.full((nb, hkv, bs, d), np.nan, np.float32)
  for i, n in enumerate(lens):
    for t in range(n):
      blk = bt[i, t // bs]
      if 0 <= blk < nb:
        k[blk, :, t % bs], v[blk, :, t % bs] = rng.standard_normal((2, hkv, d))
  for dtype, group in ((jnp.bfloat16, 8), (jnp.float8_e4m3fn, 20)):
    x = 16 // jnp.dtype(dtype).itemsize
    kc = jnp.asarray(k.reshape(nb, hkv, bs, d // x, x).transpose(0, 1, 3, 2, 4), dtype)
    vc = jnp.asarray(v.transpose(0, 1, 3, 2), dtype)
    q = jnp.asarray(rng.standard_normal((lens.size, hkv * group, d)), jnp.bfloat16)
    for splits in (1, 2):
      yield paged_attention(q, kc, vc, jnp.asarray(bt.astype(np.int32)), jnp.asarray(lens),
                            scale=0.125, num_kv_splits=splits, implementation=impl)


KERNELS = {
    "sparse_prefill_triton": (sparse_prefill, "triton"),
    "sparse_prefill_mosaic": (sparse_prefill, "mosaic"),
    "sparse_decode_triton": (sparse_decode, "triton"),
    "sparse_decode_mosaic": (sparse_decode, "mosaic"),
    "dense_decode_mosaic": (dense_decode, "mosaic"),
    "dense_decode_triton": (dense_decode, "triton"),
    "dense_prefill_triton": (dense_prefill, "triton"),
    "cache_write_mosaic": (cache_write, "mosaic"),
    "cache_write_triton": (cache_write, "triton"),
    "paged_mosaic": (paged, "mosaic"),
    "paged_triton": (paged, "triton"),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", default=",".join(KERNELS))
  args = ap.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  bad = 0
  for name in args.only.split(","):
    fn, impl = KERNELS[name]
    if impl == "mosaic" and not _mosaic.default_for(
        mosaic.check_supported, jnp.zeros((1, 64, 576), jnp.bfloat16)):
      print(f"{name}: skipped (needs Hopper and jax >= 0.11)", flush=True)
      continue
    for out in fn(impl):
      finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
      bad += not finite
      print(f"{name}: ran, output {'finite' if finite else 'NOT FINITE'}", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
