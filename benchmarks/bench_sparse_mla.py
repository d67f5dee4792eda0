"""Sparse MLA on the GPU: correctness against the reference, then timing of the FlashMLA rows.

  PYTHONPATH=$PWD python3 -m benchmarks.bench_sparse_mla [--check] [--small] [--rows ROWS]
      [--triton-configs bh:bk:w:s,...] [--mosaic-configs stages:consumer:producer,...]

``run()`` (used by ``benchmarks.run``) times the public ``sparse_mla_prefill`` /
``sparse_mla_decode`` (default tiles) on each FlashMLA row with ``harness.time_us``,
after checking the timed call against the XLA reference. Given ``--*-configs``, the
CLI times the public ops with those ``config=`` values instead (for tuning): Triton
``Config(block_h, block_k, num_warps, num_stages)``, Mosaic GPU ``Config(num_stages,
consumer_registers, producer_registers)``.
FLOPs follow FlashMLA: ``2 * tokens * h_q * (topk [+ extra_topk]) * (d_qk + d_v)``. The
anchors (``ROWS``) are the 2026-11-22 FlashMLA figures (benchmarks/RESULTS.md, "Anchors").
Where ``flash_mla`` imports, each row is also timed side by side with FlashMLA
(``--side-by-side``: only that; benchmarks/flashmla_peer.py). The DeepSeek V4.1 rows
(``V41_ROWS``, e.g. ``--rows decode_fp8_v41_h128,decode_fp8_v41+fp4_v41_h128``) have no
Hopper peer: they report cache bytes read per second against copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from benchmarks import flashmla_peer
from benchmarks.harness import (
  Row,
  add_l2_fetch_option,
  apply_l2_fetch,
  check_close,
  device_name,
  n_sets,
  print_table,
  rel_err,
  time_us,
)
from benchmarks.sanitize import QUANTIZE
from jax_mla import _mosaic
from jax_mla.cache import (
  kv_cache_shape,
  kv_cache_storage_dtype,
  quantize_fp8_ds_mla,
  quantize_fp8_model1_cache,
)
from jax_mla.sparse_mla import mosaic, sparse_mla_decode, sparse_mla_prefill, triton

# Prefill calls take milliseconds and their queries alone overflow L2: a few
# distinct (q, indices) sets sharing the KV rows are enough.
PREFILL_SETS = 4


@dataclasses.dataclass(frozen=True)
class Prefill:
  s_q: int
  h_q: int
  topk: int
  d_qk: int
  s_kv: int
  sink: bool
  anchor: float | None  # FlashMLA TFLOP/s on the H100 (None: measured side by side only)


@dataclasses.dataclass(frozen=True)
class Decode:
  dtype: str
  b: int
  s_q: int
  h_q: int
  topk: int
  block_size: int
  extra: int | None
  extra_block_size: int | None
  seqlen: int  # cache slots per request (main and extra cache each)
  anchor: float | None  # FlashMLA TFLOP/s on the H100 (None: no Hopper peer)
  extra_dtype: str | None = None  # the extra cache's format (None: dtype)


ROWS = {  # the FlashMLA anchor rows (RESULTS.md, "Anchors", 2026-11-22 edition)
    "prefill_v32": Prefill(4096, 128, 2048, 576, 32768, True, 623.0),
    "prefill_v32_131k": Prefill(4096, 128, 2048, 576, 131072, True, 546.0),
    "prefill_v4_h128": Prefill(4096, 128, 1024, 512, 32768, False, 571.0),
    "prefill_v4_h64": Prefill(4096, 64, 512, 512, 32768, False, 458.0),
    "decode_ds_b128": Decode("fp8_ds_mla", 128, 2, 128, 2048, 64, None, None, 32768, 395.0),
    "decode_ds_b64": Decode("fp8_ds_mla", 64, 2, 128, 2048, 64, None, None, 32768, 387.0),
    "decode_m1_h128": Decode("fp8_model1", 256, 2, 128, 128, 256, 1024, 64, 8192, 375.0),
    "decode_m1_h64": Decode("fp8_model1", 256, 2, 64, 128, 256, 512, 64, 8192, 229.0),
}
# DeepSeek V4.1 formats on the V4 decode rows: FlashMLA has no Hopper kernel for them,
# so they are measured against our fp8_model1 rows and against copy bandwidth.
V41_ROWS = {
    f"decode_{fmt}{'+' + extra if extra != fmt else ''}_h{h}": Decode(
        fmt, 256, 2, h, 128, 256, 1024 if h == 128 else 512, 64, 8192, None, extra)
    for h in (128, 64)
    for fmt, extra in (("fp8_v41", "fp8_v41"), ("fp8_v41", "fp4_v41"), ("fp4_v41", "fp4_v41"))
}
# Tensor-parallel head counts (DeepSeek V3.2 with TP 8 or 4: 16 or 32 of 128 heads per
# GPU). FlashMLA takes only 64 or 128 heads: side by side it runs padded to 64 (zero
# queries in the extra heads) and its first h_q heads are compared with ours.
TP_ROWS = {
    "decode_ds_b128_h8": Decode("fp8_ds_mla", 128, 2, 8, 2048, 64, None, None, 32768, None),
    "decode_ds_b128_h16": Decode("fp8_ds_mla", 128, 2, 16, 2048, 64, None, None, 32768, None),
    "decode_ds_b128_h32": Decode("fp8_ds_mla", 128, 2, 32, 2048, 64, None, None, 32768, None),
    # 48 heads: one 64-head block of the head-block kernel, read and written unpadded
    # (two transposed CTAs: 1.85x slower).
    "decode_ds_b128_h48": Decode("fp8_ds_mla", 128, 2, 48, 2048, 64, None, None, 32768, None),
    "decode_m1_h16": Decode("fp8_model1", 256, 2, 16, 128, 256, 512, 64, 8192, None),
    "prefill_v32_h16": Prefill(4096, 16, 2048, 576, 32768, True, None),
}
# Small batches (interactive decode; CLI only, --rows): the head-block kernel splits each
# token's keys over CTAs (mosaic.Config.num_splits) and combines the parts.
SMALL_ROWS = {
    "decode_ds_b4": Decode("fp8_ds_mla", 4, 1, 128, 2048, 64, None, None, 32768, None),
    "decode_ds_b16": Decode("fp8_ds_mla", 16, 1, 128, 2048, 64, None, None, 32768, None),
}
# Not an anchor row: decode_ds_b128 on a 1 GiB cache (CLI only, --rows).
EXTRA_ROWS = {
    "decode_ds_b128_1g": Decode("fp8_ds_mla", 128, 2, 128, 2048, 64, None, None, 16384, 395.0),
}
COPY_TB_S = 3.0  # device-to-device copy on the H100 (RESULTS.md)


def _bad_indices(key, shape, num_slots, frac=0.05):
  """Random slots with a fraction replaced by FlashMLA's invalid values."""
  k1, k2, k3 = jax.random.split(key, 3)
  idx = jax.random.randint(k1, shape, 0, num_slots, jnp.int32)
  bad = jnp.array([-1, -2**31, num_slots, 2**31 - 1, -123456], jnp.int32)
  pick = bad[jax.random.randint(k2, shape, 0, bad.shape[0])]
  return jnp.where(jax.random.uniform(k3, shape) < frac, pick, idx)


