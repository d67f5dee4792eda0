"""Benchmark paged_attention (Pallas) on the BENCHMARKS.md rows; checks it first.

Rows: 128 seqs, Hq 64, Hkv 8, D 128, block 16, len 4096 (vLLM 5-D K cache and
[nb, Hkv, D, bs] V cache), bf16 / fp8 K+V / sinks + sliding window 1024, plus a
few-long-sequences row that shows the KV split. Bandwidth counts the K and V
bytes that must be read once (only the window for the windowed row): 2.15 GB for
the bf16 row (BENCHMARKS.md's 0.91 TB/s for the seed counts half of that).

  PYTHONPATH=$PWD python3 benchmarks/bench_paged_attention.py [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.paged import paged_attention
from jax_mla.paged.pallas import paged_attention_pallas
from jax_mla.paged.reference import key_view, value_view

SEED_US = {"bf16": 1176.0, "fp8": 1443.0, "sink_window": 1182.0}
COPY_TBS = 3.0


def make_inputs(num_seqs, seq_len, *, hq=64, hkv=8, d=128, bs=16, fp8=False, seed=0):
  key = jax.random.PRNGKey(seed)
  kq, kk, kv, kp, ks = jax.random.split(key, 5)
  blocks_per_seq = seq_len // bs
  nb = num_seqs * blocks_per_seq
  dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
  x = 16 // jnp.dtype(dtype).itemsize
  kc = jax.random.normal(kk, (nb, hkv, d // x, bs, x), jnp.bfloat16).astype(dtype)
  vc = jax.random.normal(kv, (nb, hkv, d, bs), jnp.bfloat16).astype(dtype)
  bt = jax.random.permutation(kp, nb).astype(jnp.int32).reshape(num_seqs, blocks_per_seq)
  q = jax.random.normal(kq, (num_seqs, hq, d), jnp.bfloat16)
  sl = jnp.full((num_seqs,), seq_len, jnp.int32)
  sinks = jax.random.normal(ks, (hq,), jnp.float32)
  return q, kc, vc, bt, sl, sinks


@functools.lru_cache(maxsize=None)
def kernel_fn(block_n, num_warps, num_stages, splits, window, with_sinks, k_scale):
  @jax.jit
  def f(q, kc, vc, bt, sl, sinks):
    return paged_attention_pallas(
        q, key_view(kc), value_view(vc, dim_major=True), bt, sl, scale=q.shape[-1] ** -0.5,
        k_scale=k_scale, v_scale=k_scale, sinks=sinks if with_sinks else None,
        alibi_slopes=None, sliding_window=window, query_start_loc=None, out_scale=None,
        num_kv_splits=splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
  return f


def time_us(fn, args, reps=30):
  """(loop, do_bench) microseconds: back-to-back async calls, and triton's median."""
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    out = fn(*args)
  jax.block_until_ready(out)
  loop = (time.perf_counter() - t0) / reps * 1e6
  try:
    import triton.testing
    db = 1e3 * triton.testing.do_bench(lambda: jax.block_until_ready(fn(*args)), warmup=25,
                                       rep=150, return_mode="median")
  except ImportError:
    db = float("nan")
  return loop, db


def reference(args, window, with_sinks, k_scale, n=4):
  """XLA reference output of the first n sequences."""
  q, kc, vc, bt, sl, sinks = args
  out = paged_attention(q[:n], kc, vc, bt[:n], sl[:n], scale=q.shape[-1] ** -0.5,
                        k_scale=k_scale, v_scale=k_scale, sinks=sinks if with_sinks else None,
                        sliding_window=window, implementation="xla")
  return np.asarray(out, np.float64)


def rel_err(out, ref):
  out = np.asarray(out[:ref.shape[0]], np.float64)
  if not np.isfinite(out).all():
    return float("inf")
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true")
  a = ap.parse_args()
  dev = jax.devices()[0]
  cores = getattr(dev, "core_count", "?")
  print(f"device: {dev.device_kind}, cores {cores}, jax {jax.__version__}", flush=True)

  configs = [(None, 4, None, None)]  # the library defaults
  if a.sweep:
    configs = [(64, 4, 2, 1), (64, 4, 3, 1), (64, 4, 4, 1), (64, 8, 3, 1), (128, 4, 2, 1),
               (128, 4, 3, 1), (128, 8, 3, 1), (32, 4, 3, 1), (32, 4, 4, 1), (64, 4, 3, 2),
               (128, 4, 3, 2), (32, 4, 4, 2)]
  rows = []
  workloads = [
      ("bf16", dict(fp8=False), 0, False, 1.0),
      ("fp8", dict(fp8=True), 0, False, 0.5),
      ("sink_window", dict(fp8=False), 1024, True, 1.0),
  ]
  for name, mk, window, with_sinks, k_scale in workloads:
    args = make_inputs(128, 4096, **mk)
    ref = reference(args, window, with_sinks, k_scale)
    kv_bytes = 2 * 128 * 8 * 128 * min(4096, window or 4096) * args[1].dtype.itemsize
    for cfg in configs:
      try:
        fn = kernel_fn(*cfg, window, with_sinks, k_scale)
        err = rel_err(fn(*args), ref)
        loop, db = time_us(fn, args)
      except Exception as e:  # keep sweeping past a config that fails to compile
        print(f"{name} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      rows.append((name, cfg, err, loop, db, kv_bytes / (min(loop, db) * 1e-6) / 1e12))
      print(rows[-1], flush=True)
    del args

  # Few long sequences: 4 x 65536 tokens, 32 (seq, kv head) pairs; the split fills the GPU.
  args = make_inputs(4, 65536)
  ref = reference(args, 0, False, 1.0, n=1)
  kv_bytes = 2 * 4 * 8 * 128 * 65536 * 2
  for splits in (1, None):
    fn = jax.jit(functools.partial(paged_attention, scale=128 ** -0.5, num_kv_splits=splits))
    err = rel_err(fn(*args[:5]), ref)
    loop, db = time_us(fn, args[:5])
    rows.append(("long4x64k", ("splits", splits), err, loop, db,
                 kv_bytes / (min(loop, db) * 1e-6) / 1e12))
    print(rows[-1], flush=True)

  print("\nworkload     config(block_n,warps,stages,splits)   rel_err  loop_us  do_bench_us  "
        "TB/s  vs_seed  %copy")
  for name, cfg, err, loop, db, tbs in rows:
    best = min(loop, db)
    seed = SEED_US.get(name)
    ratio = f"{seed / best:5.2f}x" if seed else "   - "
    print(f"{name:12s} {str(cfg):36s} {err:8.1e} {loop:8.1f} {db:10.1f} {tbs:6.2f} {ratio} "
          f"{100 * tbs / COPY_TBS:5.1f}")


if __name__ == "__main__":
  main()
