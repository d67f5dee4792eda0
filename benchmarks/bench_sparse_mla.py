"""Sparse MLA on the GPU: correctness against the reference, then timing of the BENCHMARKS.md rows.

  PYTHONPATH=$PWD python3 benchmarks/bench_sparse_mla.py [--check] [--bench ROWS] [--sweep]

FLOPs follow FlashMLA: ``2 * tokens * h_q * (topk [+ extra_topk]) * (d_qk + d_v)``.
Timing: the jitted call dispatched ``n`` times back to back, then one
``block_until_ready``; median over 5 such batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.cache.formats import kv_cache_shape, quantize_fp8_ds_mla, quantize_fp8_model1_cache
from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill
from jax_mla.sparse_mla.decode_pallas import sparse_mla_decode_pallas
from jax_mla.sparse_mla.prefill_pallas import KernelConfig, sparse_mla_prefill_pallas

ANCHORS = {  # FlashMLA on H100 (BENCHMARKS.md), TFLOP/s
    "prefill_v32": 623, "prefill_v32_131k": 546, "prefill_v4_h128": 571, "prefill_v4_h64": 458,
    "decode_ds_b128": 395, "decode_ds_b128_1g": 395, "decode_ds_b64": 387,
    "decode_m1_h128": 375, "decode_m1_h64": 229,
}


def rel_err(out, ref) -> float:
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  if np.isnan(out).any():
    return float("inf")
  fin = np.isfinite(ref)
  if not np.array_equal(np.isfinite(out), fin) or not np.array_equal(out[~fin], ref[~fin]):
    return float("inf")
  return float(np.linalg.norm((out - ref)[fin]) / max(np.linalg.norm(ref[fin]), 1e-30))


def time_call(fn, *args, target_s=0.15):
  out = fn(*args)
  jax.block_until_ready(out)
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = time.perf_counter() - t
  n = max(2, min(200, int(target_s / max(once, 1e-6))))
  samples = []
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(n):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t) / n)
  return statistics.median(samples)


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


def check(results, small=False):
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
    got = sparse_mla_prefill(q, kv, idx, implementation="pallas", **kw)
    ref = sparse_mla_prefill(q, kv, idx, implementation="xla", **kw)
    report(f"prefill d{d_qk} h{h_q} topk{topk}", got, ref, 2)
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
    got = sparse_mla_decode(q, cache, idx, implementation="pallas", **kw)
    ref = sparse_mla_decode(q, cache, idx, implementation="xla", **kw)
    report(f"decode {dt} bs{bs} extra{extra}", got, ref, 1)
  results["check"] = rows
  return all(r[-1] for r in rows)


def prefill_row(name, s_q, h_q, topk, d_qk, s_kv, sink, configs, results):
  k = jax.random.split(jax.random.PRNGKey(1), 4)
  q = (jax.random.normal(k[0], (s_q, h_q, d_qk)) / 10).astype(jnp.bfloat16)
  kv = (jax.random.normal(k[1], (s_kv, d_qk)) / 10).astype(jnp.bfloat16)
  idx = jax.random.randint(k[2], (s_q, topk), 0, s_kv, jnp.int32)
  attn_sink = jax.random.normal(k[3], (h_q,), jnp.float32) if sink else None
  flop = 2 * s_q * h_q * topk * (d_qk + 512)
  n = 64  # kernel vs reference on the first tokens of the timed inputs
  got = sparse_mla_prefill(q[:n], kv, idx[:n], sm_scale=d_qk ** -0.5, attn_sink=attn_sink)
  ref = sparse_mla_prefill(q[:n], kv, idx[:n], sm_scale=d_qk ** -0.5, attn_sink=attn_sink,
                           implementation="xla")
  print(f"{name}: out err {rel_err(got[0], ref[0]):.2e} lse err {rel_err(got[2], ref[2]):.2e}")
  for cfg in configs:
    fn = jax.jit(lambda q, kv, idx, s, cfg=cfg: sparse_mla_prefill_pallas(
        q, kv, idx, s, None, sm_scale=d_qk ** -0.5, d_v=512, config=cfg))
    _record(results, name, cfg, fn, (q, kv, idx, attn_sink), flop)


def decode_row(name, dt, b, s_q, h_q, topk, bs, extra, ebs, seqlen, configs, results):
  d_qk = 576 if dt == "fp8_ds_mla" else 512
  k = jax.random.split(jax.random.PRNGKey(2), 6)

  def make_cache(kk, bsz, slots_per_batch):
    nb = b * slots_per_batch // bsz
    shape = kv_cache_shape(nb, bsz, d_qk, dt)
    # Random bytes are fine for timing except NaN/huge fp8 codes: build a small
    # quantized block and tile it over the cache.
    x = (jax.random.normal(kk, (1, bsz, d_qk)) / 3).astype(jnp.bfloat16)
    blk = quantize_fp8_ds_mla(x) if dt == "fp8_ds_mla" else quantize_fp8_model1_cache(x)
    return jnp.broadcast_to(blk, shape) + jnp.zeros(shape, jnp.uint8), nb * bsz

  q = (jax.random.normal(k[0], (b, s_q, h_q, d_qk)) / 3).astype(jnp.bfloat16)
  cache, n = make_cache(k[1], bs, seqlen)
  idx = jax.random.randint(k[2], (b * s_q, topk), 0, n, jnp.int32)
  sets = [(cache, idx, jnp.full((b * s_q,), topk, jnp.int32))]
  total_topk = topk
  if extra:
    ecache, en = make_cache(k[3], ebs, seqlen)
    eidx = jax.random.randint(k[4], (b * s_q, extra), 0, en, jnp.int32)
    sets.append((ecache, eidx, jnp.full((b * s_q,), extra, jnp.int32)))
    total_topk += extra
  sink = jax.random.normal(k[5], (h_q,), jnp.float32)
  flop = 2 * b * s_q * h_q * total_topk * (d_qk + 512)
  qf = q.reshape(b * s_q, h_q, d_qk)
  extra_kw = {}
  if extra:
    extra_kw = dict(extra_kv_cache=ecache, extra_indices=eidx.reshape(b, s_q, extra))
  got = sparse_mla_decode(q, cache, idx.reshape(b, s_q, topk), kv_cache_dtype=dt,
                          attn_sink=sink, **extra_kw)
  try:
    ref = sparse_mla_decode(q, cache, idx.reshape(b, s_q, topk), kv_cache_dtype=dt,
                            attn_sink=sink, implementation="xla", **extra_kw)
    errs = f"out err {rel_err(got[0], ref[0]):.2e} lse err {rel_err(got[1], ref[1]):.2e}"
  except Exception as e:  # noqa: BLE001 - the reference is a check here, not the subject
    errs = f"reference failed: {str(e).splitlines()[0][:100]}"
  print(f"{name}: cache {cache.nbytes / 2**30:.2f} GiB, {errs}", flush=True)
  for cfg in configs:
    fn = jax.jit(lambda qf, sets, s, cfg=cfg: sparse_mla_decode_pallas(
        qf, sets, s, kv_cache_dtype=dt, sm_scale=d_qk ** -0.5, d_v=512, config=cfg))
    _record(results, name, cfg, fn, (qf, sets, sink), flop)


def _record(results, name, cfg, fn, args, flop):
  label = f"bh{cfg.block_h} bk{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
  try:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    sec = time_call(fn, *args)
  except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
    msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    print(f"{name:18s} {label:22s} FAILED: {msg}", flush=True)
    return
  tflops = flop / sec / 1e12
  anchor = ANCHORS.get(name)
  results.setdefault("bench", []).append((name, label, sec * 1e6, tflops, anchor))
  print(f"{name:18s} {label:22s} {sec * 1e6:9.1f} us {tflops:7.1f} TFLOP/s "
        f"(FlashMLA {anchor}, {tflops / anchor:.2f}x) compile {compile_s:.1f}s", flush=True)


def _configs(spec: str):
  out = []
  for item in spec.split(","):
    bh, bk, w, s = (int(v) for v in item.split(":"))
    out.append(KernelConfig(block_h=bh, block_k=bk, num_warps=w, num_stages=s))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--check", action="store_true")
  ap.add_argument("--rows", default="prefill_v32,decode_ds_b128")
  ap.add_argument("--prefill-configs", default="64:64:8:3",
                  help="block_h:block_k:num_warps:num_stages,...")
  ap.add_argument("--decode-configs", default="64:64:8:2")
  ap.add_argument("--small", action="store_true",
                  help="--check on small shapes (for compute-sanitizer runs)")
  args = ap.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  results = {}
  ok = True
  if args.check or args.small:
    ok = check(results, small=args.small)
  pc, dc = _configs(args.prefill_configs), _configs(args.decode_configs)
  rows = [r for r in args.rows.split(",") if r]
  prefill_rows = {
      "prefill_v32": (4096, 128, 2048, 576, 32768, True),
      "prefill_v32_131k": (4096, 128, 2048, 576, 131072, True),
      "prefill_v4_h128": (4096, 128, 1024, 512, 32768, False),
      "prefill_v4_h64": (4096, 64, 512, 512, 32768, False),
  }
  decode_rows = {  # dt, b, s_q, h_q, topk, block, extra, extra_block, seqlen per batch
      "decode_ds_b128": ("fp8_ds_mla", 128, 2, 128, 2048, 64, None, None, 32768),
      "decode_ds_b64": ("fp8_ds_mla", 64, 2, 128, 2048, 64, None, None, 32768),
      "decode_ds_b128_1g": ("fp8_ds_mla", 128, 2, 128, 2048, 64, None, None, 16384),
      "decode_m1_h128": ("fp8_model1", 256, 2, 128, 128, 256, 1024, 64, 8192),
      "decode_m1_h64": ("fp8_model1", 256, 2, 64, 128, 256, 512, 64, 8192),
  }
  for r in rows:
    if r in prefill_rows:
      prefill_row(r, *prefill_rows[r], pc, results)
    else:
      decode_row(r, *decode_rows[r], dc, results)
  print("\nsummary (best config per row):")
  best = {}
  for name, label, us, tf, anchor in results.get("bench", []):
    if name not in best or tf > best[name][2]:
      best[name] = (label, us, tf, anchor)
  for name, (label, us, tf, anchor) in best.items():
    print(f"  {name:18s} {label:22s} {us:9.1f} us {tf:7.1f} TFLOP/s  FlashMLA {anchor}  "
          f"ratio {tf / anchor:.2f}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