def _sink(key, h_q):
  k1, k2 = jax.random.split(key)
  sink = jax.random.normal(k1, (h_q,), jnp.float32)
  u = jax.random.uniform(k2, (h_q,))
  return jnp.where(u < 0.2, -jnp.inf, jnp.where(u > 0.8, jnp.inf, sink))


def _poison_unused(cache_rows, slots):
  """NaN (0xFF bytes for fp8 formats) in every slot that no index names."""
  used = jnp.zeros((cache_rows.shape[0] * cache_rows.shape[1],), bool)
  s = slots.reshape(-1)
  used = used.at[jnp.where((s >= 0) & (s < used.shape[0]), s, used.shape[0])].set(True, mode="drop")
  used = used.reshape(cache_rows.shape[:2])[..., None]
  return jnp.where(used, cache_rows, jnp.asarray(jnp.nan, cache_rows.dtype))


def check(small=False) -> bool:
  """Kernel vs reference with adversarial inputs; ``small`` shrinks every shape."""
  key = jax.random.PRNGKey(0)
  rows = []

  def report(name, got, ref, lse_idx):
    out_err = rel_err(got[0], ref[0])
    lse_err = rel_err(got[lse_idx], ref[lse_idx])
    ok = out_err < 1e-2 and lse_err < 1e-4 and bool(jnp.isfinite(got[0].astype(jnp.float32)).all())
    rows.append((name, out_err, lse_err, ok))
    print(f"check {name:44s} out {out_err:.2e} lse {lse_err:.2e} {'ok' if ok else 'FAIL'}",
          flush=True)

  for d_qk, h_q, topk in ((576, 128, 2048), (512, 64, 512), (576, 20, 61)):
    k = jax.random.split(jax.random.fold_in(key, d_qk + h_q), 5)
    s_q, s_kv = (4, 300) if small else (64, 32768)
    topk = min(topk, 97) if small else topk
    q = (jax.random.normal(k[0], (s_q, h_q, d_qk)) / 3).astype(jnp.bfloat16)
    kv = (jax.random.normal(k[1], (s_kv, d_qk)) / 3).astype(jnp.bfloat16)
    idx = _bad_indices(k[2], (s_q, topk), s_kv)
    lens = jax.random.randint(k[3], (s_q,), 0, topk + 1, jnp.int32)
    sink = _sink(k[4], h_q)
    kw = dict(sm_scale=d_qk ** -0.5, attn_sink=sink, topk_length=lens)
    ref = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
    for impl in ["triton"] + (["mosaic"] if _mosaic.default_for(mosaic.check_supported, q) else []):
      got = sparse_mla_prefill(q, kv, idx, implementation=impl, **kw)
      report(f"prefill[{impl}] d{d_qk} h{h_q} topk{topk}", got, ref, 2)
      ml = rel_err(got[1], ref[1])
      print(f"      max_logits {ml:.2e}")

  for dt, d_qk, bs, ebs, extra in (("fp8_ds_mla", 576, 64, None, None),
                                   ("fp8_model1", 512, 256, 64, 1024),
                                   ("fp8_model1", 512, 64, 2, 96), ("auto", 576, 61, 2, 100)):
    k = jax.random.split(jax.random.fold_in(key, bs), 9)
    b, s_q, h_q, topk = 8, 2, 128, 512 if extra else 2048
    if small:
      b, topk, extra = 2, 45, extra and 33
    nb = b * (64 if small else 4096) // bs + 1

    def make_cache(kk, nblocks, bsz, slots, dt=dt, d_qk=d_qk):
      x = (jax.random.normal(kk, (nblocks, bsz, d_qk)) / 3).astype(jnp.bfloat16)
      x = _poison_unused(x, slots)
      if dt == "fp8_ds_mla":
        return quantize_fp8_ds_mla(x)
      if dt == "fp8_model1":
        return quantize_fp8_model1_cache(x)
      return x

    q = (jax.random.normal(k[0], (b, s_q, h_q, d_qk)) / 3).astype(jnp.bfloat16)
    idx = _bad_indices(k[1], (b, s_q, topk), nb * bs)
    lens = jax.random.randint(k[2], (b,), 0, topk + 1, jnp.int32)
    lens_masked = jnp.where(jnp.arange(topk) < lens[:, None, None], idx, -1)
    cache = make_cache(k[3], nb, bs, lens_masked)
    kw = dict(kv_cache_dtype=dt, attn_sink=_sink(k[4], h_q), topk_length=lens)
    if extra:
      enb = b * (32 if small else 2048) // ebs + 1
      eidx = _bad_indices(k[5], (b, s_q, extra), enb * ebs)
      elens = jax.random.randint(k[6], (b,), 0, extra + 1, jnp.int32)
      ecache = make_cache(k[7], enb, ebs, jnp.where(jnp.arange(extra) < elens[:, None, None],
                                                   eidx, -1))
      kw.update(extra_kv_cache=ecache, extra_indices=eidx, extra_topk_length=elens)
    ref = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
    for impl in ["triton"] + (["mosaic"] if _mosaic.default_for(mosaic.check_supported, q) else []):
      got = sparse_mla_decode(q, cache, idx, implementation=impl, **kw)
      report(f"decode[{impl}] {dt} bs{bs} extra{extra}", got, ref, 1)
  return all(r[-1] for r in rows)


