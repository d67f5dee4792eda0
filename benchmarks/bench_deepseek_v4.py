"""DeepSeek V4 attention layer (``jax_mla.backends.deepseek_v4``) on the GPU.

  PYTHONPATH=$PWD python3 -m benchmarks.bench_deepseek_v4 [--rows NAME,...]

Times the layer path (index helpers + workspace gathers + sparse-MLA kernels) on
the V4 rows of the FlashMLA anchors (benchmarks/RESULTS.md, "Anchors"; the anchor
figures below are its 2026-11-22 edition), and the bare sparse-MLA kernel call on the
same indices, so the layer's overhead shows. Metadata is built once on the host
(vLLM shares it across layers) and not timed.

FLOPs follow FlashMLA: ``2 * tokens * h_q * keys * (d_qk + d_v)`` with ``keys`` the
window plus the compressed top-k each token attends to.

Rows:
* ``decode_m1_h128``: 256 requests x 2 decode tokens (MTP), h_q 128, window 128
  (SWA blocks of 64) + ratio-4 top-k 1024 (compressed blocks of 64), context 8192.
  Anchor: FlashMLA fp8_model1 decode, topk 128 + extra 1024, 375 TFLOP/s.
* ``decode_m1_h64``: the same with h_q 64, top-k 512. Anchor 229 TFLOP/s.
* ``prefill_v4_h128``: one request of 4096 new tokens after 28672 cached, h_q 128,
  window 128 + ratio-4 top-k 896 (1024 keys per token). Anchor: FlashMLA V4 sparse
  prefill, topk 1024, 571 TFLOP/s (the kernel alone, no gathers).
* ``prefill_v4_h64``: h_q 64, window 128 + top-k 384 (512 keys). Anchor 458 TFLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Row, device_name, print_table, time_us
from jax_mla.backends import deepseek_v4 as v4
from jax_mla.backends import deepseek_v4_indices as idx
from jax_mla.backends import split_decodes_and_prefills
from jax_mla.cache import quantize_fp8_model1_cache
from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  decode: bool
  num_reqs: int
  query_len: int
  context: int  # cached tokens before the new ones
  num_heads: int
  index_topk: int
  anchor: float
  window: int = 128
  ratio: int = 4


CASES = [
    Case("decode_m1_h128", True, 256, 2, 8190, 128, 1024, 375.0),
    Case("decode_m1_h64", True, 256, 2, 8190, 64, 512, 229.0),
    Case("prefill_v4_h128", False, 1, 4096, 28672, 128, 896, 571.0),
    Case("prefill_v4_h64", False, 1, 4096, 28672, 64, 384, 458.0),
]


def _random_cache(key, num_blocks, block_size):
  x = jax.random.normal(key, (num_blocks, block_size, 512), jnp.bfloat16)
  return quantize_fp8_model1_cache(x)


def _block_table(rng, num_reqs, first_block, last_block, width):
  """Distinct physical blocks for block columns [first, last]; the rest point at block 0."""
  per = last_block - first_block + 1
  bt = np.zeros((num_reqs, width), np.int32)
  bt[:, first_block:last_block + 1] = (rng.permutation(num_reqs * per) + 1).reshape(num_reqs, per)
  return bt, num_reqs * per + 1


def build(case: Case, num_sets: int):
  rng = np.random.default_rng(0)
  key = jax.random.PRNGKey(0)
  seq = case.context + case.query_len
  cfg = v4.DeepseekV4Config(
      num_heads=case.num_heads, window_size=case.window, compress_ratio=case.ratio,
      max_model_len=seq, index_topk=case.index_topk, block_size=256, swa_block_size=64,
      prefill_chunk_size=4)
  r, t = case.num_reqs, case.num_reqs * case.query_len
  qsl = np.arange(r + 1, dtype=np.int32) * case.query_len
  seq_lens = np.full((r,), seq, np.int32)
  first_pos = max(0, case.context - case.window + 1)
  swa_bt, swa_nb = _block_table(rng, r, first_pos // 64, (seq - 1) // 64, -(-seq // 64))
  ncomp = seq // case.ratio
  cbs = cfg.compressed_block_size
  cbt, cnb = _block_table(rng, r, 0, (ncomp - 1) // cbs, -(-ncomp // cbs))
  k1, k2, k3, k4 = jax.random.split(key, 4)
  swa_cache = _random_cache(k1, swa_nb, 64)
  comp_cache = _random_cache(k2, cnb, cbs)
  pos = np.repeat(seq_lens - case.query_len, case.query_len) + np.tile(
      np.arange(case.query_len), r)
  slot_mapping = (swa_bt[np.repeat(np.arange(r), case.query_len), pos // 64] * 64
                  + pos % 64).astype(np.int32)
  # Indexer output: top-k distinct entries among those visible to every token.
  n_visible = int((pos.min() + 1) // case.ratio)
  topk = jnp.argsort(jax.random.uniform(k3, (t, n_visible)), axis=1)[:, :case.index_topk]
  topk = topk.astype(jnp.int32)
  sink = jax.random.normal(k4, (case.num_heads,), jnp.float32)
  counts = split_decodes_and_prefills(qsl, decode_threshold=2 if case.decode else 1)
  md = v4.build_deepseek_v4_metadata(
      cfg, qsl, jnp.asarray(seq_lens), jnp.asarray(slot_mapping), jnp.asarray(swa_bt),
      jnp.asarray(cbt), num_decodes=counts[0], num_decode_tokens=counts[2])
  qs = [jax.random.normal(jax.random.PRNGKey(10 + i), (t, case.num_heads, 512), jnp.bfloat16)
        for i in range(num_sets)]
  return cfg, md, qs, topk, swa_cache, comp_cache, sink


def run_case(case: Case) -> list[Row]:
  num_sets = 8 if case.decode else 2
  cfg, md, qs, topk, swa_cache, comp_cache, sink = build(case, num_sets)
  keys = case.window + case.index_topk
  tokens = qs[0].shape[0]
  flops = 2 * tokens * case.num_heads * keys * (512 + 512)
  dev = device_name()
  rows = []
  layer = v4.deepseek_v4_sparse_decode if case.decode else v4.deepseek_v4_sparse_prefill
  fn = lambda q, tk, s, c, m, k: layer(q, s, c, m, k, tk, config=cfg)
  us = time_us(fn, [(q, topk, swa_cache, comp_cache, md, sink) for q in qs], reps=10)
  rows.append(Row("deepseek_v4 layer", case.name, us, flops / us / 1e6, "TFLOP/s",
                  case.anchor, "FlashMLA", dev))

  # The bare sparse-MLA call on the indices the layer builds.
  if case.decode:
    g, glen = idx.compute_global_topk_indices_and_lens(
        topk, md.token_to_req_indices, md.block_table, md.is_valid_token,
        block_size=cfg.compressed_block_size)
    kern = lambda q: sparse_mla_decode(
        q[:, None], swa_cache, md.decode_swa_indices[:, None], kv_cache_dtype="fp8_model1",
        sm_scale=cfg.sm_scale, attn_sink=sink, topk_length=md.decode_swa_lens,
        extra_kv_cache=comp_cache, extra_indices=g[:, None], extra_topk_length=glen)[0]
  else:
    n, cap = cfg.max_compressed, md.prefill_chunk_capacity
    m = n + cfg.window_size - 1 + cap
    ws = jnp.zeros((1, m, 512), jnp.bfloat16)
    ws = idx.dequantize_and_gather_k_cache(ws, comp_cache, md.prefill_seq_lens // 4, None,
                                           md.block_table, offset=0, capacity=n)
    ws = idx.dequantize_and_gather_k_cache(ws, swa_cache, md.prefill_seq_lens,
                                           md.prefill_gather_lens, md.swa_block_table,
                                           offset=n, capacity=m - n)
    ind, lens = idx.combine_topk_swa_indices(
        topk, md.query_start_loc, md.prefill_seq_lens, md.prefill_gather_lens,
        window_size=cfg.window_size, compress_ratio=4, topk=cfg.topk, M=m, N=n)
    kern = lambda q: sparse_mla_prefill(q, ws[0], ind, sm_scale=cfg.sm_scale, attn_sink=sink,
                                        topk_length=lens)[0]
  us = time_us(kern, [(q,) for q in qs], reps=10)
  rows.append(Row("sparse_mla kernel (same indices)", case.name, us, flops / us / 1e6,
                  "TFLOP/s", case.anchor, "FlashMLA", dev))
  return rows


def run(cases=CASES) -> list[Row]:
  """Layer and bare-kernel rows of every case (a failing case is reported and skipped)."""
  rows = []
  for case in cases:
    try:
      rows += run_case(case)
      print(f"{case.name}: {rows[-2].time_us:.1f} us layer, {rows[-1].time_us:.1f} us kernel",
            flush=True)
    except Exception as e:  # report and go on with the other rows
      print(f"{case.name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", default=",".join(c.name for c in CASES))
  args = ap.parse_args()
  print_table(run([c for c in CASES if c.name in args.rows.split(",")]))
  print(f"device: {device_name()}")


if __name__ == "__main__":
  main()
