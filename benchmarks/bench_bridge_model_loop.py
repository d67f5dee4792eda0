"""The torch bridge inside a torch model: a decode step of many layers, each a torch
projection, sparse fp8_ds_mla decode attention, and a torch output projection.

  PYTHONPATH=$PWD python3 -m benchmarks.bench_bridge_model_loop [--layers 30] [--heads 16]
      [--profile]

Each layer has its own cache (caches cross the bridge once) and shares the two
weights. The attention is, per mode:

* ``torch only``: no attention (the projections alone: the floor);
* ``FlashMLA``: FlashMLA's ``flash_mla_with_kvcache`` (where ``flash_mla`` imports,
  benchmarks/flashmla_peer.py); below its 64 heads (``--heads 16``: tensor parallelism
  8 of DeepSeek V3.2's 128) the query is padded to 64 heads and the first ones kept, as
  vLLM's FlashMLA sparse backend does;
* ``bridge``: ``torch_bridge.ops.flash_mla_with_kvcache``, the same call on jax_mla
  (its Mosaic GPU kernel launched directly on torch's stream where it runs on Hopper);
* ``bridge PJRT``: the same with direct launch off (``set_direct_launch(False)``):
  DLPack hand-offs and a jitted dispatch per call;
* ``JAX``: the same step written in JAX (``jax_mla.sparse_mla_decode`` and jnp
  projections, one jit per layer call): what the kernels cost without the bridge;
* ``JAX, one jit``: the whole step (every layer) in one jitted program, as a JAX model
  runs it: no host work between layers.

Each step's time is host wall time from its first launch until the GPU is idle, per
layer; the median of many steps. "bridge adds" = bridge - JAX (the hand-offs, with
the same kernel) and bridge - FlashMLA (what a FlashMLA user would see). A second
figure, ``host us/layer``, is the time the host spends issuing a step with the GPU held
busy by a sleep kernel queued first: when it is below the sleep, no call blocked the
host on the GPU. ``--profile`` prints cProfile's top functions of the bridge loop.

``bridge, CUDA graph`` and ``FlashMLA, CUDA graph``: the step captured once in a CUDA
graph and replayed, as vLLM runs its decode steps: no host work per layer, so the
figure is the GPU's (the bridge's direct launches are captured like any kernel launch).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import statistics
import time

import jax
import jax.numpy as jnp
import torch

from benchmarks import flashmla_peer
from benchmarks.harness import SMOKE, Row, add_l2_fetch_option, apply_l2_fetch, check_close
from jax_mla import sparse_mla_decode
from jax_mla.cache import kv_cache_shape, quantize_fp8_ds_mla
from torch_bridge import ops, set_direct_launch, to_torch

D_QK, D_V, BLOCK = 576, 512, 64


@dataclasses.dataclass(frozen=True)
class Loop:
  batch: int
  layers: int = 30
  hidden: int = 1024
  tokens: int = 4096  # cache slots per request
  topk: int = 2048
  heads: int = 128  # query heads on this GPU (16: DeepSeek V3.2 under tensor parallelism 8)


SMOKE_LOOP = dict(layers=2, hidden=64, tokens=128, topk=32)  # tiny, on the CPU


def _inputs(loop: Loop, device):
  """Per-layer caches (torch-allocated, as a torch model holds them; FlashMLA's view) and
  indices, shared weights and the step's input activations."""
  g = torch.Generator(device=device).manual_seed(0)
  nb = loop.batch * loop.tokens // BLOCK
  latent = (jax.random.normal(jax.random.PRNGKey(0), (1, BLOCK, D_QK)) / 3).astype(jnp.bfloat16)
  shape = kv_cache_shape(nb, BLOCK, D_QK, "fp8_ds_mla")
  block = to_torch(quantize_fp8_ds_mla(latent)).to(device)
  # One allocation holds every layer's cache (as a model runner's kv_caches do); each
  # layer passes FlashMLA's fp8 view of its slice.
  storage = torch.empty((loop.layers, *shape), dtype=torch.uint8, device=device)
  storage.copy_(block.expand(storage.shape))
  caches = [storage[layer].view(torch.float8_e4m3fn).view(nb, BLOCK, 1, -1)
            for layer in range(loop.layers)]
  indices = []
  for _ in range(loop.layers):
    start = torch.arange(loop.batch, device=device, dtype=torch.int32)[:, None, None]
    indices.append(start * loop.tokens + torch.randint(
        0, loop.tokens, (loop.batch, 1, loop.topk), generator=g, device=device,
        dtype=torch.int32))
  h = loop.heads
  w_q = torch.randn(loop.hidden, h * D_QK, generator=g, device=device,
                    dtype=torch.bfloat16) / loop.hidden ** 0.5
  w_o = torch.randn(h * D_V, loop.hidden, generator=g, device=device,
                    dtype=torch.bfloat16) / (h * D_V) ** 0.5
  x = torch.randn(loop.batch, loop.hidden, generator=g, device=device, dtype=torch.bfloat16)
  return storage, caches, indices, w_q, w_o, x


def _torch_step(attention, caches, indices, w_q, w_o, b):
  """One decode step in torch; ``attention(layer, q)`` -> ``[b, 1, h, d_v]`` or None."""
  h = w_q.shape[1] // D_QK

  def step(x, marks=None):
    for layer in range(len(caches)):
      q = (x @ w_q).view(b, 1, h, D_QK)
      o = attention(layer, q)
      x = x + (q[..., :D_V] if o is None else o).reshape(b, -1) @ w_o
      if marks is not None:
        marks.append(time.perf_counter())
    return x
  return step


def _flashmla_padded(attention, h):
  """``attention(layer, q)`` for ``h`` heads on a kernel that takes at least 64: the query
  padded with zero heads, the first ``h`` outputs kept."""
  if h >= flashmla_peer.HEADS:
    return attention
  pad = flashmla_peer.HEADS - h
  return lambda layer, q: attention(layer, torch.nn.functional.pad(q, (0, 0, 0, pad)))[:, :, :h]


def _jax_steps(caches, indices, w_q, w_o, b):
  """The same step in JAX on the same arrays: ``(one jitted layer called per layer, the
  whole step jitted)``."""
  jcaches = [jax.dlpack.from_dlpack(c.view(torch.uint8).squeeze(2)) for c in caches]
  jidx = [jax.dlpack.from_dlpack(i) for i in indices]
  jw_q, jw_o = jax.dlpack.from_dlpack(w_q), jax.dlpack.from_dlpack(w_o)
  h = jw_q.shape[1] // D_QK

  def layer(x, cache, idx):
    q = (x @ jw_q).reshape(b, 1, h, D_QK)
    o, _ = sparse_mla_decode(q, cache, idx, kv_cache_dtype="fp8_ds_mla")
    return x + o.reshape(b, -1) @ jw_o

  jitted_layer = jax.jit(layer)

  def step(x):
    for c, i in zip(jcaches, jidx, strict=True):
      x = jitted_layer(x, c, i)
    return x

  @jax.jit
  def whole(x, caches, indices):
    for c, i in zip(caches, indices, strict=True):
      x = layer(x, c, i)
    return x

  return step, lambda x: whole(x, jcaches, jidx)


def _through_pjrt(step):
  """``step`` with the bridge's direct launch off: every call dispatched through PJRT."""
  def run(x, marks=None):
    previous = set_direct_launch(False)
    try:
      return step(x, marks)
    finally:
      set_direct_launch(previous)
  return run


def _time_steps(step, x, sync, steps):
  for _ in range(3):
    step(x)
  sync()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    step(x)
    sync()
    times.append(time.perf_counter() - t0)
  return 1e6 * statistics.median(times)


def _host_issue_us(step, x, sleep_us=200_000):
  """Host time to issue one step while a sleep kernel holds torch's stream busy, and
  the first layer whose call returned only after the sleep had mostly passed (None: no
  call waited for the GPU)."""
  step(x)
  torch.cuda.synchronize()
  torch.cuda._sleep(int(sleep_us * 2e3))  # cycles: at least sleep_us at <= 2 GHz
  marks = []
  t0 = time.perf_counter()
  step(x, marks)
  issued = 1e6 * (time.perf_counter() - t0)
  torch.cuda.synchronize()
  late = [i for i, t in enumerate(marks) if 1e6 * (t - t0) > 0.8 * sleep_us]
  return issued, late[0] if late else None


def _graphed_us(step, x, steps):
  """Microseconds of one replay of ``step(x)`` captured in a CUDA graph (warmed up on a
  side stream first, as torch's CUDA graph notes ask)."""
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):
    for _ in range(3):
      step(x)
  torch.cuda.current_stream().wait_stream(side)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    step(x)
  return _time_steps(lambda _: graph.replay(), x, torch.cuda.synchronize, steps)


