"""Sparse MLA prefill backward on the GPU: gradients checked, then TFLOP/s.

  PYTHONPATH=$PWD python3 -m benchmarks.bench_sparse_mla_grad [--rows ROWS]
      [--kernels] [--configs dq_bh:dq_bk:dkv_bh:dkv_bk:w:s,...]

``run()`` checks ``jax.grad`` of the public ``sparse_mla_prefill`` (default
implementation: the Mosaic GPU forward on Hopper, then the Mosaic GPU backward kernel)
against the XLA backward on the row's first ``CHECK_TOKENS`` tokens, then times the
backward alone (the ``jax.vjp`` function of the forward, applied to a cotangent) with
``harness.time_us``. FLOPs = 2.5x the forward's ``2 * s_q * h_q * topk * (d_qk + d_v)``
(issue #19's count: recomputed ``Q K^T``, ``dO V^T``, ``dQ``, ``dK``, ``dV``). Where cuDNN
frontend's DSA backward imports (``benchmarks/cudnn_peer.py``), each row is instead
timed side by side with it (``harness.time_calls_us``, both backwards from our forward's
``out`` and ``lse``, gradients compared first) and cuDNN is the anchor; else the anchor
is issue #19's fallback bar of 250 TFLOP/s. ``--kernels`` times the backward kernels
alone, the Mosaic GPU kernel beside the Triton pair. ``--configs`` times the Triton backward kernels
with those ``triton_backward.Config`` values, in its field order (``dq_block_h:
dq_block_k:dkv_block_h:dkv_block_k:num_warps:num_stages``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks import cudnn_peer
from benchmarks.harness import (
  Row,
  check_close,
  device_name,
  print_table,
  sync_jax,
  sync_torch,
  time_calls_us,
  time_us,
)
from jax_mla.sparse_mla import backward, mosaic_backward, sparse_mla_prefill, triton_backward

D_V = 512
NUM_SETS = 3  # calls take milliseconds and their inputs overflow L2
CHECK_TOKENS = 256
BAR_TFLOPS = 250.0


@dataclasses.dataclass(frozen=True)
class Shape:
  s_q: int
  h_q: int
  topk: int
  d_qk: int
  s_kv: int


ROWS = {
    "V3.2 s_q4096 h128 topk2048 d576": Shape(4096, 128, 2048, 576, 32768),
    "V4 s_q4096 h64 topk512 d512": Shape(4096, 64, 512, 512, 32768),
    "TP8 s_q4096 h16 topk2048 d576": Shape(4096, 16, 2048, 576, 32768),
}


def _flop(r: Shape) -> float:
  return 2.5 * 2 * r.s_q * r.h_q * r.topk * (r.d_qk + D_V)


def _inputs(r: Shape, seed: int):
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = (jax.random.normal(k[0], (r.s_q, r.h_q, r.d_qk)) / 4).astype(jnp.bfloat16)
  kv = (jax.random.normal(k[1], (r.s_kv, r.d_qk)) / 4).astype(jnp.bfloat16)
  idx = jax.random.randint(k[2], (r.s_q, r.topk), 0, r.s_kv, jnp.int32)
  sink = jax.random.normal(k[3], (r.h_q,), jnp.float32)
  g = jax.random.normal(k[4], (r.s_q, r.h_q, D_V)).astype(jnp.bfloat16)
  return q, kv, idx, sink, g


def _vjp(r: Shape, impl, q, kv, idx, sink):
  def fwd(q, kv, sink):
    return sparse_mla_prefill(q, kv, idx, sm_scale=r.d_qk ** -0.5, attn_sink=sink,
                              implementation=impl)[0]
  return jax.vjp(fwd, q, kv, sink)


def check(r: Shape, impl=None) -> float:
  """Largest rel. error of ``(dq, dkv, dsink)`` against the XLA backward's."""
  q, kv, idx, sink, g = _inputs(r, 0)
  q, idx, g = q[:CHECK_TOKENS], idx[:CHECK_TOKENS], g[:CHECK_TOKENS]
  grads = jax.jit(lambda *a: _vjp(r, impl, *a)[1](g))(q, kv, idx, sink)
  want = jax.jit(lambda *a: _vjp(r, "xla", *a)[1](g))(q, kv, idx, sink)
  return max(check_close(name, a, b)
             for name, a, b in zip(("dq", "dkv", "dsink"), grads, want, strict=True))


def _side_by_side(r: Shape, impl, dsa) -> tuple[float, float, float]:
  """Our backward and cuDNN's on the same ``NUM_SETS`` input sets (each from our
  forward's ``out`` and ``lse``): gradients compared on the first set, then both timed
  by ``time_calls_us``. Returns (our us, cuDNN us, largest rel. error)."""
  from torch_bridge import to_jax

  sm_scale = r.d_qk ** -0.5
  vjp = jax.jit(functools.partial(_vjp, r, impl))
  apply = jax.jit(lambda f, g: f(g))
  ours, theirs = [], []
  for i in range(NUM_SETS):
    q, kv, idx, sink, g = _inputs(r, i)
    out, _, lse = sparse_mla_prefill(q, kv, idx, sm_scale=sm_scale, attn_sink=sink,
                                     implementation=impl)
    ours.append(functools.partial(apply, vjp(q, kv, idx, sink)[1], g))
    theirs.append(cudnn_peer.sparse_backward(dsa, q, kv, idx, out, lse, g, sink, sm_scale))
  got, peer = ours[0](), [to_jax(t) for t in theirs[0]()]
  err = max(check_close(f"ours vs cuDNN {name}", a, b)
            for name, a, b in zip(("dq", "dkv", "dsink"), got, peer, strict=True))
  return time_calls_us(ours, sync_jax), time_calls_us(theirs, sync_torch), err


