"""`make demo`: one DeepSeek-V3.2-style sparse MLA layer step, end to end.

Writes new tokens into an ``fp8_ds_mla`` paged cache, converts an indexer's
request-local top-k into global cache slots, then runs sparse decode (fp8 cache)
and sparse prefill (bf16 latents). Each step runs the default implementation
(Pallas on GPU, the jax.numpy reference elsewhere) and is checked against the
reference; on a machine without a GPU the Pallas kernels are also run in the
interpreter on the same inputs, so the kernel code is exercised there too.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla._common import default_backend_is_gpu
from jax_mla.cache import concat_and_cache_mla, kv_cache_shape
from jax_mla.indexing import convert_req_index_to_global_index
from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill
from jax_mla.testing import rel_err

D_NOPE, D_ROPE = 512, 64


def _timed(fn, *args, reps=5):
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    out = jax.block_until_ready(fn(*args))
  return out, 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
  gpu = default_backend_is_gpu()
  # A GPU gets DeepSeek-sized heads and top-k; the CPU a small, quick step.
  heads, topk, block_size = (128, 2048, 64) if gpu else (16, 64, 64)
  seq_lens = np.array([3000, 2500, 4096, 1800] if gpu else [150, 90, 200, 33], np.int32)
  rng = np.random.default_rng(0)
  num_reqs = len(seq_lens)
  blocks_per_req = -(-seq_lens.max() // block_size)
  num_blocks = int(num_reqs * blocks_per_req + 3)
  print(f"device: {jax.devices()[0].device_kind}  default path: {'pallas' if gpu else 'xla'}")
  print(f"requests {num_reqs}, seq_lens {seq_lens.tolist()}, heads {heads}, topk {topk}, "
        f"block {block_size}, "
        f"cache fp8_ds_mla {kv_cache_shape(num_blocks, block_size, 576, 'fp8_ds_mla')}")

  # 1. Write every request's latents into the paged fp8_ds_mla cache.
  block_table = rng.permutation(num_blocks)[:num_reqs * blocks_per_req].reshape(
      num_reqs, blocks_per_req).astype(np.int32)
  slots = np.concatenate([block_table[r, np.arange(n) // block_size] * block_size
                          + np.arange(n) % block_size for r, n in enumerate(seq_lens)])
  tokens = int(seq_lens.sum())
  kv_c = jnp.asarray(rng.normal(size=(tokens, D_NOPE)), jnp.bfloat16)
  k_pe = jnp.asarray(rng.normal(size=(tokens, D_ROPE)), jnp.bfloat16)
  cache = jnp.zeros(kv_cache_shape(num_blocks, block_size, 576, "fp8_ds_mla"), jnp.uint8)
  write = jax.jit(lambda c, a, b, s: concat_and_cache_mla(a, b, c, s, kv_cache_dtype="fp8_ds_mla"))
  cache, ms = _timed(write, cache, kv_c, k_pe, jnp.asarray(slots, jnp.int32), reps=1)
  ref_cache = concat_and_cache_mla(kv_c, k_pe, jnp.zeros_like(cache), jnp.asarray(slots, jnp.int32),
                                   kv_cache_dtype="fp8_ds_mla", implementation="xla")
  same = bool(jnp.array_equal(cache, ref_cache))
  print(f"[1] concat_and_cache_mla fp8_ds_mla: {tokens} tokens, {ms:.2f} ms, "
        f"byte-exact vs reference: {same}")

  # 2. The indexer's top-k (request-local positions, -1 padded) -> global slots.
  req_id = jnp.arange(num_reqs, dtype=jnp.int32)
  local = np.full((num_reqs, topk), -1, np.int32)
  for r, n in enumerate(seq_lens):
    k = min(topk, n)
    local[r, :k] = rng.choice(n, k, replace=False)
  convert = jax.jit(lambda a, b, c: convert_req_index_to_global_index(a, b, c,
                                                                      block_size=block_size))
  global_idx, ms = _timed(convert, req_id, jnp.asarray(block_table), jnp.asarray(local))
  ref_idx = convert_req_index_to_global_index(req_id, jnp.asarray(block_table), jnp.asarray(local),
                                              block_size=block_size, implementation="xla")
  print(f"[2] convert_req_index_to_global_index: {local.shape}, {ms:.3f} ms, "
        f"exact vs reference: {bool(jnp.array_equal(global_idx, ref_idx))}")

  # 3. Sparse decode on the fp8 cache: one new query token per request.
  q = jnp.asarray(rng.normal(size=(num_reqs, 1, heads, 576)), jnp.bfloat16)
  idx = global_idx[:, None, :]
  decode = jax.jit(lambda q, c, i: sparse_mla_decode(q, c, i, kv_cache_dtype="fp8_ds_mla"))
  (out, lse), ms = _timed(decode, q, cache, idx)
  ref_out, ref_lse = sparse_mla_decode(q, cache, idx, kv_cache_dtype="fp8_ds_mla",
                                       implementation="xla")
  print(f"[3] sparse_mla_decode fp8_ds_mla: out {out.shape}, {ms:.3f} ms, "
        f"rel err out {rel_err(out, ref_out):.2e}, lse {rel_err(lse, ref_lse):.2e}")

  # 4. Sparse prefill: the last request's tokens attend to their own top-k (causal).
  r = int(np.argmax(seq_lens))
  n = int(seq_lens[r])
  start = int(seq_lens[:r].sum())
  kv = jnp.concatenate([kv_c[start:start + n], k_pe[start:start + n]], axis=-1)
  s_q = min(n, 256 if gpu else 16)
  pos = np.arange(n - s_q, n)
  pidx = np.full((s_q, topk), -1, np.int32)
  for i, p in enumerate(pos):
    k = min(topk, p + 1)
    pidx[i, :k] = rng.choice(p + 1, k, replace=False)
  qp = jnp.asarray(rng.normal(size=(s_q, heads, 576)), jnp.bfloat16)
  prefill = jax.jit(lambda q, kv, i: sparse_mla_prefill(q, kv, i, sm_scale=576**-0.5))
  (pout, _, plse), ms = _timed(prefill, qp, kv, jnp.asarray(pidx))
  rout, _, rlse = sparse_mla_prefill(qp, kv, jnp.asarray(pidx), sm_scale=576**-0.5,
                                     implementation="xla")
  print(f"[4] sparse_mla_prefill bf16: {s_q} queries x topk {topk}, {ms:.3f} ms, "
        f"rel err out {rel_err(pout, rout):.2e}, lse {rel_err(plse, rlse):.2e}")

  if not gpu:
    # The same steps through the Pallas kernels, in the interpreter.
    kcache = concat_and_cache_mla(kv_c, k_pe, jnp.zeros_like(cache), jnp.asarray(slots, jnp.int32),
                                  kv_cache_dtype="fp8_ds_mla", implementation="pallas",
                                  interpret=True)
    kidx = convert_req_index_to_global_index(req_id, jnp.asarray(block_table), jnp.asarray(local),
                                             block_size=block_size, implementation="pallas",
                                             interpret=True)
    kout, klse = sparse_mla_decode(q, kcache, kidx[:, None, :], kv_cache_dtype="fp8_ds_mla",
                                   implementation="pallas", interpret=True)
    kpout, _, kplse = sparse_mla_prefill(qp, kv, jnp.asarray(pidx), sm_scale=576**-0.5,
                                         implementation="pallas", interpret=True)
    print("[interpret] Pallas kernels vs reference: cache byte-exact "
          f"{bool(jnp.array_equal(kcache, ref_cache))}, indices exact "
          f"{bool(jnp.array_equal(kidx, ref_idx))}, decode rel err {rel_err(kout, ref_out):.2e} "
          f"(lse {rel_err(klse, ref_lse):.2e}), prefill rel err {rel_err(kpout, rout):.2e} "
          f"(lse {rel_err(kplse, rlse):.2e})")


if __name__ == "__main__":
  main()