def _prefill_sets(spec: Prefill):
  k = jax.random.split(jax.random.PRNGKey(1), 2)
  kv = (jax.random.normal(k[0], (spec.s_kv, spec.d_qk)) / 10).astype(jnp.bfloat16)
  sink = jax.random.normal(k[1], (spec.h_q,), jnp.float32) if spec.sink else None
  sets = []
  for i in range(PREFILL_SETS):
    kq, ki = jax.random.split(jax.random.PRNGKey(10 + i))
    q = (jax.random.normal(kq, (spec.s_q, spec.h_q, spec.d_qk)) / 10).astype(jnp.bfloat16)
    sets.append((q, kv, jax.random.randint(ki, (spec.s_q, spec.topk), 0, spec.s_kv, jnp.int32),
                 sink))
  flop = 2 * spec.s_q * spec.h_q * spec.topk * (spec.d_qk + 512)
  return sets, flop


def _decode_sets(spec: Decode):
  """Distinct (q, indices, extra indices) sets over one main and one extra cache."""
  d_qk = 576 if spec.dtype == "fp8_ds_mla" else 512
  b, s_q = spec.b, spec.s_q

  def make_cache(kk, bsz, fmt):
    nb = b * spec.seqlen // bsz
    shape = kv_cache_shape(nb, bsz, d_qk, fmt)
    # Random bytes are fine for timing except NaN/huge fp8 codes: build a small
    # quantized block and tile it over the cache.
    x = (jax.random.normal(kk, (1, bsz, d_qk)) / 3).astype(jnp.bfloat16)
    return jnp.broadcast_to(QUANTIZE[fmt](x), shape) + jnp.zeros(shape, jnp.uint8), nb * bsz

  k = jax.random.split(jax.random.PRNGKey(2), 3)
  cache, n = make_cache(k[0], spec.block_size, spec.dtype)
  ecache, en = (make_cache(k[1], spec.extra_block_size, spec.extra_dtype or spec.dtype)
                if spec.extra else (None, 0))
  sink = jax.random.normal(k[2], (spec.h_q,), jnp.float32)
  per_set = b * s_q * (spec.h_q * d_qk * 2 + (spec.topk + (spec.extra or 0)) * 4)
  sets = []
  for i in range(n_sets(per_set)):
    kq, ki, ke = jax.random.split(jax.random.PRNGKey(100 + i), 3)
    q = (jax.random.normal(kq, (b, s_q, spec.h_q, d_qk)) / 3).astype(jnp.bfloat16)
    idx = jax.random.randint(ki, (b, s_q, spec.topk), 0, n, jnp.int32)
    eidx = (jax.random.randint(ke, (b, s_q, spec.extra), 0, en, jnp.int32) if spec.extra
            else None)
    sets.append((q, cache, idx, sink, ecache, eidx))
  flop = 2 * b * s_q * spec.h_q * (spec.topk + (spec.extra or 0)) * (d_qk + 512)
  return sets, flop