def measure(loop: Loop, steps=20, profile=False):
  """{mode: (us per layer, host us per layer or None, first blocked layer or None)}.
  On a machine without CUDA (the smoke run) everything runs on the CPU, without the
  host-blocking probe."""
  cuda = torch.cuda.is_available()
  device = torch.device("cuda" if cuda else "cpu")
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  storage, caches, indices, w_q, w_o, x = _inputs(loop, device)  # storage: the caches' memory
  b = loop.batch
  meta_bridge = [ops.get_mla_metadata()[0] for _ in caches]

  def bridge_attention(layer, q):
    return ops.flash_mla_with_kvcache(
        q, caches[layer], None, None, D_V, meta_bridge[layer], is_fp8_kvcache=True,
        indices=indices[layer])[0]

  bridge = _torch_step(bridge_attention, caches, indices, w_q, w_o, b)
  modes = {
      "torch only": _torch_step(lambda layer, q: None, caches, indices, w_q, w_o, b),
      "bridge": bridge,
      "bridge PJRT": _through_pjrt(bridge),
  }
  fm = flashmla_peer.load()
  if fm is not None:
    meta_fm = [fm.get_mla_metadata()[0] for _ in caches]
    fm_attention = _flashmla_padded(
        lambda layer, q: fm.flash_mla_with_kvcache(
            q, caches[layer], None, None, D_V, meta_fm[layer], is_fp8_kvcache=True,
            indices=indices[layer])[0], loop.heads)
    q = (x @ w_q).view(b, 1, loop.heads, D_QK)  # the outputs agree before any timing
    check_close(f"b {b}: bridge vs FlashMLA attention out",
                *(f(0, q).float().cpu().numpy() for f in (bridge_attention, fm_attention)))
    modes["FlashMLA"] = _torch_step(fm_attention, caches, indices, w_q, w_o, b)
  out = {}
  for name, step in modes.items():
    us = _time_steps(step, x, sync, steps) / loop.layers
    if not cuda:
      out[name] = (us, None, None)
      continue
    issued, blocked_at = _host_issue_us(step, x)
    out[name] = (us, issued / loop.layers, blocked_at)
    print(f"b {b:3d} {name:11s} {us:8.1f} us/layer  host {issued / loop.layers:7.1f} us/layer "
          f"{'(never blocked)' if blocked_at is None else f'(BLOCKED from layer {blocked_at})'}",
          flush=True)
  for name in ("bridge", "FlashMLA") if cuda else ():
    if name in modes:
      us = _graphed_us(modes[name], x, steps) / loop.layers
      out[f"{name}, CUDA graph"] = (us, None, None)
      print(f"b {b:3d} {name + ', CUDA graph':11s} {us:8.1f} us/layer", flush=True)
  jx = jax.dlpack.from_dlpack(x)
  for name, jstep in zip(("JAX", "JAX, one jit"), _jax_steps(caches, indices, w_q, w_o, b),
                         strict=True):
    us = _time_steps(lambda x, f=jstep: jax.block_until_ready(f(x)), jx, lambda: None, steps)
    out[name] = (us / loop.layers, None, None)
    print(f"b {b:3d} {name:11s} {us / loop.layers:8.1f} us/layer", flush=True)
  if profile:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
      modes["bridge"](x)
    sync()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
  return out


