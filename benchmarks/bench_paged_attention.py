"""Benchmark paged_attention on the seed anchor rows; checks it first.

The op runs with the library's defaults (the Mosaic GPU kernel on Hopper, Triton on
other GPUs) or the backend ``--implementation`` names.

Rows: 128 seqs, Hq 64, Hkv 8, D 128, block 16, len 4096 (vLLM 5-D K cache and
[nb, Hkv, D, bs] V cache), bf16 / fp8 K+V / sinks + sliding window 1024, plus a
few-long-sequences row that shows the KV split. Bandwidth counts the K and V
bytes that must be read once (only the window for the windowed row): 2.15 GB for
the bf16 row (the 2026-11-22 edition of the anchors gave the seed 0.91 TB/s, counting
half of that), against device-to-device copy (3.0 TB/s on the H100). The seed times
(``seed_us``) are the 2026-11-22 anchors (benchmarks/RESULTS.md, "Anchors").

  PYTHONPATH=$PWD python3 -m benchmarks.bench_paged_attention [--sweep] [--side-by-side]
      [--implementation mosaic|triton]

Where torch's Triton runs on the GPU, every row is also timed side by side with the
seed kernel itself (:mod:`benchmarks.seed_paged_peer`: same process, same arrays, same
timer, outputs compared first).

``run()`` times the public ``paged_attention`` (library defaults) with
``harness.time_us``: one cache, distinct queries and block tables per input set.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from benchmarks import seed_paged_peer
from benchmarks.harness import Row, check_close, device_name, n_sets, print_table, time_us
from jax_mla.paged import paged_attention
from jax_mla.paged.triton import Config

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


def input_sets(args):
  """``args`` plus distinct (query, block table) pairs over the same caches."""
  q, kc, vc, bt, sl, sinks = args
  sets = [args]
  for i in range(1, n_sets(q.nbytes + bt.nbytes)):
    kq, kp = jax.random.split(jax.random.PRNGKey(100 + i))
    sets.append((jax.random.normal(kq, q.shape, q.dtype), kc, vc,
                 jax.random.permutation(kp, bt.size).astype(jnp.int32).reshape(bt.shape), sl,
                 sinks))
  return sets


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  num_seqs: int
  seq_len: int
  fp8: bool = False
  window: int = 0
  sinks: bool = False
  seed_us: float | None = None  # the seed Triton kernel (RESULTS.md, "Anchors")

  @property
  def k_scale(self) -> float:
    return 0.5 if self.fp8 else 1.0

  def kv_bytes(self, itemsize: int) -> int:
    return 2 * self.num_seqs * 8 * 128 * min(self.seq_len, self.window or self.seq_len) * itemsize


WORKLOADS = [
    Workload("bf16", 128, 4096, seed_us=1176.0),
    Workload("fp8", 128, 4096, fp8=True, seed_us=1443.0),
    Workload("sink_window", 128, 4096, window=1024, sinks=True, seed_us=1182.0),
    Workload("long4x64k", 4, 65536),  # few long sequences: the KV split fills the GPU
]


def public_fn(w: Workload, config: Config | None = None, implementation: str | None = None):
  def f(q, kc, vc, bt, sl, sinks):
    return paged_attention(q, kc, vc, bt, sl, scale=q.shape[-1] ** -0.5, k_scale=w.k_scale,
                           v_scale=w.k_scale, sinks=sinks if w.sinks else None,
                           sliding_window=w.window, config=config,
                           implementation=implementation)
  return f


def reference(w: Workload, args, n=4):
  """XLA reference output of the first n sequences (the whole call would not fit)."""
  q, kc, vc, bt, sl, sinks = args
  return paged_attention(q[:n], kc, vc, bt[:n], sl[:n], scale=q.shape[-1] ** -0.5,
                         k_scale=w.k_scale, v_scale=w.k_scale, sinks=sinks if w.sinks else None,
                         sliding_window=w.window, implementation="xla")


def run(workloads=WORKLOADS, *, only_side_by_side: bool = False,
        implementation: str | None = None) -> Iterator[Row]:
  """Each workload through the public op, checked on its first sequences, then timed:
  one row against the seed Triton time, one against copy bandwidth. Where torch's Triton
  runs the seed kernel (:mod:`benchmarks.seed_paged_peer`), each row is also timed side
  by side with it (``only_side_by_side``: only that). Rows are yielded as they are
  measured, so a run cut at its budget keeps them."""
  dev = device_name()
  seed = seed_paged_peer.load()
  if only_side_by_side and seed is None:
    raise RuntimeError("side by side needs a CUDA torch with Triton")
  for w in workloads:
    args = make_inputs(w.num_seqs, w.seq_len, fp8=w.fp8)
    fn = public_fn(w, implementation=implementation)
    ref = reference(w, args)
    check_close(f"paged_attention {w.name}", jax.jit(fn)(*args)[:ref.shape[0]], ref)
    config = f"{w.name}: {w.num_seqs} seqs x {w.seq_len}"
    kv_bytes = w.kv_bytes(args[1].dtype.itemsize)
    sets = input_sets(args)
    if seed is not None:
      t = seed_paged_peer.compare_and_time(
          config, jax.jit(fn), sets, seed, use_sinks=w.sinks, scale=args[0].shape[-1] ** -0.5,
          k_scale=w.k_scale, v_scale=w.k_scale, sliding_window=w.window)
      for label, us, seed_us in t.measures():
        yield Row(f"paged_attention vs seed{label}", config, us, us, "us", seed_us,
                  seed_paged_peer.NAME, dev)
        yield Row(f"paged_attention vs seed{label}", f"{config} (K+V bandwidth)", us,
                  kv_bytes / us / 1e6, "TB/s", kv_bytes / seed_us / 1e6,
                  seed_paged_peer.NAME, dev)
    if only_side_by_side:
      continue
    us = time_us(fn, sets)
    if w.seed_us is not None:
      yield Row("paged_attention", config, us, us, "us", w.seed_us, "seed Triton", dev)
    yield Row("paged_attention", f"{config} (K+V bandwidth)", us, kv_bytes / us / 1e6,
              "TB/s", COPY_TBS, "D2D copy", dev)
    del args, sets


def sweep(workloads=WORKLOADS[:3]):
  """Triton ``Config``s (block_n, warps, stages, splits) of each workload (for tuning)."""
  configs = [Config(*c) for c in [
      (64, 4, 2, 1), (64, 4, 3, 1), (64, 4, 4, 1), (64, 8, 3, 1), (128, 4, 2, 1), (128, 4, 3, 1),
      (128, 8, 3, 1), (32, 4, 3, 1), (32, 4, 4, 1), (64, 4, 3, 2), (128, 4, 3, 2), (32, 4, 4, 2)]]
  for w in workloads:
    args = make_inputs(w.num_seqs, w.seq_len, fp8=w.fp8)
    sets = input_sets(args)
    ref = reference(w, args)
    kv_bytes = w.kv_bytes(args[1].dtype.itemsize)
    for cfg in configs:
      try:
        fn = public_fn(w, cfg, implementation="triton")
        err = check_close(f"{w.name} {cfg}", jax.jit(fn)(*args)[:ref.shape[0]], ref)
        us = time_us(fn, sets)
      except Exception as e:  # keep sweeping past a config that fails (or is wrong)
        print(f"{w.name} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      name = f"bn{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages} S{cfg.num_splits}"
      print(f"{w.name:12s} {name:20s} rel_err {err:.1e} {us:8.1f} us "
            f"{kv_bytes / us / 1e6:5.2f} TB/s", flush=True)
    del args, sets


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--side-by-side", action="store_true",
                  help="only the rows timed beside the seed kernel (benchmarks/seed_paged_peer.py)")
  ap.add_argument("--rows", default="", help="comma-separated workload names (default: all)")
  ap.add_argument("--implementation", choices=("mosaic", "triton"), default=None,
                  help="the backend to time (default: the library's choice)")
  a = ap.parse_args()
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}, cores {getattr(dev, 'core_count', '?')}, "
        f"jax {jax.__version__}", flush=True)
  if a.sweep:
    sweep()
  names = [n for n in a.rows.split(",") if n]
  print_table(list(run([w for w in WORKLOADS if not names or w.name in names],
                       only_side_by_side=a.side_by_side, implementation=a.implementation)))


if __name__ == "__main__":
  main()