def _decode_call(spec: Decode, **kw):
  if spec.extra_dtype is not None:
    kw["extra_kv_cache_dtype"] = spec.extra_dtype
  return lambda q, cache, idx, sink, ecache, eidx: sparse_mla_decode(
      q, cache, idx, kv_cache_dtype=spec.dtype, attn_sink=sink, extra_kv_cache=ecache,
      extra_indices=eidx, **kw)


def _bytes_read(spec: Decode) -> int:
  """Cache bytes a decode call reads: each (token, index) pair's row, once per query."""
  def token_bytes(fmt, bsz):
    d_qk = 576 if fmt == "fp8_ds_mla" else 512
    nb, bs, width = kv_cache_shape(1, bsz, d_qk, fmt)
    return nb * bs * width * jnp.dtype(kv_cache_storage_dtype(fmt)).itemsize // bsz
  per_query = spec.topk * token_bytes(spec.dtype, spec.block_size)
  if spec.extra:
    per_query += spec.extra * token_bytes(spec.extra_dtype or spec.dtype, spec.extra_block_size)
  return spec.b * spec.s_q * per_query


def _prefill_call(spec: Prefill, **kw):
  return lambda q, kv, idx, sink: sparse_mla_prefill(
      q, kv, idx, sm_scale=spec.d_qk ** -0.5, attn_sink=sink, **kw)


