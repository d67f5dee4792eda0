"""Cache writer (``concat_and_cache_mla``) in every format: the Mosaic GPU (Hopper) and
Triton kernels against the XLA reference, and the torch bridge's in-place write.

Memory-bound: the figure is (latent bytes read + cache bytes written) / time,
against device-to-device copy bandwidth (3.0 TB/s on the H100: benchmarks/RESULTS.md,
"Anchors").
The cache is threaded through one jitted, donated program that applies the
write once per input set, so the write is in place (as in a serving step) and
one dispatch is spread over all the sets. `python -m benchmarks.bench_cache`
also checks the kernels byte for byte against the reference first.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Row, device_name, n_sets, print_table, sync_torch, time_calls_us
from jax_mla import _mosaic
from jax_mla.cache import concat_and_cache_mla, kv_cache_shape
from jax_mla.cache import triton as triton_writer
from jax_mla.cache.formats import resolve

COPY_TBPS = 3.0  # device-to-device copy on the H100 (RESULTS.md, "Anchors")
FORMATS = ("fp8_ds_mla", "fp8_model1", "fp8_v41", "fp4_v41", "auto", "fp8")


def _head(fmt: str) -> int:
  """Latent width: V4 / V4.1 512, V3.2 (and its auto / fp8 rows) 576."""
  return 512 if fmt in ("fp8_model1", "fp8_v41", "fp4_v41") else 576


def _cache_dtype(fmt: str):
  return jnp.bfloat16 if fmt == "auto" else jnp.uint8


def _token_bytes(fmt: str) -> int:
  """Cache bytes a token's write stores."""
  f = resolve(fmt)
  return getattr(f, "token_bytes", None) or _head(fmt) * jnp.dtype(_cache_dtype(fmt)).itemsize


def _inputs(rng, fmt, num_tokens, capacity, *, skip=True):
  nope = _head(fmt) - 64
  kv_c = jnp.asarray(rng.standard_normal((num_tokens, nope)), jnp.bfloat16)
  k_pe = jnp.asarray(rng.standard_normal((num_tokens, 64)), jnp.bfloat16)
  slots = rng.choice(capacity, size=num_tokens, replace=False).astype(np.int32)
  if skip:
    slots[::97] = -1
    slots[1::89] = capacity + 5
  return kv_c, k_pe, jnp.asarray(slots)


def kernels(fmt: str) -> tuple[str, ...]:
  """The writer kernels this machine runs for ``fmt``."""
  return (("mosaic",) if _mosaic.on_hopper() else ()) + (
      ("triton",) if triton_writer.supports(resolve(fmt)) else ())


def check(fmt: str, impl: str, num_tokens: int = 4096, num_blocks: int = 512,
          block_size: int = 64, seed: int = 0) -> int:
  """``impl`` vs XLA on one random write into a random-byte cache; returns mismatching
  bytes."""
  rng = np.random.default_rng(seed)
  shape = kv_cache_shape(num_blocks, block_size, _head(fmt), fmt)
  before = rng.integers(0, 256, size=(*shape[:-1], shape[-1] * jnp.dtype(
      _cache_dtype(fmt)).itemsize), dtype=np.uint8).view(_cache_dtype(fmt))
  kv_c, k_pe, slots = _inputs(rng, fmt, num_tokens, num_blocks * block_size)
  outs = [np.asarray(concat_and_cache_mla(kv_c, k_pe, jnp.asarray(before), slots,
                                          kv_cache_dtype=fmt, implementation=impl)).view(np.uint8)
          for impl in (impl, "xla")]  # bytes: a bf16 NaN equals itself
  return int((outs[0] != outs[1]).sum())


def _time_chain(fmt, impl, cache, sets, reps=10) -> float:
  """Median microseconds of one write, the cache threaded through len(sets) writes.

  Not ``harness.time_us``: that returns every call's output, so each write would
  copy the whole cache; a serving step updates it in place, which only a donated
  cache threaded from write to write measures.
  """

  def chain(cache, sets):
    for kv_c, k_pe, slots in sets:
      cache = concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype=fmt,
                                   implementation=impl)
    return cache

  run = jax.jit(chain, donate_argnums=0)
  for _ in range(2):
    cache = jax.block_until_ready(run(cache, sets))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    cache = jax.block_until_ready(run(cache, sets))
    times.append(time.perf_counter() - t0)
  return 1e6 * float(np.median(times)) / len(sets)


