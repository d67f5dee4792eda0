"""Scaling of sharded MLA attention (jax_mla.sharding) from one GPU to two.

For the FlashMLA anchor decode rows (and the V3.2 sparse prefill row; anchors:
benchmarks/RESULTS.md, "Anchors", 2026-11-22 edition) it times the
op on one GPU, then under ``head_parallel`` on two GPUs (query heads split, the
latent cache replicated) and, for the batch-major decodes, under
``request_parallel`` (requests and cache blocks split), checks every sharded
output against the one-GPU output, and reports the per-call time with the
speedup over one GPU as the ratio. Needs two GPUs for the sharded rows (with one,
only the one-GPU rows are reported).

  python3 -m benchmarks.bench_sharding             # prints the table
  python3 -m benchmarks.run --only bench_sharding  # the harness
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.harness import Row, device_name, n_sets, print_table, rel_err, time_us
from jax_mla.cache import quantize_fp8_ds_mla
from jax_mla.dense_decode import mla_decode_paged
from jax_mla.sharding import head_parallel, request_parallel
from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill


def _placer(mesh):
  """device_put onto ``mesh``, once per distinct array (input sets share the cache)."""
  done = {}

  def place(args, specs):
    for x, s in zip(args, specs, strict=True):
      if id(x) not in done:
        done[id(x)] = jax.device_put(x, NamedSharding(mesh, s))
    return tuple(done[id(x)] for x in args)
  return place


def _scaling_rows(name, config, fn, sets, *, flops, anchor, anchor_name, modes, dev):
  """One-GPU row (TFLOP/s against the anchor) and one row per sharded mode (time,
  ratio = speedup over one GPU), each sharded output checked against one GPU's."""
  one = jax.jit(fn)
  ref = jax.block_until_ready(one(*sets[0]))
  us1 = time_us(fn, sets)
  rows = [Row(name, f"{config}, 1 GPU", us1, flops / us1 / 1e6, "TFLOP/s", anchor,
              anchor_name, dev)]
  for mode, (wrapped, mesh, specs) in modes.items():
    place = _placer(mesh)
    placed = [place(s, specs) for s in sets]
    out = jax.block_until_ready(jax.jit(wrapped)(*placed[0]))
    err = max(rel_err(o, r) for o, r in zip(jax.tree_util.tree_leaves(out),
                                              jax.tree_util.tree_leaves(ref), strict=True))
    if not err < 1e-2:
      raise AssertionError(f"{name} {mode}: sharded output differs from one GPU (rel {err:.2e})")
    us = time_us(wrapped, placed)
    n = mesh.devices.size
    print(f"{name} {config}, {n} GPUs {mode}: {us:.1f} us, {flops / us / 1e6:.0f} TFLOP/s, "
          f"speedup {us1 / us:.2f}x, max rel err vs 1 GPU {err:.1e}")
    rows.append(Row(name, f"{config}, {n} GPU {mode}", us, us, "us", us1,
                    "same op on 1 GPU (speedup)", dev))
  return rows


# The anchor rows' shapes (module constants, so a CPU smoke run can shrink them).
SPARSE_DECODE = dict(b=128, s_q=2, h=128, topk=2048, bs=64, nb=4096)
DENSE_DECODE = dict(b=128, s_q=1, h=128, seqlen=4096, bs=64)
SPARSE_PREFILL = dict(s_q=4096, h=128, topk=2048, s_kv=32768)


