"""mla_prefill on the GPU: correctness vs the reference, then TFLOP/s.

  PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 -m benchmarks.bench_mla_prefill [--sweep]

FLOPs = 2 * (visible q-k pairs) * H * (d_qk + d_v); causal pairs per sequence L(L+1)/2.
There is no FlashMLA or seed anchor for dense prefill (benchmarks/RESULTS.md,
"Anchors"): the anchor is torch's scaled_dot_product_attention on the same shapes
(whichever backend torch picks for d_qk 192 / d_v 128), when torch is importable.
``run()`` times the public ``mla_prefill`` on each kernel (Mosaic GPU on Hopper, and
Triton); ``--sweep`` times ``Config``s of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Row, device_name, print_table, rel_err, time_us
from jax_mla import _mosaic
from jax_mla.dense_prefill import mla_prefill, mosaic, triton

D_QK, D_V = 192, 128
# Calls take milliseconds, so dispatch does not matter and the inputs (GBs) overflow
# L2 by themselves: a few distinct query sets (sharing K and V) are enough.
NUM_SETS = 4


def _cu(lens):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


def _inputs(len_q, len_k, heads, seed=0, tail_q=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  tq, tk = sum(len_q) + tail_q, sum(len_k)
  q = jax.random.normal(kq, (tq, heads, D_QK), jnp.bfloat16)
  k = jax.random.normal(kk, (tk, heads, D_QK), jnp.bfloat16)
  v = jax.random.normal(kv, (tk, heads, D_V), jnp.bfloat16)
  return q, k, v, _cu(len_q), _cu(len_k)


def _implementations() -> list[str]:
  return (["mosaic"] if _mosaic.on_hopper() else []) + ["triton"]


def check() -> bool:
  """The kernels vs the XLA reference on ragged batches; prints a line each, returns
  all-OK."""
  rows = []
  for len_q, len_k, heads in [([700, 1, 0, 333, 1024], [900, 1, 5, 333, 1024], 8),
                              ([2048, 17], [2048, 4000], 16)]:
    q, k, v, cu_q, cu_k = _inputs(len_q, len_k, heads, tail_q=5)
    for causal in (True, False):
      kw = dict(max_seqlen_q=max(len_q), max_seqlen_k=max(len_k), sm_scale=D_QK**-0.5,
                causal=causal, return_lse=True)
      ref, ref_lse = mla_prefill(q, k, v, cu_q, cu_k, implementation="xla", **kw)
      for impl in _implementations():
        out, lse = mla_prefill(q, k, v, cu_q, cu_k, implementation=impl, **kw)
        rows.append((f"{impl}: lens_q={len_q} lens_k={len_k} H={heads} causal={causal}",
                     rel_err(out, ref), rel_err(lse, ref_lse)))
  print("correctness (rel err vs xla reference, bf16):")
  ok = True
  for name, e_out, e_lse in rows:
    good = e_out < 1e-2 and e_lse < 1e-3
    ok &= good
    print(f"  {name}: out {e_out:.2e} lse {e_lse:.2e} {'OK' if good else 'FAIL'}")
  return ok


def _flops(len_q, len_k, heads, causal):
  pairs = sum((lq * (lq + 1) // 2 if causal and lq == lk else lq * lk)
              for lq, lk in zip(len_q, len_k, strict=True))
  return 2 * pairs * heads * (D_QK + D_V)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  len_q: tuple[int, ...]
  len_k: tuple[int, ...]
  causal: bool
  heads: int = 128

  @property
  def equal_lengths(self) -> bool:
    """Every sequence has one length: torch SDPA (batched, not varlen) takes the case."""
    return len(set(self.len_q + self.len_k)) == 1


def _ragged(n, lo, hi, seed):
  return tuple(int(x) for x in np.random.default_rng(seed).integers(lo, hi, n))


CASES = [
    Case("8 x 4096 causal", (4096,) * 8, (4096,) * 8, True),
    Case("8 x 4096 q vs 4096 ctx, non-causal", (4096,) * 8, (4096,) * 8, False),
    # vLLM-like chunked prefill batches: odd lengths and token counts (no SDPA anchor).
    Case("64 ragged 100-1000, causal", _ragged(64, 100, 1000, 1), _ragged(64, 100, 1000, 1),
         True, heads=16),
    Case("256 ragged 20-300, causal", _ragged(256, 20, 300, 2), _ragged(256, 20, 300, 2),
         True),
]


def _case_sets(case: Case):
  q, k, v, cu_q, cu_k = _inputs(case.len_q, case.len_k, case.heads)
  qs = [q] + [jax.random.normal(jax.random.key(10 + i), q.shape, q.dtype)
              for i in range(1, NUM_SETS)]
  return [(x, k, v, cu_q, cu_k) for x in qs]


def run(cases=CASES, *, anchor: bool = True) -> list[Row]:
  """The public ``mla_prefill`` (default tiles) on each case and kernel, torch SDPA as the
  anchor."""
  dev = device_name()
  rows = []
  for case in cases:
    sets = _case_sets(case)
    flops = _flops(case.len_q, case.len_k, case.heads, case.causal)
    sdpa = _torch_anchor(case, flops) if anchor and case.equal_lengths else None
    for impl in _implementations():
      fn = lambda q, k, v, cu_q, cu_k, case=case, impl=impl: mla_prefill(
          q, k, v, cu_q, cu_k, max_seqlen_q=max(case.len_q), max_seqlen_k=max(case.len_k),
          sm_scale=D_QK**-0.5, causal=case.causal, implementation=impl)
      us = time_us(fn, sets, reps=10)
      rows.append(Row(f"mla_prefill {impl}", f"{case.name}, H {case.heads}", us,
                      flops / us / 1e6, "TFLOP/s", sdpa, "torch SDPA" if sdpa else "", dev))
    del sets
  return rows


def sweep(cases=CASES, budget_s: float = 150.0):
  """Triton and (on Hopper) Mosaic GPU ``Config``s of the public op (for tuning; prints a
  line each)."""
  t0 = time.time()
  configs = [triton.Config(*c) for c in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3),
                                         (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)]]
  if _mosaic.on_hopper():
    configs = [mosaic.Config(*c) for c in [(128, 2), (64, 2), (64, 3), (64, 4),
                                           (128, 2, 240, 24)]] + configs
  for case in cases:
    sets = _case_sets(case)
    flops = _flops(case.len_q, case.len_k, case.heads, case.causal)
    for cfg in configs:
      if time.time() - t0 > budget_s:
        print("  (time budget reached, sweep cut)")
        return
      fn = lambda q, k, v, cu_q, cu_k, cfg=cfg, case=case: mla_prefill(
          q, k, v, cu_q, cu_k, max_seqlen_q=max(case.len_q), max_seqlen_k=max(case.len_k),
          sm_scale=D_QK**-0.5, causal=case.causal, config=cfg,
          implementation="mosaic" if isinstance(cfg, mosaic.Config) else "triton")
      name = str(cfg)
      try:
        us = time_us(fn, sets, reps=10)
      except Exception as e:  # noqa: BLE001 - report and continue the sweep
        print(f"  {case.name} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        continue
      print(f"  {case.name} {name}: {us / 1e3:.2f} ms {flops / us / 1e6:.0f} TFLOP/s",
            flush=True)
    del sets


def _torch_anchor(case: Case, flops) -> float | None:
  """torch SDPA TFLOP/s on the same shapes (equal lengths only). A torch op on torch's stream,
  so triton's event timer brackets it correctly (unlike a JAX call)."""
  try:
    import torch
    import torch.nn.functional as F
    import triton.testing
    b, lq, lk = len(case.len_q), case.len_q[0], case.len_k[0]
    q = torch.randn(b, case.heads, lq, D_QK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, case.heads, lk, D_QK, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, case.heads, lk, D_V, device="cuda", dtype=torch.bfloat16)
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    sec = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
    return flops / sec / 1e12
  except Exception as e:  # noqa: BLE001 - the anchor is optional
    print(f"  torch anchor unavailable: {type(e).__name__}: {str(e)[:200]}")
    return None


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true", help="also time tile configurations")
  args = ap.parse_args()
  print(f"device: {device_name()}, jax {jax.__version__}")
  ok = check()
  if args.sweep:
    sweep()
  print_table(run())
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
