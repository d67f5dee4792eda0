"""Index conversion kernels against the seed Triton rows (benchmarks/RESULTS.md, "Anchors")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Row, device_name, n_sets, time_us
from jax_mla.indexing import convert_req_index_to_global_index, expand_page_indices
from jax_mla.indexing.triton import Config


def run(implementation: str = "triton") -> list[Row]:
  rng = np.random.default_rng(0)
  dev = device_name()
  rows = []

  # convert_req_index_to_global_index: T 4096, topk 2048, block 64 (seed: 49 us).
  T, K, bs, R, B = 4096, 2048, 64, 64, 512
  bytes_moved = 2 * T * K * 4
  sets = []
  for _ in range(n_sets(bytes_moved)):
    req = jnp.asarray(rng.integers(0, R, T), jnp.int32)
    bt = jnp.asarray(rng.integers(0, 1 << 16, (R, B)), jnp.int32)
    tok = jnp.asarray(rng.integers(-1, B * bs, (T, K)), jnp.int32)
    sets.append((req, bt, tok))
  fn = jax.jit(lambda r, b, t: convert_req_index_to_global_index(
      r, b, t, block_size=bs, implementation=implementation))
  us = time_us(fn, sets)
  rows.append(Row("convert_req_index_to_global_index", f"T {T}, topk {K}, block {bs}", us,
                  us, "us", 49.0, "seed Triton", dev))
  rows.append(Row("convert_req_index_to_global_index", f"T {T}, topk {K}, block {bs} (bandwidth)",
                  us, bytes_moved / us / 1e6, "TB/s", 1.37, "seed Triton", dev))

  # expand_page_indices: 256 requests x 8192 tokens, K 16 (seed: 11.3 us).
  R, L, Kb = 256, 8192, 16
  sets = []
  for _ in range(n_sets(R * L * 4)):
    bt = jnp.asarray(rng.integers(0, 1 << 16, (R, L // Kb)), jnp.int32)
    lens = jnp.full((R,), L, jnp.int32)
    sets.append((bt, lens))
  fn = jax.jit(lambda b, n: expand_page_indices(
      b, n, kernel_block_size=Kb, capacity=R * L, implementation=implementation))
  us = time_us(fn, sets)
  rows.append(Row("expand_page_indices", f"{R} req x {L} tok, K {Kb}", us, us, "us", 11.3,
                  "seed Triton", dev))
  return rows


def sweep() -> None:
  """Tile-shape ``Config`` sweep of both kernels (for tuning; prints one line a variant)."""
  rng = np.random.default_rng(1)
  T, K, bs, R, B = 4096, 2048, 64, 64, 512
  sets = [(jnp.asarray(rng.integers(0, R, T), jnp.int32),
           jnp.asarray(rng.integers(0, 1 << 16, (R, B)), jnp.int32),
           jnp.asarray(rng.integers(-1, B * bs, (T, K)), jnp.int32)) for _ in range(8)]
  for rows, cols, warps in [(1, 1024, 4), (1, 2048, 8), (2, 1024, 4), (4, 512, 4), (8, 256, 4),
                            (4, 1024, 8), (8, 512, 8), (16, 256, 8)]:
    cfg = Config(rows=rows, cols=cols, num_warps=warps)
    us = time_us(jax.jit(lambda r, b, t, cfg=cfg: convert_req_index_to_global_index(
        r, b, t, block_size=bs, config=cfg, implementation="triton")), sets)
    print(f"convert rows {rows} cols {cols} warps {warps}: {us:.1f} us")
  R, L, Kb = 256, 8192, 16
  sets = [(jnp.asarray(rng.integers(0, 1 << 16, (R, L // Kb)), jnp.int32),
           jnp.full((R,), L, jnp.int32)) for _ in range(8)]
  for chunk, warps in [(256, 4), (512, 4), (1024, 4), (2048, 8), (4096, 8), (8192, 8)]:
    cfg = Config(chunk=chunk, num_warps=warps)
    us = time_us(jax.jit(lambda b, n, cfg=cfg: expand_page_indices(
        b, n, kernel_block_size=Kb, capacity=R * L, config=cfg, implementation="triton")), sets)
    print(f"expand chunk {chunk} warps {warps}: {us:.1f} us")
  for row in run(implementation="xla"):
    print(f"xla reference: {row.op} {row.config}: {row.time_us:.1f} us")


if __name__ == "__main__":
  sweep()