def run(implementation: str = "triton") -> list[Row]:
  dev = device_name()
  n_dev = min(jax.device_count(), 2)
  # jax.make_mesh (Explicit axes), as a user builds one.
  mesh_tp = jax.make_mesh((n_dev,), ("tp",), devices=jax.devices()[:n_dev])
  mesh_dp = jax.make_mesh((n_dev,), ("dp",), devices=jax.devices()[:n_dev])
  key = jax.random.PRNGKey(0)
  rows = []

  # Sparse decode fp8_ds_mla: b 128, s_q 2, h 128, topk 2048, block 64 (FlashMLA 395 TFLOP/s).
  b, s_q, h, topk, bs, nb = (SPARSE_DECODE[k] for k in ("b", "s_q", "h", "topk", "bs", "nb"))
  slots = nb * bs
  cache = quantize_fp8_ds_mla(jax.random.normal(key, (nb, bs, 576), jnp.bfloat16))
  half = (jnp.arange(b) >= b // 2)[:, None, None] * (slots // 2)  # request's own half (dp)
  sets = []
  for i in range(n_sets(b * s_q * h * 576 * 2 + b * s_q * topk * 4)):
    kq, ki = jax.random.split(jax.random.PRNGKey(i + 1))
    q = jax.random.normal(kq, (b, s_q, h, 576), jnp.bfloat16)
    idx = jax.random.randint(ki, (b, s_q, topk), 0, slots // 2, jnp.int32) + half
    sets.append((q, cache, idx))
  kw = dict(kv_cache_dtype="fp8_ds_mla", implementation=implementation)
  fn = functools.partial(sparse_mla_decode, **kw)
  modes = {}
  if n_dev > 1:
    modes["heads split"] = (
        functools.partial(head_parallel(sparse_mla_decode, mesh_tp, "tp"), **kw), mesh_tp,
        (P(None, None, "tp"), P(), P()))
    modes["requests split"] = (
        functools.partial(request_parallel(sparse_mla_decode, mesh_dp, "dp"), **kw), mesh_dp,
        (P("dp"), P("dp"), P("dp")))
  rows += _scaling_rows(
      "sharded sparse_mla_decode", f"fp8_ds_mla b {b} s_q {s_q} h {h} topk {topk}", fn, sets,
      flops=2 * b * s_q * h * topk * (576 + 512), anchor=395.0, anchor_name="FlashMLA (1 H100)",
      modes=modes, dev=dev)
  del cache, sets

  # Dense decode bf16: b 128, s_q 1, h 128, seqlen 4096, block 64 (FlashMLA 554 TFLOP/s).
  b, s_q, h, seqlen, bs = (DENSE_DECODE[k] for k in ("b", "s_q", "h", "seqlen", "bs"))
  per_req = seqlen // bs
  nb = b * per_req
  cache = jax.random.normal(key, (nb, bs, 576), jnp.bfloat16)
  lens = jnp.full((b,), seqlen, jnp.int32)
  sets = []
  for i in range(n_sets(b * s_q * h * 576 * 2)):
    kq, kt = jax.random.split(jax.random.PRNGKey(100 + i))
    q = jax.random.normal(kq, (b, s_q, h, 576), jnp.bfloat16)
    # Each half of the requests owns one half of the blocks (the dp contract).
    perm = jnp.concatenate([jax.random.permutation(kt, nb // 2),
                            nb // 2 + jax.random.permutation(kt, nb // 2)])
    sets.append((q, cache, perm.reshape(b, per_req).astype(jnp.int32), lens))
  kw = dict(implementation=implementation)
  fn = functools.partial(mla_decode_paged, **kw)
  modes = {}
  if n_dev > 1:
    modes["heads split"] = (
        functools.partial(head_parallel(mla_decode_paged, mesh_tp, "tp"), **kw), mesh_tp,
        (P(None, None, "tp"), P(), P(), P()))
    modes["requests split"] = (
        functools.partial(request_parallel(mla_decode_paged, mesh_dp, "dp"), **kw), mesh_dp,
        (P("dp"), P("dp"), P("dp"), P("dp")))
  rows += _scaling_rows(
      "sharded mla_decode_paged", f"bf16 b {b} s_q {s_q} h {h} seqlen {seqlen}", fn, sets,
      flops=2 * b * s_q * h * seqlen * (576 + 512), anchor=554.0,
      anchor_name="FlashMLA (1 H100)", modes=modes, dev=dev)
  del cache, sets

  # Sparse prefill V3.2: s_q 4096, h 128, topk 2048, s_kv 32768, sink (FlashMLA 623 TFLOP/s).
  s_q, h, topk, s_kv = (SPARSE_PREFILL[k] for k in ("s_q", "h", "topk", "s_kv"))
  kv = jax.random.normal(key, (s_kv, 576), jnp.bfloat16)
  sink = jax.random.normal(key, (h,), jnp.float32)
  sets = []
  for i in range(8):
    kq, ki = jax.random.split(jax.random.PRNGKey(200 + i))
    sets.append((jax.random.normal(kq, (s_q, h, 576), jnp.bfloat16), kv,
                 jax.random.randint(ki, (s_q, topk), 0, s_kv, jnp.int32)))
  kw = dict(sm_scale=576**-0.5, attn_sink=sink, implementation=implementation)
  fn = functools.partial(sparse_mla_prefill, **kw)
  modes = {}
  if n_dev > 1:
    modes["heads split"] = (
        functools.partial(head_parallel(sparse_mla_prefill, mesh_tp, "tp"), **kw), mesh_tp,
        (P(None, "tp"), P(), P()))
  rows += _scaling_rows(
      "sharded sparse_mla_prefill", f"V3.2 s_q {s_q} h {h} topk {topk} s_kv {s_kv} sink", fn,
      sets, flops=2 * s_q * h * topk * (576 + 512), anchor=623.0,
      anchor_name="FlashMLA (1 H100)", modes=modes, dev=dev)
  return rows


if __name__ == "__main__":
  if jax.device_count() < 2:
    print(f"only {jax.device_count()} device(s): reporting the one-GPU rows alone")
  print_table(run())
