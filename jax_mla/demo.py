"""`make demo`: one step of a DeepSeek-V3.2-style sparse attention layer, checked.

The step a serving engine runs for every layer: store the new tokens' latent
vectors in the paged fp8 cache, turn the indexer's top-k choices into cache slots,
then attend (one new token per request, and a prefill chunk). Each step runs the
library's GPU kernel and checks it against an independent computation (plain
numpy on the raw bytes, or the jax.numpy reference), with a stated tolerance and a
PASS/FAIL verdict. The exit status is non-zero if any check fails.

Without a GPU the Triton kernels run in the Pallas interpreter (the same kernel
code, executed step by step on the CPU), on small shapes.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_mla.cache import concat_and_cache_mla, dequantize_fp8_ds_mla, kv_cache_shape
from jax_mla.indexing import convert_req_index_to_global_index
from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill
from jax_mla.testing import rel_err

NOPE, ROPE = 512, 64  # latent: 512 compressed key/value values + 64 rotary-position values
ROW_BYTES = 656  # one token in the fp8_ds_mla cache
SM_SCALE = 192**-0.5  # DeepSeek's scale: the query-key head before absorption is 128 + 64 wide


class Checks:
  """Prints one line per check with its value, tolerance and verdict; remembers failures."""

  def __init__(self):
    self.step = ""
    self.failed = []

  def __call__(self, what: str, value: float, tol: float) -> None:
    ok = bool(value <= tol)  # NaN fails
    print(f"      {'PASS' if ok else 'FAIL'}  {what}: {value:.3g} (tolerance {tol:g})")
    if not ok:
      self.failed.append(f"[{self.step}] {what}")


def decode_rows_numpy(cache_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Reads fp8_ds_mla rows by hand: ``(latent float64 [..., 576], tile scales [..., 4])``.

  Bytes 0-511: the 512 compressed values as fp8 (e4m3), each divided by the scale of
  its group of 128; bytes 512-527: those 4 scales as float32; bytes 528-655: the 64
  rotary values as bf16, stored as they are.
  """
  fp8 = cache_bytes[..., :NOPE].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  scales = np.ascontiguousarray(cache_bytes[..., NOPE:NOPE + 16]).view("<f4").astype(np.float64)
  rope = np.ascontiguousarray(cache_bytes[..., NOPE + 16:]).view(ml_dtypes.bfloat16)
  nope = fp8 * np.repeat(scales, NOPE // 4, axis=-1)
  return np.concatenate([nope, rope.astype(np.float64)], axis=-1), scales


def attention_numpy(q: np.ndarray, rows: np.ndarray, slots: np.ndarray):
  """Dense float64 attention of each query ``q[t, h, 576]`` over its own ``rows[slots[t]]``;
  slots < 0 are padding. Returns ``(out [t, h, 512], lse [t, h])`` (natural log)."""
  out = np.zeros(q.shape[:2] + (NOPE,))
  lse = np.full(q.shape[:2], np.inf)
  for t in range(q.shape[0]):
    keys = rows[slots[t][slots[t] >= 0]]  # [k, 576]; values are the first 512 columns
    if len(keys) == 0:
      continue
    s = SM_SCALE * q[t] @ keys.T  # [h, k]
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    lse[t] = m[:, 0] + np.log(p.sum(axis=1))
    out[t] = (p / p.sum(axis=1, keepdims=True)) @ keys[:, :NOPE]
  return out, lse


def main() -> int:
  t_start = time.perf_counter()
  on_gpu = jax.default_backend() == "gpu"
  if on_gpu:
    kernel = {}  # the library's own choice on this GPU
    kernel_name = "the default GPU kernel"
    heads, topk, seq_lens, chunk = 128, 2048, [3000, 2500, 4096, 1800], 64
  else:
    kernel = dict(implementation="triton", interpret=True)
    kernel_name = "the Triton kernel, run in the Pallas interpreter"
    heads, topk, seq_lens, chunk = 16, 64, [150, 90, 200, 33], 16
  reference = dict(implementation="xla")
  check = Checks()
  rng = np.random.default_rng(0)

  seq_lens = np.array(seq_lens)
  num_reqs, block_size = len(seq_lens), 64
  blocks_per_req = -(-seq_lens.max() // block_size)
  num_blocks = num_reqs * blocks_per_req + 3  # a few blocks no request owns
  device = jax.devices()[0].device_kind
  print(f"jax-mla demo on {device if on_gpu else 'the CPU'}: each step runs {kernel_name}.")
  print(f"{num_reqs} requests with {', '.join(map(str, seq_lens))} tokens of context, {heads} "
        f"query heads.\nEach query token attends to up to {topk} earlier tokens, chosen by the "
        "model's indexer (DeepSeek V3.2's sparse attention).\n")

  # ---- 1. Cache write.
  check.step = "1/4"
  print("[1/4] Store every token's latent in the paged cache (concat_and_cache_mla, "
        "format fp8_ds_mla)")
  print("      A token's latent is 512 compressed key/value numbers plus 64 rotary numbers.\n"
        f"      The cache keeps it in {ROW_BYTES} bytes: the 512 as 8-bit floats with one "
        "float32 scale per\n      group of 128, the 64 as bf16. Tokens live in blocks of "
        f"{block_size}; each request owns blocks\n      scattered over the cache (its block "
        "table). Unwritten slots are filled with NaN on\n      purpose: they must never reach "
        "an output.")
  block_table = rng.permutation(num_blocks)[:num_reqs * blocks_per_req].reshape(
      num_reqs, blocks_per_req).astype(np.int32)
  req_of_token = np.repeat(np.arange(num_reqs), seq_lens)
  pos_of_token = np.concatenate([np.arange(n) for n in seq_lens])
  slot_mapping = (block_table[req_of_token, pos_of_token // block_size] * block_size
                  + pos_of_token % block_size).astype(np.int32)
  tokens = len(slot_mapping)
  kv_c = jnp.asarray(rng.normal(size=(tokens, NOPE)), jnp.bfloat16)
  k_pe = jnp.asarray(rng.normal(size=(tokens, ROPE)), jnp.bfloat16)
  empty = np.full(kv_cache_shape(num_blocks, block_size, 576, "fp8_ds_mla"), 0xFF, np.uint8)

  def write(impl):  # a fresh copy of the empty cache each time: the writer updates in place
    return np.asarray(concat_and_cache_mla(kv_c, k_pe, jnp.asarray(empty),
                                           jnp.asarray(slot_mapping),
                                           kv_cache_dtype="fp8_ds_mla", **impl))

  cache = write(kernel)
  ref_cache = write(reference)
  print(f"      {tokens} tokens written into a cache of {num_blocks} blocks.")
  check("bytes that differ from the jax.numpy reference writer",
        int((cache != ref_cache).sum()), 0)
  rows, scales = decode_rows_numpy(cache.reshape(-1, ROW_BYTES)[slot_mapping])
  x = np.concatenate([np.asarray(kv_c, np.float64), np.asarray(k_pe, np.float64)], axis=1)
  # Rounding to fp8 (3 mantissa bits) moves a value by at most 1/16 of itself, or by
  # 2**-10 of its group's scale for the smallest values.
  bound = np.abs(x[:, :NOPE]) / 16 + np.repeat(scales, NOPE // 4, axis=1) * 2**-10
  check("worst fp8 rounding, read back by hand with numpy, as a fraction of the allowed bound",
        float(np.max(np.abs(rows[:, :NOPE] - x[:, :NOPE]) / bound)), 1.0)
  check("rotary values not read back exactly (count)",
        int((rows[:, NOPE:] != x[:, NOPE:]).sum()), 0)
  cache = jnp.asarray(cache)

  # ---- 2. Top-k -> global slots.
  check.step = "2/4"
  print("\n[2/4] Turn the indexer's choices into cache slots "
        "(convert_req_index_to_global_index)")
  print("      The indexer names earlier tokens by position in their request (-1 where a "
        f"short request has\n      fewer than {topk}). Attention reads the cache by slot "
        f"number: block_table[request, position // {block_size}]\n      * {block_size} + "
        f"position % {block_size}. Queries: one new token per request (decode), and the last "
        f"{chunk} tokens of\n      request {int(np.argmax(seq_lens))} (a prefill chunk).")
  longest = int(np.argmax(seq_lens))
  q_req = np.concatenate([np.arange(num_reqs), np.full(chunk, longest)])
  q_pos = np.concatenate([seq_lens - 1, seq_lens[longest] - chunk + np.arange(chunk)])
  local = np.full((len(q_req), topk), -1, np.int32)
  for i, p in enumerate(q_pos):
    k = min(topk, p + 1)  # causal: only tokens up to the query's own position
    local[i, :k] = rng.choice(p + 1, k, replace=False)
  slots = np.asarray(convert_req_index_to_global_index(
      jnp.asarray(q_req, jnp.int32), jnp.asarray(block_table), jnp.asarray(local),
      block_size=block_size, **kernel))
  by_hand = np.where(local >= 0, block_table[q_req[:, None], np.maximum(local, 0) // block_size]
                     * block_size + local % block_size, -1)
  print(f"      {len(q_req)} query tokens x {topk} choices, {(local < 0).sum()} of them padding.")
  check("slots that differ from the formula computed in numpy", int((slots != by_hand).sum()), 0)

  # ---- 3. Sparse decode.
  check.step = "3/4"
  print("\n[3/4] Decode: each request's new token attends to its chosen tokens, read "
        "straight from the\n      fp8 cache (sparse_mla_decode)")
  print("      The kernel gathers the chosen slots, turns the 8-bit numbers back into "
        "bf16 on the fly and\n      runs one softmax over them for all heads at once "
        "(the heads share the one latent).")
  q = jnp.asarray(rng.normal(size=(num_reqs, 1, heads, 576)), jnp.bfloat16)
  idx = jnp.asarray(slots[:num_reqs, None, :])
  out, lse = sparse_mla_decode(q, cache, idx, kv_cache_dtype="fp8_ds_mla", sm_scale=SM_SCALE,
                               **kernel)
  ref_out, ref_lse = sparse_mla_decode(q, cache, idx, kv_cache_dtype="fp8_ds_mla",
                                       sm_scale=SM_SCALE, **reference)
  # The format rounds each dequantized value to bf16 (float32 product, then bf16).
  all_rows, _ = decode_rows_numpy(np.asarray(cache).reshape(-1, ROW_BYTES))
  all_rows = all_rows.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
  np_out, np_lse = attention_numpy(np.asarray(q[:, 0], np.float64), all_rows, slots[:num_reqs])
  print(f"      output {tuple(out.shape)} (bf16), log-sum-exp {tuple(lse.shape)} (float32)")
  check("output, relative error vs float64 numpy attention", rel_err(out[:, 0], np_out), 1e-2)
  check("log-sum-exp, relative error vs numpy", rel_err(lse[:, :, 0], np_lse), 1e-4)
  check("output, relative error vs the jax.numpy reference", rel_err(out, ref_out), 1e-2)
  check("log-sum-exp, relative error vs the jax.numpy reference", rel_err(lse, ref_lse), 1e-4)
  check("NaN or inf in the output (unwritten slots leaking in)",
        int((~np.isfinite(np.asarray(out, np.float32))).sum()), 0)

  # ---- 4. Sparse prefill.
  check.step = "4/4"
  print(f"\n[4/4] Prefill: {chunk} new tokens of one request, each attending to its own "
        "chosen tokens\n      (sparse_mla_prefill)")
  print("      Prefill works on bf16 rows, so the cache is first turned back into bf16 "
        "(dequantize_fp8_ds_mla);\n      the same slot numbers then index the rows.")
  kv = dequantize_fp8_ds_mla(cache).reshape(-1, 576)
  qp = jnp.asarray(rng.normal(size=(chunk, heads, 576)), jnp.bfloat16)
  pidx = jnp.asarray(slots[num_reqs:])
  pout, _, plse = sparse_mla_prefill(qp, kv, pidx, sm_scale=SM_SCALE, **kernel)
  rout, _, rlse = sparse_mla_prefill(qp, kv, pidx, sm_scale=SM_SCALE, **reference)
  np_out, np_lse = attention_numpy(np.asarray(qp, np.float64), all_rows, slots[num_reqs:])
  print(f"      output {tuple(pout.shape)} (bf16), log-sum-exp {tuple(plse.shape)} (float32)")
  check("output, relative error vs float64 numpy attention", rel_err(pout, np_out), 1e-2)
  check("log-sum-exp, relative error vs numpy", rel_err(plse, np_lse), 1e-4)
  check("output, relative error vs the jax.numpy reference", rel_err(pout, rout), 1e-2)
  check("log-sum-exp, relative error vs the jax.numpy reference", rel_err(plse, rlse), 1e-4)

  took = time.perf_counter() - t_start
  if check.failed:
    print(f"\nFAILED ({took:.0f} s): " + "; ".join(check.failed))
    return 1
  print(f"\nAll checks passed ({took:.0f} s). Next: `make test` (the full suite), "
        "docs/api.md (every op).")
  return 0


if __name__ == "__main__":
  sys.exit(main())