def run(rows=ROWS, *, impl=None):
  dsa = cudnn_peer.load()
  for name, r in rows.items():
    err = check(r, impl)
    if dsa is not None:
      us, peer_us, peer_err = _side_by_side(r, impl, dsa)
      yield Row("sparse_mla_prefill backward",
                f"{name} (grad rel err {err:.1e}, vs cuDNN {peer_err:.1e})", us,
                _flop(r) / us / 1e6, "TFLOP/s", anchor=_flop(r) / peer_us / 1e6,
                anchor_name=cudnn_peer.NAME, device=device_name())
      continue
    vjp = jax.jit(functools.partial(_vjp, r, impl))
    sets = []
    for i in range(NUM_SETS):
      q, kv, idx, sink, g = _inputs(r, i)
      sets.append((vjp(q, kv, idx, sink)[1], g))
    us = time_us(lambda f, g: f(g), sets, reps=10)
    yield Row("sparse_mla_prefill backward", f"{name} (grad rel err {err:.1e})", us,
              _flop(r) / us / 1e6, "TFLOP/s", anchor=BAR_TFLOPS,
              anchor_name="issue #19 bar", device=device_name())


def _kernel_sets(r: Shape) -> list[tuple]:
  """``NUM_SETS`` argument tuples of the backward kernels (the forward's lse, ``f`` and
  ``b`` from the Mosaic/Triton forward)."""
  sets = []
  for i in range(NUM_SETS):
    q, kv, idx, sink, g = _inputs(r, i)
    fwd_out, _, lse = sparse_mla_prefill(q, kv, idx, sm_scale=r.d_qk ** -0.5, attn_sink=sink)
    f, g_out = backward.head_terms(fwd_out, lse, g, sink)
    lengths = jnp.full((r.s_q,), r.topk, jnp.int32)
    sets.append((q, kv, idx, lengths, g, lse, f, -f * g_out))
  return sets


def sweep(rows, configs) -> list[Row]:
  """The Triton backward kernels alone, per ``triton_backward.Config``."""
  out = []
  for name, r in rows.items():
    sets = _kernel_sets(r)
    for config in configs:
      def bwd(*a, config=config, r=r):
        return triton_backward.sparse_prefill_bwd(*a, sm_scale=r.d_qk ** -0.5, d_v=D_V,
                                                  config=config)
      try:
        us = time_us(bwd, sets, reps=10)
      except Exception as e:  # noqa: BLE001  (a config that does not compile)
        print(f"{name} {config}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        continue
      out.append(Row("sparse_mla_prefill backward kernel", f"{name} {config}", us,
                     _flop(r) / us / 1e6, "TFLOP/s", device=device_name()))
  return out


def kernels(rows) -> list[Row]:
  """The backward kernels alone: the Mosaic GPU kernel beside the Triton pair (default
  Config) on the same inputs, outputs compared first. The figure is TFLOP/s of the
  matmuls the Mosaic GPU kernel issues (S, dP, dQ, dK, dV: 2.5x the forward's at d_qk
  576; the Triton pair issues S and dP twice)."""
  out = []
  for name, r in rows.items():
    sets = _kernel_sets(r)
    sm_scale = r.d_qk ** -0.5
    issued = 2 * r.s_q * r.h_q * r.topk * (3 * r.d_qk + 2 * D_V)
    mosaic = jax.jit(functools.partial(mosaic_backward.sparse_prefill_bwd, sm_scale=sm_scale))
    triton = jax.jit(functools.partial(triton_backward.sparse_prefill_bwd, sm_scale=sm_scale,
                                       d_v=D_V, config=triton_backward.Config()))
    errs = [check_close(f"{name} {part}", got, want)
            for part, got, want in zip(("dq", "dkv"), mosaic(*sets[0]), triton(*sets[0]),
                                            strict=True)]
    t_us = time_us(triton, sets, reps=5)
    m_us = time_us(mosaic, sets, reps=5)
    out.append(Row("sparse_mla_prefill backward kernels",
                   f"{name} Mosaic GPU (vs Triton rel err dq {errs[0]:.1e}, dkv {errs[1]:.1e})",
                   m_us, issued / m_us / 1e6, "TFLOP/s", anchor=issued / t_us / 1e6,
                   anchor_name="Triton kernels", device=device_name()))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", help="comma-separated names of ROWS")
  parser.add_argument("--configs", help="dq_bh:dq_bk:dkv_bh:dkv_bk:w:s,... "
                      "(triton_backward.Config)")
  parser.add_argument("--implementation", default=None, help="the forward's (\"xla\": the XLA "
                      "backward too)")
  parser.add_argument("--kernels", action="store_true",
                      help="time the backward kernels alone, Mosaic GPU beside the Triton pair")
  args = parser.parse_args()
  rows = ROWS if not args.rows else {n: ROWS[n] for n in args.rows.split(",")}
  if args.configs:
    configs = [triton_backward.Config(*map(int, c.split(":"))) for c in args.configs.split(",")]
    print_table(sweep(rows, configs))
  elif args.kernels:
    print_table(kernels(rows))
  else:
    print_table(list(run(rows, impl=args.implementation)))


if __name__ == "__main__":
  sys.exit(main())
