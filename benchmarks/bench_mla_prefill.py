"""mla_prefill on the GPU: correctness vs the reference, then TFLOP/s over a tile sweep.

Run on the device machine:
``PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 benchmarks/bench_mla_prefill.py``.
FLOPs = 2 * (visible q-k pairs) * H * (d_qk + d_v); causal pairs per sequence L(L+1)/2.
The anchor is torch's scaled_dot_product_attention on the same shapes (whichever
backend torch picks for d_qk 192 / d_v 128), when torch is importable.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.dense_prefill import mla_prefill
from jax_mla.dense_prefill.kernel import mla_prefill_pallas

D_QK, D_V = 192, 128
T0 = time.time()


def _cu(lens):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


def _inputs(len_q, len_k, heads, seed=0, tail_q=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  tq, tk = sum(len_q) + tail_q, sum(len_k)
  q = jax.random.normal(kq, (tq, heads, D_QK), jnp.bfloat16)
  k = jax.random.normal(kk, (tk, heads, D_QK), jnp.bfloat16)
  v = jax.random.normal(kv, (tk, heads, D_V), jnp.bfloat16)
  return q, k, v, _cu(len_q), _cu(len_k)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  fin = np.isfinite(b)
  if np.isnan(a).any() or not np.array_equal(np.isposinf(a), np.isposinf(b)):
    return float("inf")
  return float(np.linalg.norm((a - b)[fin]) / max(np.linalg.norm(b[fin]), 1e-30))


def check():
  rows = []
  for len_q, len_k, heads in [([700, 1, 0, 333, 1024], [900, 1, 5, 333, 1024], 8),
                              ([2048, 17], [2048, 4000], 16)]:
    q, k, v, cu_q, cu_k = _inputs(len_q, len_k, heads, tail_q=5)
    for causal in (True, False):
      kw = dict(max_seqlen_q=max(len_q), max_seqlen_k=max(len_k), sm_scale=D_QK**-0.5,
                causal=causal, return_lse=True)
      out, lse = mla_prefill(q, k, v, cu_q, cu_k, implementation="pallas", **kw)
      ref, ref_lse = mla_prefill(q, k, v, cu_q, cu_k, implementation="xla", **kw)
      rows.append((f"lens_q={len_q} lens_k={len_k} H={heads} causal={causal}",
                   _rel(out.astype(jnp.float32), ref.astype(jnp.float32)), _rel(lse, ref_lse)))
  print("correctness (rel err vs xla reference, bf16):")
  for name, e_out, e_lse in rows:
    ok = "OK" if e_out < 1e-2 and e_lse < 1e-3 else "FAIL"
    print(f"  {name}: out {e_out:.2e} lse {e_lse:.2e} {ok}")


def _time(fn, reps=20):
  jax.block_until_ready(fn())
  try:
    import triton.testing
    return triton.testing.do_bench(lambda: jax.block_until_ready(fn()), warmup=50, rep=300,
                                   return_mode="median") * 1e-3
  except ImportError:
    t = time.perf_counter()
    for _ in range(reps):
      jax.block_until_ready(fn())
    return (time.perf_counter() - t) / reps


def _flops(len_q, len_k, heads, causal):
  pairs = sum((lq * (lq + 1) // 2 if causal and lq == lk else lq * lk)
              for lq, lk in zip(len_q, len_k, strict=True))
  return 2 * pairs * heads * (D_QK + D_V)


def _sweep(name, len_q, len_k, causal, heads, configs):
  q, k, v, cu_q, cu_k = _inputs(len_q, len_k, heads)
  flops = _flops(len_q, len_k, heads, causal)
  best = None
  for bq, bk, warps, stages in configs:
    if time.time() - T0 > 150:
      print("  (time budget reached, sweep cut)")
      break
    f = jax.jit(lambda q, k, v, bq=bq, bk=bk, warps=warps, stages=stages: mla_prefill_pallas(
        q, k, v, cu_q, cu_k, max_seqlen_q=max(len_q), sm_scale=D_QK**-0.5, causal=causal,
        block_q=bq, block_k=bk, num_warps=warps, num_stages=stages))
    try:
      sec = _time(lambda f=f: f(q, k, v))
    except Exception as e:  # noqa: BLE001 - report and continue the sweep
      print(f"  {name} bq={bq} bk={bk} w={warps} s={stages}: FAILED {type(e).__name__}: "
            f"{str(e)[:300]}")
      continue
    tf = flops / sec / 1e12
    print(f"  {name} bq={bq} bk={bk} w={warps} s={stages}: {sec * 1e3:.2f} ms {tf:.0f} TFLOP/s")
    if best is None or tf > best[1]:
      best = ((bq, bk, warps, stages), tf, sec)
  return best, flops


def bench():
  heads = 128
  configs = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3),
             (128, 128, 8, 2), (64, 32, 4, 2)]
  results = []
  for name, len_q, len_k, causal in [("8 x 4096 causal", [4096] * 8, [4096] * 8, True),
                                     ("8 x 4096 q vs 4096 ctx, non-causal", [4096] * 8,
                                      [4096] * 8, False)]:
    best, flops = _sweep(name, len_q, len_k, causal, heads, configs)
    results.append((name, best, _torch_anchor(len_q, len_k, heads, causal, flops)))
  return results


def _torch_anchor(len_q, len_k, heads, causal, flops):
  try:
    import torch
    import torch.nn.functional as F
    b, lq, lk = len(len_q), len_q[0], len_k[0]
    q = torch.randn(b, heads, lq, D_QK, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, heads, lk, D_QK, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, heads, lk, D_V, device="cuda", dtype=torch.bfloat16)
    import triton.testing
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    sec = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
    return flops / sec / 1e12, sec
  except Exception as e:  # noqa: BLE001 - the anchor is optional
    print(f"  torch anchor unavailable: {type(e).__name__}: {str(e)[:200]}")
    return None


def main():
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  check()
  results = bench()
  print("\nconfig | best tile (bq, bk, warps, stages) | ms | ours TFLOP/s | torch SDPA TFLOP/s"
        " | ratio")
  for name, best, anchor in results:
    if best is None:
      print(f"{name} | failed | - | - | - | -")
      continue
    a = f"{anchor[0]:.0f}" if anchor else "-"
    r = f"{best[1] / anchor[0]:.2f}" if anchor else "-"
    print(f"{name} | {best[0]} | {best[2] * 1e3:.2f} | {best[1]:.0f} | {a} | {r}")


if __name__ == "__main__":
  main()
