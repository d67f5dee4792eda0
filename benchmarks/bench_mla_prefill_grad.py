"""mla_prefill backward on the GPU: gradients checked, then TFLOP/s beside torch SDPA's.

  PYTHONPATH=$PWD python3 -m benchmarks.bench_mla_prefill_grad [--configs ...]

``run()`` checks ``jax.grad`` of the public ``mla_prefill`` after each kernel forward
(Mosaic GPU on Hopper: its dq kernel and the Triton dk/dv kernel; Triton: both Triton
kernels) against the XLA backward on a ragged batch, then times the backward alone (the
``jax.vjp`` function of the forward, applied to a cotangent) on ``bench_mla_prefill``'s
cases. FLOPs = 2.5x the forward's (issue #19's count: recomputed ``Q K^T``, ``dO V^T``,
``dQ``, ``dK``, ``dV``). The anchor is torch SDPA's backward on the same equal-length
shapes, timed by triton's event timer in the same process (``torch.autograd.grad`` of a
saved forward), when torch is importable. ``--configs`` times
``triton_backward.Config`` values in its field order (``dkv_block_k:dkv_block_q:
dq_block_q:dq_block_k:num_warps:num_stages``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks.bench_mla_prefill import (
    CASES,
    D_QK,
    D_V,
    Case,
    _case_sets,
    _flops,
    _implementations,
    _inputs,
)
from benchmarks.harness import Row, check_close, device_name, print_table, time_us
from jax_mla.dense_prefill import mla_prefill, mla_prefill_token_major, triton_backward

BACKWARD = 2.5  # backward FLOPs per forward FLOP
# Ragged, with an empty sequence, len_q < len_k and a tail past cu_seqlens_q[-1].
CHECK = Case("check", (700, 1, 0, 333, 1024), (900, 1, 5, 333, 1024), True, heads=8)


def _vjp(case: Case, impl, q, k, v, cu_q, cu_k):
  fwd = lambda q, k, v: mla_prefill(  # noqa: E731
      q, k, v, cu_q, cu_k, max_seqlen_q=max(case.len_q), max_seqlen_k=max(case.len_k),
      sm_scale=D_QK ** -0.5, causal=case.causal, implementation=impl)
  return jax.vjp(fwd, q, k, v)


def check(base: Case = CHECK) -> float:
  """Largest rel. error of ``(dq, dk, dv)`` against the XLA backward, causal or not."""
  worst = 0.0
  for causal in (True, False):
    case = dataclasses.replace(base, causal=causal)
    q, k, v, cu_q, cu_k = _inputs(case.len_q, case.len_k, case.heads, tail_q=5)
    g = jax.random.normal(jax.random.key(3), (q.shape[0], case.heads, D_V), jnp.bfloat16)
    grads = lambda impl, g, *a, c=case: _vjp(c, impl, *a)[1](g)  # noqa: E731
    want = jax.jit(functools.partial(grads, "xla"))(g, q, k, v, cu_q, cu_k)
    for impl in _implementations():
      got = jax.jit(functools.partial(grads, impl))(g, q, k, v, cu_q, cu_k)
      worst = max(worst, *(check_close(f"{impl} {name} causal={causal}", a, b)
                           for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True)))
  return worst


def _grad_sets(case: Case, impl: str):
  g = jax.random.normal(jax.random.key(7), (sum(case.len_q), case.heads, D_V), jnp.bfloat16)
  vjp = jax.jit(functools.partial(_vjp, case, impl))
  # Two sets: the residuals of four (and the backward's temporaries) exceed an H100's 80 GB.
  return [(vjp(*s)[1], g) for s in _case_sets(case)[:2]]


def run(cases=CASES, *, check_case: Case = CHECK, anchor: bool = True) -> list[Row]:
  err = check(check_case)
  rows = []
  for case in cases:
    flops = BACKWARD * _flops(case.len_q, case.len_k, case.heads, case.causal)
    sdpa = _torch_backward_tflops(case, flops) if anchor and case.equal_lengths else None
    for impl in _implementations():  # the backward after this forward
      us = time_us(lambda f, g: f(g), _grad_sets(case, impl), reps=10)
      rows.append(Row(f"mla_prefill backward ({impl} fwd)", f"{case.name}, H {case.heads} "
                      f"(grad rel err {err:.1e})", us, flops / us / 1e6, "TFLOP/s", sdpa,
                      "torch SDPA backward" if sdpa else "", device_name()))
  return rows


def sweep(cases, configs) -> list[Row]:
  """The backward kernels alone, per ``triton_backward.Config``."""
  out = []
  for case in cases:
    flops = BACKWARD * _flops(case.len_q, case.len_k, case.heads, case.causal)
    kw = dict(max_seqlen_q=max(case.len_q), max_seqlen_k=max(case.len_k),
              sm_scale=D_QK ** -0.5, causal=case.causal)
    sets = []
    for q, k, v, cu_q, cu_k in _case_sets(case):
      out_, lse = mla_prefill_token_major(q, k, v, cu_q, cu_k, **kw)
      sets.append((q, k, v, cu_q, cu_k, out_, lse, out_, jnp.zeros_like(lse)))
    for config in configs:
      bwd = functools.partial(triton_backward.mla_prefill_bwd, config=config, **kw)
      try:
        us = time_us(bwd, sets, reps=10)
      except Exception as e:  # noqa: BLE001  (a config that does not compile)
        print(f"{case.name} {config}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        continue
      out.append(Row("mla_prefill backward kernels", f"{case.name} {config}", us,
                     flops / us / 1e6, "TFLOP/s", device=device_name()))
  return out


def _torch_backward_tflops(case: Case, flops) -> float | None:
  """torch SDPA's backward (whichever backend torch picks for d_qk 192 / d_v 128) on the
  same equal-length shapes, by triton's event timer on torch's stream."""
  try:
    import torch
    import torch.nn.functional as F
    import triton.testing
    b, lq, lk = len(case.len_q), case.len_q[0], case.len_k[0]
    mk = lambda n, d: torch.randn(b, case.heads, n, d, device="cuda",  # noqa: E731
                                  dtype=torch.bfloat16, requires_grad=True)
    q, k, v = mk(lq, D_QK), mk(lk, D_QK), mk(lk, D_V)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    g = torch.randn_like(out)
    fn = lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)  # noqa: E731
    sec = triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median") * 1e-3
    return flops / sec / 1e12
  except Exception as e:  # noqa: BLE001 - the anchor is optional
    print(f"  torch anchor unavailable: {type(e).__name__}: {str(e)[:200]}")
    return None


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--configs", help="dkv_bk:dkv_bq:dq_bq:dq_bk:w:s,... (triton_backward.Config)")
  args = ap.parse_args()
  print(f"device: {device_name()}, jax {jax.__version__}")
  if args.configs:
    configs = [triton_backward.Config(*map(int, c.split(":"))) for c in args.configs.split(",")]
    print_table(sweep(CASES, configs))
  else:
    print_table(run())


if __name__ == "__main__":
  sys.exit(main())