def _padded_heads(spec, sets):
  """``sets`` with the queries (and sinks) padded to FlashMLA's 64 heads (zero queries,
  ``-inf`` sinks), and the function that keeps the first ``h_q`` heads of its outputs."""
  pad = flashmla_peer.HEADS - spec.h_q
  if pad <= 0:
    return sets, None
  head_axis = 1 if isinstance(spec, Prefill) else 2
  widths = [(0, 0)] * (head_axis + 2)
  widths[head_axis] = (0, pad)

  def pad_set(q, *rest):
    rest = list(rest)
    sink_at = 2  # (kv, idx, sink) or (cache, idx, sink, extra cache, extra idx)
    if rest[sink_at] is not None:
      rest[sink_at] = jnp.pad(rest[sink_at], (0, pad), constant_values=-jnp.inf)
    return (jnp.pad(q, widths), *rest)

  def keep(outs):
    h = spec.h_q
    if isinstance(spec, Prefill):  # out [s_q, h, d], max_logits and lse [s_q, h]
      return tuple(x[:, :h] for x in outs)
    return outs[0][:, :, :h], outs[1][:, :h]  # out [b, s_q, h, d], lse [b, h, s_q]

  return [pad_set(*s) for s in sets], keep


def side_by_side(fm, name: str, spec, sets, flop: float) -> list[Row]:
  """The public op (its default kernel) and FlashMLA on the same input sets with the
  same timer (benchmarks/flashmla_peer.py), after comparing their outputs, and the same
  FlashMLA calls on our torch bridge. Head counts FlashMLA does not take run padded to
  64 heads on its side (:func:`_padded_heads`); the bridge takes them as they are."""
  peer_sets, keep = _padded_heads(spec, sets)
  if isinstance(spec, Prefill):
    ours = jax.jit(_prefill_call(spec))

    def calls(lib, inputs):
      return [flashmla_peer.sparse_prefill(lib, *s, spec.d_qk ** -0.5) for s in inputs]

    lse_at = 2
  else:
    ours = jax.jit(_decode_call(spec))

    def calls(lib, inputs):  # one schedule for every set: same shapes
      meta = lib.get_mla_metadata()[0]
      return [flashmla_peer.sparse_decode(lib, meta, *s, kv_cache_dtype=spec.dtype)
              for s in inputs]

    lse_at = 1
  theirs, bridged = calls(fm, peer_sets), calls(flashmla_peer.bridge(), sets)
  t = flashmla_peer.compare_and_time(name, ours, theirs, sets, lse_at, keep=keep,
                                     bridged=bridged)
  return flashmla_peer.rows("sparse_mla vs FlashMLA", name, t, lambda us: flop / us / 1e6,
                            "TFLOP/s")


def run(rows=ROWS, *, only_side_by_side: bool = False) -> list[Row]:
  """Each row through the public op, once per GPU kernel that takes it (Triton, and
  Mosaic GPU on Hopper where it takes the row); the timed call is checked against the reference
  first (prefill: on the first 64 tokens; decode: the whole call). Where FlashMLA imports
  (benchmarks/flashmla_peer.py), each row is also timed side by side with it
  (``only_side_by_side``: only that)."""
  dev = device_name()
  fm = flashmla_peer.load()
  if only_side_by_side and fm is None:
    raise RuntimeError("side by side needs FlashMLA: put its built package on PYTHONPATH")
  out = []
  for name, spec in rows.items():
    if isinstance(spec, Prefill):
      sets, flop = _prefill_sets(spec)
      q, kv, idx, sink = sets[0]
      ref = _prefill_call(spec, implementation="xla")(q[:64], kv, idx[:64], sink)
      impls = ["triton"] + (["mosaic"] if _mosaic.default_for(mosaic.check_supported, q) else [])
      calls = [(f"sparse_mla_prefill[{impl}]", _prefill_call(spec, implementation=impl))
               for impl in impls]
      checked_args = (q[:64], kv, idx[:64], sink)
      lse_at = 2
    else:
      sets, flop = _decode_sets(spec)
      impls = ["triton"] + (
          ["mosaic"] if _mosaic.default_for(mosaic.check_supported, sets[0][0]) else [])
      calls = [(f"sparse_mla_decode[{impl}]", _decode_call(spec, implementation=impl))
               for impl in impls]
      checked_args = sets[0]
      lse_at = 1
      try:
        ref = _decode_call(spec, implementation="xla")(*sets[0])
      except Exception as e:  # noqa: BLE001 - the reference is a check here, not the subject
        print(f"{name}: reference failed ({str(e).splitlines()[0][:100]}); not checked")
        ref = None
    for op, fn in [] if only_side_by_side else calls:
      if ref is not None:
        got = fn(*checked_args)
        check_close(f"{op} {name} out", got[0], ref[0])
        check_close(f"{op} {name} lse", got[lse_at], ref[lse_at], tol=1e-3)
      us = time_us(fn, sets, reps=10)
      if spec.anchor is not None:
        out.append(Row(op, name, us, flop / us / 1e6, "TFLOP/s", spec.anchor, "FlashMLA", dev))
      elif isinstance(spec, Decode):  # bytes read per second against copy bandwidth
        out.append(Row(op, name, us, _bytes_read(spec) / us / 1e6, "TB/s", COPY_TB_S,
                       "copy bandwidth", dev))
      else:  # a prefill row whose peer is measured side by side only
        out.append(Row(op, name, us, flop / us / 1e6, "TFLOP/s", None, "", dev))
    if fm is not None and (spec.anchor is not None or name in TP_ROWS or name in SMALL_ROWS):
      out.extend(side_by_side(fm, name, spec, sets, flop))
    del sets
  return out