def run(batches=(4, 64), heads=128) -> list[Row]:
  """Per-layer time of the bridge loop against FlashMLA's (where it imports) and against
  the same step in JAX."""
  dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
  rows = []
  for b in batches:
    loop = Loop(b, heads=heads, **SMOKE_LOOP) if SMOKE else Loop(b, heads=heads)
    res = measure(loop, steps=2 if SMOKE else 20)
    bridge = res["bridge"][0]
    rows.append(Row("bridge model loop", f"b{b} vs JAX step", bridge, bridge, "us",
                    res["JAX"][0], "same step in JAX", dev))
    rows.append(Row("bridge model loop", f"b{b} vs JAX step in one jit", bridge, bridge, "us",
                    res["JAX, one jit"][0], "same step in one JAX program", dev))
    rows.append(Row("bridge model loop", f"b{b} vs bridge through PJRT", bridge, bridge, "us",
                    res["bridge PJRT"][0], "bridge, direct launch off", dev))
    if "FlashMLA" in res:
      rows.append(Row("bridge model loop", f"b{b} vs FlashMLA", bridge, bridge, "us",
                      res["FlashMLA"][0], flashmla_peer.NAME, dev))
  return rows


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--layers", type=int, default=30)
  p.add_argument("--batches", default="4,64")
  p.add_argument("--heads", type=int, default=128,
                 help="query heads a GPU holds (16 or 32: DeepSeek V3.2 under TP 8 or 4)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--profile", action="store_true")
  add_l2_fetch_option(p)
  args = p.parse_args()
  print(torch.cuda.get_device_name(), "jax", jax.__version__, "torch", torch.__version__)
  apply_l2_fetch(args)
  for b in (int(v) for v in args.batches.split(",")):
    res = measure(Loop(b, layers=args.layers, heads=args.heads), steps=args.steps,
                  profile=args.profile)
    for name in ("FlashMLA", "JAX", "JAX, one jit"):
      if name in res:
        print(f"b {b}: bridge adds {res['bridge'][0] - res[name][0]:+.1f} us/layer over {name}")
    if "FlashMLA, CUDA graph" in res:
      print(f"b {b}: in a CUDA graph the bridge adds "
            f"{res['bridge, CUDA graph'][0] - res['FlashMLA, CUDA graph'][0]:+.1f} us/layer "
            "over FlashMLA")


if __name__ == "__main__":
  main()
