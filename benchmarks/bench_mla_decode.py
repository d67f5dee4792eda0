"""Dense MLA decode on the GPU: correctness vs the reference, then the BENCHMARKS.md rows.

Run on the device machine: ``PYTHONPATH=$PWD python3 benchmarks/bench_mla_decode.py``.
Timing: wall clock over many back-to-back jitted calls (asynchronous dispatch keeps
the GPU busy), median of several rounds; the KV cache is far larger than L2.
FLOPs follow FlashMLA: ``2 * b * s_q * h_q * seqlen * (576 + 512)``; bandwidth
counts the KV bytes read once.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.dense_decode import api, mla_decode, mla_decode_paged
from jax_mla.dense_decode import pallas as kern

D = 576


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  if not np.isfinite(a).all():
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _paged_inputs(key, b, s_q, h_q, seqlen, block_size, *, varlen=False, nan_tail=False):
  max_blocks = -(-seqlen // block_size) + (1 if varlen else 0)
  kq, kc, kp, kl = jax.random.split(key, 4)
  q = (jax.random.normal(kq, (b, s_q, h_q, D), jnp.float32) / 10).astype(jnp.bfloat16)
  cache = (jax.random.normal(kc, (b * max_blocks, block_size, D), jnp.float32) / 10
           ).astype(jnp.bfloat16)
  bt = jax.random.permutation(kp, b * max_blocks).reshape(b, max_blocks).astype(jnp.int32)
  if varlen:
    seqs = jax.random.randint(kl, (b,), 0, max_blocks * block_size + 1, jnp.int32)
  else:
    seqs = jnp.full((b,), seqlen, jnp.int32)
  if nan_tail:  # poison every slot past each sequence
    pos = jnp.arange(max_blocks * block_size)
    dead = pos[None, :] >= seqs[:, None]  # [b, keys]
    flat = cache.reshape(-1, D)
    slot = (bt[:, :, None] * block_size + jnp.arange(block_size)).reshape(b, -1)
    flat = flat.at[jnp.where(dead, slot, flat.shape[0])].set(jnp.nan, mode="drop")
    cache = flat.reshape(cache.shape)
  return q, cache, bt, seqs


def correctness():
  rows = []
  key = jax.random.PRNGKey(0)
  for b, s_q, h_q, seqlen, bs, causal in [
      (8, 1, 128, 1000, 64, False), (6, 2, 128, 700, 64, True), (16, 1, 16, 3000, 64, False),
      (5, 4, 20, 333, 16, True), (3, 1, 64, 129, 1, False)]:
    q, cache, bt, seqs = _paged_inputs(key, b, s_q, h_q, seqlen, bs, varlen=True, nan_tail=True)
    name = f"paged b{b} s_q{s_q} h{h_q} len<={seqlen} bs{bs} causal={causal}"
    try:
      o, l = mla_decode_paged(q, cache, bt, seqs, causal=causal, implementation="pallas")
      ro, rl = mla_decode_paged(q, cache, bt, seqs, causal=causal, implementation="xla")
      lerr = float(np.nanmax(np.abs(np.asarray(l) - np.asarray(rl))))
      rows.append((name, _rel(o, ro), lerr))
    except Exception as e:  # noqa: BLE001 - report every case
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
      rows.append((name, float("inf"), float("inf")))
  # AITER convention: flat page_size 1, splits, fp8 cache with scales.
  for h_q, s_q, splits, fp8 in [(16, 1, None, False), (128, 2, 4, False), (16, 1, 8, True),
                                (128, 1, None, True)]:
    b, n = 12, 900
    kq, kc, kl = jax.random.split(jax.random.fold_in(key, h_q * 10 + s_q), 3)
    lens = jax.random.randint(kl, (b,), 1, n, jnp.int32)
    kv_indptr = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens)]).astype(jnp.int32)
    total = int(kv_indptr[-1])
    kv_indices = jax.random.permutation(kc, total + 64)[:total].astype(jnp.int32)
    cache = (jax.random.normal(kc, (total + 64, 1, D)) / 10).astype(jnp.bfloat16)
    qo = jnp.arange(b + 1, dtype=jnp.int32) * s_q
    q = (jax.random.normal(kq, (b * s_q, h_q, D)) / 10).astype(jnp.bfloat16)
    last = jnp.ones((b,), jnp.int32)
    kw = dict(max_seqlen_q=s_q)
    if fp8:
      cache = (cache.astype(jnp.float32) / 0.01).astype(jnp.float8_e4m3fn)
      kw.update(kv_scale=0.01)
    name = f"aiter b{b} s_q{s_q} h{h_q} ps1 splits={splits} fp8={fp8}"
    try:
      o, l = mla_decode(q, cache, qo, kv_indptr, kv_indices, last, num_kv_splits=splits,
                        implementation="pallas", **kw)
      ro, rl = mla_decode(q, cache, qo, kv_indptr, kv_indices, last, implementation="xla", **kw)
      rows.append((name, _rel(o, ro), float(np.max(np.abs(np.asarray(l) - np.asarray(rl))))))
    except Exception as e:  # noqa: BLE001 - report every case
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
      rows.append((name, float("inf"), float("inf")))
  print("\n== correctness (pallas vs xla reference) ==")
  ok = True
  for name, e, le in rows:
    good = e < 1e-2 and le < 1e-3
    ok &= good
    print(f"{name:55s} rel_err {e:.2e}  lse max abs err {le:.2e}  {'OK' if good else 'FAIL'}")
  return ok


def _time(fn, *args, reps=20, rounds=3):
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  out = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(reps):
      r = fn(*args)
    jax.block_until_ready(r)
    out.append((time.perf_counter() - t0) / reps)
  return statistics.median(out)


def bench():
  print(f"\n== benchmarks ({jax.devices()[0].device_kind}, SMs {kern.num_sms()}) ==")
  rows = []
  cases = [
      ("b128 s_q1 h128 len4096 bs64", 128, 1, 128, 4096, 64, 554.0, None),
      ("b64 s_q2 h128 len8192 bs64", 64, 2, 128, 8192, 64, 628.0, None),
      ("b132 s_q1 h16 len8192 bs64", 132, 1, 16, 8192, 64, None, 2.75),
  ]
  for name, b, s_q, h_q, seqlen, bs, anchor_tf, anchor_tb in cases:
    q, cache, bt, seqs = _paged_inputs(jax.random.PRNGKey(1), b, s_q, h_q, seqlen, bs)
    flops = 2 * b * s_q * h_q * seqlen * (576 + 512)
    kv_bytes = b * seqlen * D * 2
    rows_per_group = s_q * h_q
    meta = api.paged_groups(bt, seqs, s_q=s_q, page_size=bs)
    q2d = q.reshape(-1, D)
    kv2d = cache.reshape(-1, D)
    scales = kern.kernel_scales(D**-0.5)
    auto_bm = kern.default_block_m(rows_per_group)
    auto_bn, auto_w, auto_st = kern.default_config(auto_bm)
    auto_s = kern.default_num_splits(b * -(-rows_per_group // auto_bm), seqlen, block_m=auto_bm,
                                     block_n=auto_bn)
    sweep = [(auto_bm, auto_bn, auto_w, auto_st, auto_s)]
    if auto_bm >= 64:
      sweep += [(64, 64, 8, 1, auto_s), (64, 32, 8, 3, auto_s), (32, 64, 4, 2, auto_s),
                (64, 32, 8, 2, 2 * auto_s)]
    else:
      sweep += [(16, 64, 4, 2, auto_s), (16, 64, 4, 3, auto_s), (16, 64, 4, 2, 2 * auto_s),
                (16, 32, 4, 3, 4 * auto_s), (16, 128, 4, 1, auto_s)]
    for bm, bn, nw, ns, splits in sweep:
      fn = jax.jit(functools.partial(
          kern.paged_mla_decode, h_q=h_q, rows_per_group=rows_per_group, page_size=bs,
          causal=False, num_splits=splits, block_m=bm, block_n=bn, num_warps=nw,
          num_stages=ns, out_dtype=jnp.bfloat16, interpret=False))
      try:
        t = _time(fn, q2d, kv2d, meta, bt.reshape(-1), scales)
      except Exception as e:  # noqa: BLE001 - report and go on with the sweep
        print(f"{name} bm{bm} bn{bn} w{nw} st{ns} S{splits}: FAILED {type(e).__name__}: "
              f"{str(e)[:200]}")
        continue
      tf, tb = flops / t / 1e12, kv_bytes / t / 1e12
      print(f"{name:30s} bm{bm:3d} bn{bn:3d} w{nw} st{ns} S{splits:2d}: {t*1e6:8.1f} us "
            f"{tf:6.1f} TFLOP/s {tb:5.2f} TB/s", flush=True)
      rows.append((name, (bm, bn, nw, ns, splits), t, tf, tb, anchor_tf, anchor_tb))
    # The public entry point (metadata + heuristics included).
    pub = jax.jit(lambda q, c, bt, s: mla_decode_paged(q, c, bt, s))
    t = _time(pub, q, cache, bt, seqs)
    print(f"{name:30s} public mla_decode_paged: {t*1e6:8.1f} us {flops/t/1e12:6.1f} TFLOP/s "
          f"{kv_bytes/t/1e12:5.2f} TB/s", flush=True)
    rows.append((name, "public", t, flops / t / 1e12, kv_bytes / t / 1e12, anchor_tf, anchor_tb))
  print("\n== summary (best config per row, and the public API) ==")
  for name in dict.fromkeys(r[0] for r in rows):
    mine = [r for r in rows if r[0] == name]
    best = min(mine, key=lambda r: r[2])
    pub = [r for r in mine if r[1] == "public"][0]
    for tag, r in (("best", best), ("public", pub)):
      anchor = (f"{r[3]/r[5]:.2f}x of FlashMLA {r[5]:.0f} TFLOP/s" if r[5] else
                f"{r[4]/r[6]:.2f}x of FlashMLA {r[6]:.2f} TB/s")
      print(f"{name:30s} {tag:6s} {str(r[1]):24s} {r[2]*1e6:8.1f} us {r[3]:6.1f} TFLOP/s "
            f"{r[4]:5.2f} TB/s  {anchor}")


def memcheck_case():
  """One small call of each path (NaN tails, invalid ids, splits) for compute-sanitizer."""
  q, cache, bt, seqs = _paged_inputs(jax.random.PRNGKey(3), 3, 2, 16, 200, 64, varlen=True,
                                     nan_tail=True)
  bt = bt.at[:, -1].set(2147480000)
  o, _ = mla_decode_paged(q, cache, bt, seqs, causal=True)
  q1 = q.reshape(6, 16, D)
  o2, _ = mla_decode(q1, cache.reshape(-1, 1, D), jnp.array([0, 2, 4, 6], jnp.int32),
                     jnp.array([0, 50, 60, 200], jnp.int32), jnp.arange(200, dtype=jnp.int32),
                     jnp.ones(3, jnp.int32), max_seqlen_q=2, num_kv_splits=3)
  jax.block_until_ready((o, o2))
  print("memcheck case finite:", bool(jnp.isfinite(o.astype(jnp.float32)).all()))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--skip-check", action="store_true")
  p.add_argument("--memcheck", action="store_true", help="run one small case and exit")
  args = p.parse_args()
  print(jax.devices(), jax.__version__)
  if args.memcheck:
    memcheck_case()
    return 0
  ok = True if args.skip_check else correctness()
  bench()
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
