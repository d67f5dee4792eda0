"""Dense MLA decode on the GPU: correctness vs the reference, then the FlashMLA anchor rows.

  PYTHONPATH=$PWD python3 -m benchmarks.bench_mla_decode [--skip-check] [--sweep] [--memcheck]

``run()`` (used by ``benchmarks.run``) times the public ``mla_decode_paged`` on the
three FlashMLA dense-decode rows, with the Triton kernel and (on Hopper, for the
rows it takes) the Mosaic GPU kernel with ``harness.time_us`` (one cache, distinct
queries and block tables per input set), after checking the timed call against
the XLA reference. ``--sweep`` times Triton ``Config``s of the public op. The
anchors (``CASES``) are the 2026-11-22 FlashMLA figures (benchmarks/RESULTS.md,
"Anchors"). FLOPs follow FlashMLA: ``2 * b * s_q * h_q * seqlen * (576 + 512)``; bandwidth
counts the KV bytes read once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import flashmla_peer
from benchmarks.harness import Row, check_close, device_name, n_sets, print_table, rel_err, time_us
from jax_mla import _mosaic
from jax_mla._common import num_sms
from jax_mla.dense_decode import mla_decode, mla_decode_paged, mosaic, triton

D = 576


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
      o, l = mla_decode_paged(q, cache, bt, seqs, causal=causal, implementation="triton")
      ro, rl = mla_decode_paged(q, cache, bt, seqs, causal=causal, implementation="xla")
      lerr = float(np.nanmax(np.abs(np.asarray(l) - np.asarray(rl))))
      rows.append((name, rel_err(o, ro), lerr))
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
                        implementation="triton", **kw)
      ro, rl = mla_decode(q, cache, qo, kv_indptr, kv_indices, last, implementation="xla", **kw)
      rows.append((name, rel_err(o, ro), float(np.max(np.abs(np.asarray(l) - np.asarray(rl))))))
    except Exception as e:  # noqa: BLE001 - report every case
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
      rows.append((name, float("inf"), float("inf")))
  print("\n== correctness (triton vs xla reference) ==")
  ok = True
  for name, e, le in rows:
    good = e < 1e-2 and le < 1e-3
    ok &= good
    print(f"{name:55s} rel_err {e:.2e}  lse max abs err {le:.2e}  {'OK' if good else 'FAIL'}")
  return ok


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  b: int
  s_q: int
  h_q: int
  seqlen: int
  block_size: int
  anchor: float | None  # FlashMLA, in `unit` (None: not an anchor row)
  unit: str  # "TFLOP/s" for the compute-bound rows, "TB/s" for the memory-bound one


CASES = [  # FlashMLA dense decode bf16 (RESULTS.md, "Anchors", 2026-11-22 edition)
    Case("b128 s_q1 h128 len4096 bs64", 128, 1, 128, 4096, 64, 554.0, "TFLOP/s"),
    Case("b64 s_q2 h128 len8192 bs64", 64, 2, 128, 8192, 64, 628.0, "TFLOP/s"),
    Case("b132 s_q1 h16 len8192 bs64", 132, 1, 16, 8192, 64, 2.75, "TB/s"),
    # Tensor-parallel head counts (issue #17): one transposed tile (32) and one padded
    # 64-row tile (48) a request.
    Case("b132 s_q1 h32 len8192 bs64", 132, 1, 32, 8192, 64, None, "TB/s"),
    Case("b132 s_q1 h48 len8192 bs64", 132, 1, 48, 8192, 64, None, "TB/s"),
]


def _case_sets(case: Case):
  """One cache (far larger than L2) and distinct (q, block table) pairs reading it."""
  q, cache, bt, seqs = _paged_inputs(jax.random.PRNGKey(1), case.b, case.s_q, case.h_q,
                                     case.seqlen, case.block_size)
  sets = [(q, cache, bt, seqs)]
  for i in range(1, n_sets(q.nbytes + bt.nbytes)):
    kq, kp = jax.random.split(jax.random.PRNGKey(100 + i))
    sets.append((jax.random.normal(kq, q.shape, jnp.float32).astype(q.dtype) / 10, cache,
                 jax.random.permutation(kp, bt.size).reshape(bt.shape).astype(jnp.int32), seqs))
  flops = 2 * case.b * case.s_q * case.h_q * case.seqlen * (576 + 512)
  kv_bytes = case.b * case.seqlen * D * 2
  return sets, flops, kv_bytes


def side_by_side(fm, case: Case, sets, figure) -> list[Row]:
  """The public op (its default kernel) and FlashMLA on the same input sets with the
  same timer (benchmarks/flashmla_peer.py), after comparing their outputs, and the same
  FlashMLA calls on our torch bridge."""
  ours = jax.jit(mla_decode_paged)

  def calls(lib):  # one schedule for every set: same shapes and lengths
    meta = lib.get_mla_metadata()[0]
    return [flashmla_peer.dense_decode(lib, meta, *s) for s in sets]

  theirs, bridged = calls(fm), calls(flashmla_peer.bridge())
  t = flashmla_peer.compare_and_time(case.name, ours, theirs, sets, lse_at=1, bridged=bridged)
  return flashmla_peer.rows("mla_decode_paged vs FlashMLA", case.name, t, figure, case.unit)


def run(cases=CASES, *, only_side_by_side: bool = False) -> Iterator[Row]:
  """The FlashMLA dense-decode anchor rows through the public ``mla_decode_paged``, once
  per GPU kernel that takes the row (Triton; Mosaic GPU on Hopper). Where FlashMLA
  imports (benchmarks/flashmla_peer.py), each row is also timed side by side with it
  (``only_side_by_side``: only that). Rows are yielded as they are measured, so
  a run cut at its budget keeps them."""
  dev = device_name()
  fm = flashmla_peer.load()
  if only_side_by_side and fm is None:
    raise RuntimeError("side by side needs FlashMLA: put its built package on PYTHONPATH")
  for case in cases:
    sets, flops, kv_bytes = _case_sets(case)

    def figure(us, case=case, flops=flops, kv_bytes=kv_bytes):
      return flops / us / 1e6 if case.unit == "TFLOP/s" else kv_bytes / us / 1e6
    if fm is not None:
      yield from side_by_side(fm, case, sets, figure)
    if only_side_by_side:
      continue
    ref = mla_decode_paged(*sets[0], implementation="xla")
    impls = ["triton"]
    if _mosaic.default_for(mosaic.check_supported, sets[0][0], sets[0][1], causal=False):
      impls.append("mosaic")
    for impl in impls:
      fn = jax.jit(functools.partial(mla_decode_paged, implementation=impl))
      check_close(f"mla_decode_paged[{impl}] {case.name}", fn(*sets[0])[0], ref[0])
      us = time_us(fn, sets)
      yield Row(f"mla_decode_paged[{impl}]", case.name, us, figure(us), case.unit,
                case.anchor, "FlashMLA", dev)
    del sets, ref


def sweep(cases=CASES):
  """Triton ``Config``s of the public op on each row (for tuning; prints a line each)."""
  print(f"\n== tile sweep ({device_name()}, SMs {num_sms()}) ==")
  for case in cases:
    sets, flops, kv_bytes = _case_sets(case)
    rows_per_group = case.s_q * case.h_q
    auto = triton.with_defaults(None, num_kv_splits=None, rows_per_group=rows_per_group,
                                num_groups=case.b,
                                avg_kv_len=sets[0][2].shape[1] * case.block_size)
    s = auto.num_splits
    configs = [auto]
    if auto.block_m >= 64:
      configs += [triton.Config(64, 64, 8, 1, s), triton.Config(64, 32, 8, 3, s),
                  triton.Config(32, 64, 4, 2, s), triton.Config(64, 32, 8, 2, 2 * s)]
    else:
      configs += [triton.Config(16, 64, 4, 2, s), triton.Config(16, 64, 4, 3, s),
                  triton.Config(16, 64, 4, 2, 2 * s), triton.Config(16, 32, 4, 3, 4 * s),
                  triton.Config(16, 128, 4, 1, s)]
    for cfg in configs:
      fn = jax.jit(functools.partial(mla_decode_paged, config=cfg, implementation="triton"))
      name = (f"bm{cfg.block_m:3d} bn{cfg.block_n:3d} w{cfg.num_warps} st{cfg.num_stages} "
              f"S{cfg.num_splits:2d}")
      try:
        us = time_us(fn, sets)
      except Exception as e:  # noqa: BLE001 - report and go on with the sweep
        print(f"{case.name} {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
        continue
      print(f"{case.name:30s} {name}: {us:8.1f} us "
            f"{flops / us / 1e6:6.1f} TFLOP/s {kv_bytes / us / 1e6:5.2f} TB/s", flush=True)
    del sets


def memcheck_case():
  """One small call of each path (NaN tails, invalid ids, splits) for compute-sanitizer."""
  q, cache, bt, seqs = _paged_inputs(jax.random.PRNGKey(3), 3, 2, 16, 200, 64, varlen=True,
                                     nan_tail=True)
  bt = bt.at[:, -1].set(2147480000)
  o, _ = mla_decode_paged(q, cache, bt, seqs, causal=True)  # 32 rows: transposed (Hopper)
  q48 = jnp.concatenate([q, q[:, :, :8]], axis=2)  # 2 x 24 rows: a padded 64-row tile
  o48, _ = mla_decode_paged(q48, cache, bt, seqs, causal=True)
  q1 = q.reshape(6, 16, D)
  o2, _ = mla_decode(q1, cache.reshape(-1, 1, D), jnp.array([0, 2, 4, 6], jnp.int32),
                     jnp.array([0, 50, 60, 200], jnp.int32), jnp.arange(200, dtype=jnp.int32),
                     jnp.ones(3, jnp.int32), max_seqlen_q=2, num_kv_splits=3)
  jax.block_until_ready((o, o48, o2))
  print("memcheck case finite:", all(bool(jnp.isfinite(x.astype(jnp.float32)).all())
                                     for x in (o, o48)))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--skip-check", action="store_true")
  p.add_argument("--memcheck", action="store_true", help="run one small case and exit")
  p.add_argument("--sweep", action="store_true", help="also time tile configurations")
  p.add_argument("--side-by-side", action="store_true",
                 help="only the rows timed beside FlashMLA (benchmarks/flashmla_peer.py)")
  args = p.parse_args()
  print(jax.devices(), jax.__version__)
  if args.memcheck:
    memcheck_case()
    return 0
  ok = True if args.skip_check or args.side_by_side else correctness()
  if args.sweep:
    sweep()
  print_table(list(run(only_side_by_side=args.side_by_side)))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
