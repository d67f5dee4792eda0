"""Per-call overhead of the torch bridge: a small decode from torch vs the same op from JAX.

The kernels are tiny, so a loop of calls measures host dispatch: the JAX figure
is one jitted call, the torch figure adds the DLPack hand-offs and the stream
fences. Also times bare ``to_jax`` / ``to_torch`` per tensor.

  PYTHONPATH=$PWD python3 -m benchmarks.bench_bridge_overhead [--impl triton|xla]

``run()`` reports each op from torch against the same op from JAX (ratio = JAX /
torch time, so 1.0 means the bridge adds nothing) and the bare conversions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_mla
from benchmarks.harness import Row
from jax_mla import cache as jcache
from jax_mla import sparse_mla
from torch_bridge import _interop, ops, to_jax, to_torch


def per_call_us(fn, sync, calls=2000, reps=7):
  """Host wall time per call of ``fn`` over a loop of calls, one ``sync`` at the end.

  Not ``harness.time_us``: the subject is the host cost of each Python-level call
  (DLPack hand-offs, stream fences, dispatch), which one jitted program over many
  input sets would remove; the kernels are tiny so the loop is host-bound.
  """
  for _ in range(50):
    fn()
  sync()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(calls):
      fn()
    sync()
    times.append((time.perf_counter() - t0) / calls * 1e6)
  return statistics.median(times)


def primitive_costs(dev, sync):
  """Per-tensor cost of each step of a hand-off (64x64 float32, created and dropped)."""
  t = torch.ones(64, 64, device=dev)
  jdev = _interop.jax_device(t)
  a = jax.device_put(jnp.ones((64, 64), jnp.float32), jdev)
  stream = _interop.torch_stream_ptr(t)
  rows = [
      ("torch to_dlpack", lambda: torch.utils.dlpack.to_dlpack(t)),
      ("import, no stream (to_dlpack + PJRT view)",
       lambda: _interop.import_tensor(t, jdev, None)),
      ("jax.dlpack.from_dlpack (public)", lambda: jax.dlpack.from_dlpack(t)),
      ("export with torch stream (+ torch from capsule)",
       lambda: _interop.export_array(a, stream)),
      ("torch.from_dlpack (public)", lambda: torch.from_dlpack(a)),
  ]
  if dev == "cuda":
    cur = _interop.torch_stream(t)
    ready = _interop.fence_torch_to_jax(cur, jdev)
    rows += [
        ("import on JAX's ready-event stream", lambda: _interop.import_tensor(t, jdev, ready)),
        ("fence: ready stream waits for torch's stream",
         lambda: _interop.fence_torch_to_jax(cur, jdev)),
        ("torch.cuda.current_stream", lambda: torch.cuda.current_stream(t.device)),
    ]
  return [(name, per_call_us(fn, sync, calls=1000, reps=5)) for name, fn in rows]


def measure(impl=None, calls=2000, reps=7):
  """(op rows [(name, jax us, torch us)], to_jax us, to_torch us, primitive costs)."""
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  impl = {"implementation": impl} if impl else {}
  time_it = lambda fn, sync: per_call_us(fn, sync, calls=calls, reps=reps)
  rng = np.random.default_rng(0)
  rows = []

  # Dense decode, FlashMLA convention: b 4, s_q 1, h_q 16, 8 blocks of 64.
  b, h_q, nb, bs = 4, 16, 32, 64
  q = torch.from_numpy(rng.normal(size=(b, 1, h_q, 576)).astype(np.float32)).to(
      torch.bfloat16).to(dev)
  kv = torch.from_numpy(rng.normal(size=(nb, bs, 576)).astype(np.float32)).to(
      torch.bfloat16).to(dev)
  bt = torch.arange(nb, dtype=torch.int32, device=dev).reshape(b, nb // b)
  sl = torch.full((b,), 300, dtype=torch.int32, device=dev)
  jargs = [to_jax(t) for t in (q, kv, bt, sl)]
  jax_fn = lambda: jax_mla.mla_decode_paged(*jargs, sm_scale=0.04, **impl)
  torch_fn = lambda: ops.mla_decode_paged(q, kv, bt, sl, sm_scale=0.04, **impl)
  jsync = lambda: jax.block_until_ready(jax_fn())
  tj = time_it(jax_fn, jsync)
  tt = time_it(torch_fn, sync)
  rows.append(("mla_decode_paged b4 h16 (4 in, 2 out)", tj, tt))
  # As in a model: each step makes a new q (one elementwise kernel on each side),
  # so q is imported fresh and, with torch's stream busy, carries the fence.
  jq = jargs[0]
  jax_step = jax.jit(lambda q, *rest: jax_mla.mla_decode_paged(q * 1, *rest, sm_scale=0.04,
                                                               **impl))
  step_j = lambda: jax_step(jq, *jargs[1:])
  step_t = lambda: ops.mla_decode_paged(q * 1, kv, bt, sl, sm_scale=0.04, **impl)
  rows.append(("mla_decode_paged, new q each call (+1 elementwise op)",
               time_it(step_j, lambda: jax.block_until_ready(step_j())), time_it(step_t, sync)))
  meta, _ = ops.get_mla_metadata()
  k4 = kv.unsqueeze(2)
  drop = lambda: ops.flash_mla_with_kvcache(q, k4, bt, sl, 512, meta, softmax_scale=0.04)
  rows.append(("flash_mla_with_kvcache dense drop-in", tj, time_it(drop, sync)))

  # Sparse decode, fp8_ds_mla, topk 64.
  x = jnp.asarray(rng.normal(size=(nb, bs, 576)), jnp.bfloat16)
  cache_j = jcache.quantize_fp8_ds_mla(x)
  cache_t = to_torch(cache_j)
  idx = torch.from_numpy(rng.integers(0, nb * bs, (b, 1, 64)).astype(np.int32)).to(dev)
  sjargs = [to_jax(q), cache_j, to_jax(idx)]
  sjax = lambda: sparse_mla.sparse_mla_decode(*sjargs, sm_scale=0.04, **impl)
  stor = lambda: ops.sparse_mla_decode(q, cache_t, idx, sm_scale=0.04, **impl)
  tj = time_it(sjax, lambda: jax.block_until_ready(sjax()))
  rows.append(("sparse_mla_decode fp8_ds_mla topk64 (3 in, 2 out)", tj, time_it(stor, sync)))

  # Bare conversions.
  a = jnp.ones((64, 64), jnp.float32) if dev == "cpu" else jax.device_put(
      jnp.ones((64, 64), jnp.float32), jax.devices("gpu")[0])
  t = torch.ones(64, 64, device=dev)
  t_to_jax = time_it(lambda: to_jax(t), sync)
  t_to_torch = time_it(lambda: to_torch(a), sync)
  return rows, t_to_jax, t_to_torch, primitive_costs(dev, sync)


def run(impl=None, calls=2000, reps=7) -> list[Row]:
  """Per-call time of each op from torch (anchor: the same op from JAX) and of the
  bare conversions (no anchor)."""
  rows, t_to_jax, t_to_torch, _ = measure(impl, calls, reps)
  dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
  out = [Row("torch bridge", name, tt, tt, "us", tj, "same op from JAX", dev)
         for name, tj, tt in rows]
  out += [Row("torch bridge", "to_jax per 64x64 tensor", t_to_jax, t_to_jax, "us", None, "", dev),
          Row("torch bridge", "to_torch per 64x64 tensor", t_to_torch, t_to_torch, "us", None,
              "", dev)]
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--impl", default=None, choices=[None, "triton", "xla"])
  args = p.parse_args()
  rows, t_to_jax, t_to_torch, prims = measure(args.impl)
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; jax "
        f"{jax.__version__}, torch {torch.__version__}; fast DLPack path: {_interop._FAST}; "
        f"implementation: {args.impl or 'default'}")
  print(f"to_jax  per tensor: {t_to_jax:7.2f} us")
  print(f"to_torch per tensor: {t_to_torch:7.2f} us")
  for name, us in prims:
    print(f"  {name:52s} {us:7.2f} us")
  print(f"{'op':55s} {'jax us':>8s} {'torch us':>9s} {'added us':>9s}")
  for name, tj, tt in rows:
    print(f"{name:55s} {tj:8.2f} {tt:9.2f} {tt - tj:9.2f}")


if __name__ == "__main__":
  main()