def in_place_from_torch(fmt, shape, sets, reps=10) -> tuple[float, float]:
  """(torch us, JAX us) per write into one cache, each call separately dispatched: the
  torch bridge's in-place ``ops.concat_and_cache_mla`` on a torch cache, and the JAX
  writer on a donated cache (one jitted call per write, the cache threaded through).
  Checks first that both leave the same bytes and that torch's storage did not move."""
  import torch

  from torch_bridge import ops, to_jax, to_torch
  device = "cuda" if torch.cuda.is_available() else "cpu"
  t_sets = [tuple(to_torch(a).to(device) for a in s) for s in sets]
  bf16 = fmt == "auto"  # the one format whose cache is not bytes
  t_cache = torch.zeros(shape, dtype=torch.bfloat16 if bf16 else torch.uint8, device=device)
  ptr = t_cache.data_ptr()
  write = jax.jit(lambda cache, kv_c, k_pe, slots: concat_and_cache_mla(
      kv_c, k_pe, cache, slots, kv_cache_dtype=fmt), donate_argnums=0)
  j_cache = [jnp.zeros(shape, _cache_dtype(fmt))]
  ops.concat_and_cache_mla(*t_sets[0][:2], t_cache, t_sets[0][2], kv_cache_dtype=fmt)
  j_cache[0] = write(j_cache[0], *sets[0])
  if t_cache.data_ptr() != ptr or not bool((to_jax(t_cache) == j_cache[0]).all()):
    raise AssertionError(f"{fmt}: the torch in-place write differs from the JAX write")

  def jax_call(s):
    def call():
      j_cache[0] = write(j_cache[0], *s)
      return j_cache[0]
    return call

  t_us = time_calls_us([lambda s=s: ops.concat_and_cache_mla(s[0], s[1], t_cache, s[2],
                                                             kv_cache_dtype=fmt)
                        for s in t_sets], sync_torch, reps=reps)
  # Only the last cache is alive: each call donated the one before.
  j_us = time_calls_us([jax_call(s) for s in sets], lambda outs: jax.block_until_ready(outs[-1]),
                       reps=reps)
  return t_us, j_us


CONFIGS = ([(fmt, T, nb) for fmt in ("fp8_ds_mla", "fp8_model1")
            for T, nb in ((128, 4096), (4096, 512), (4096, 4096), (16384, 4096))]
           + [(fmt, T, nb) for fmt in FORMATS[2:] for T, nb in ((128, 4096), (4096, 512))])


def run(configs=CONFIGS, impls=None) -> list[Row]:
  rng = np.random.default_rng(0)
  dev = device_name()
  rows = []
  bs = 64
  for fmt, T, nb in configs:
    head = _head(fmt)
    shape = kv_cache_shape(nb, bs, head, fmt)
    moved = T * (2 * head + _token_bytes(fmt))  # bf16 latent in, token bytes out
    sets = [_inputs(rng, fmt, T, nb * bs, skip=False) for _ in range(n_sets(T * 2 * head))]
    for impl in impls or (*kernels(fmt), "xla"):
      us = _time_chain(fmt, impl, jnp.zeros(shape, _cache_dtype(fmt)), sets)
      rows.append(Row("concat_and_cache_mla", f"{fmt} T {T}, {nb}x{bs} blocks ({impl})", us,
                      moved / us / 1e6, "TB/s", COPY_TBPS, "D2D copy", dev))
    if T <= 4096:  # the torch bridge's in-place write, against the same write from JAX
      t_us, j_us = in_place_from_torch(fmt, shape, sets)
      rows.append(Row("concat_and_cache_mla from torch", f"{fmt} T {T}, {nb}x{bs} blocks",
                      t_us, t_us, "us", j_us, "JAX write, per call", dev))
  return rows


def main() -> None:
  print("device:", device_name())
  for fmt in FORMATS:
    for impl in kernels(fmt):
      for seed in (0, 1):
        print(f"check {impl} {fmt} T 4096 seed {seed}: {check(fmt, impl, seed=seed)} "
              "mismatching bytes")
  rows = []
  for config in CONFIGS:  # row by row, so a cut-off run still reports
    rows += run([config])
    print_table(rows[-len(kernels(config[0])) - 2:])
  print_table(rows)


if __name__ == "__main__":
  main()