def sweep(rows, configs) -> list[Row]:
  """The public ops with each ``config`` (a Triton or Mosaic GPU ``Config``) on each row."""
  dev = device_name()
  out = []
  for name, spec in rows.items():
    sets, flop = _prefill_sets(spec) if isinstance(spec, Prefill) else _decode_sets(spec)
    call = _prefill_call if isinstance(spec, Prefill) else _decode_call
    for cfg in configs:
      impl = "mosaic" if isinstance(cfg, mosaic.Config) else "triton"
      fn = call(spec, implementation=impl, config=cfg)
      label = (f"bh{cfg.block_h} bk{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
               if impl == "triton" else
               f"mosaic s{cfg.num_stages} regs {cfg.consumer_registers}/{cfg.producer_registers}")
      try:
        us = time_us(fn, sets, reps=10)
      except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
        msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        print(f"{name:18s} {label:30s} FAILED: {msg}", flush=True)
        continue
      out.append(Row(f"sparse_mla[{impl}] config", f"{name} {label}", us, flop / us / 1e6,
                     "TFLOP/s", spec.anchor, "FlashMLA", dev))
      print(f"{name:18s} {label:30s} {us:9.1f} us {flop / us / 1e6:7.1f} TFLOP/s", flush=True)
    del sets
  return out


def _configs(spec: str, make, names):
  return [make(**dict(zip(names, (int(v) for v in item.split(":")), strict=True)))
          for item in spec.split(",") if item]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--check", action="store_true")
  ap.add_argument("--rows", default=",".join(ROWS))
  ap.add_argument("--triton-configs", default="",
                  help="block_h:block_k:num_warps:num_stages,... (Triton config= sweep)")
  ap.add_argument("--mosaic-configs", default="",
                  help="num_stages:consumer_registers:producer_registers[:producers],... "
                       "(Mosaic GPU)")
  ap.add_argument("--side-by-side", action="store_true",
                  help="only the rows timed beside FlashMLA (benchmarks/flashmla_peer.py)")
  ap.add_argument("--small", action="store_true",
                  help="--check on small shapes (for compute-sanitizer runs)")
  add_l2_fetch_option(ap)
  args = ap.parse_args()
  print(device_name(), jax.__version__, flush=True)
  apply_l2_fetch(args)
  ok = True
  if args.check or args.small:
    ok = check(small=args.small)
  every = {**ROWS, **TP_ROWS, **V41_ROWS, **EXTRA_ROWS, **SMALL_ROWS}
  rows = {r: every[r] for r in args.rows.split(",") if r}
  configs = (_configs(args.triton_configs, triton.Config,
                      ("block_h", "block_k", "num_warps", "num_stages"))
             + _configs(args.mosaic_configs, mosaic.Config,
                        ("num_stages", "consumer_registers", "producer_registers",
                         "producers")[:len(args.mosaic_configs.split(",")[0].split(":"))]))
  if configs:
    print_table(sweep(rows, configs))
  else:
    print_table(run(rows, only_side_by_side=args.side_by_side))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
