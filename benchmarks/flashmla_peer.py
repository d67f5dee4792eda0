"""FlashMLA beside jax-mla: the same rows, the same inputs, the same timer.

Where ``flash_mla`` (FlashMLA built from its public source; its last Hopper release)
imports on a CUDA machine, the sparse and dense MLA benchmarks time each row for both
libraries in one process. FlashMLA reads our arrays through DLPack without a copy
(caches as FlashMLA's views of the same bytes), its outputs are compared with ours,
then both are timed by ``benchmarks.harness.time_side_by_side`` (wall clock, and GPU
time from a CUPTI trace). Nothing of FlashMLA is in this repository; put its package on
``PYTHONPATH`` to enable the mode.

The same call builders also make FlashMLA's calls on :mod:`torch_bridge.ops`, our
FlashMLA drop-ins (:func:`bridge`): our kernels called from torch as FlashMLA is, timed
beside both as a third contender.
"""

from __future__ import annotations

import functools
import importlib

import jax

from benchmarks.harness import (
  Row,
  SideBySide,
  check_close,
  device_name,
  rel_err,
  time_side_by_side,
)
from jax_mla.cache.model1 import MODEL1

NAME = "FlashMLA (same run)"
HEADS = 64  # the fewest query heads FlashMLA's Hopper kernels take (fewer run padded)


def load():
  """The ``flash_mla`` module, or None where it (or a CUDA torch) is missing."""
  try:
    import torch
    if not torch.cuda.is_available():
      return None
    return importlib.import_module("flash_mla")
  except ImportError:
    return None


def bridge():
  """:mod:`torch_bridge.ops`: FlashMLA's interface on jax-mla's kernels (on Hopper
  launched directly on torch's stream), for the call builders below."""
  from torch_bridge import ops
  return ops


def _torch(a):
  from torch_bridge import to_torch
  return None if a is None else to_torch(a)


def cache_view(cache: jax.Array, kv_cache_dtype: str):
  """Our cache as the ``[num_blocks, block_size, 1, last]`` tensor FlashMLA reads."""
  import torch
  t = _torch(cache)
  nb, bs = t.shape[:2]
  if kv_cache_dtype == "auto":
    return t.view(nb, bs, 1, -1)
  t = t.view(torch.float8_e4m3fn)
  if kv_cache_dtype == "fp8_ds_mla":
    return t.view(nb, bs, 1, -1)
  if kv_cache_dtype == "fp8_model1":  # whole padded blocks, one token row each
    padded = MODEL1.block_bytes(bs)
    return t.as_strided((nb, bs, 1, MODEL1.token_bytes), (padded, MODEL1.token_bytes,
                                                          MODEL1.token_bytes, 1))
  raise ValueError(f"FlashMLA reads no {kv_cache_dtype!r} cache")


def sparse_prefill(fm, q, kv, indices, attn_sink, sm_scale):
  """A zero-argument FlashMLA ``flash_mla_sparse_fwd`` call on our prefill inputs."""
  args = (_torch(q), _torch(kv)[:, None], _torch(indices)[:, None], sm_scale, 512,
          _torch(attn_sink))
  return lambda: fm.flash_mla_sparse_fwd(*args)


def sparse_decode(fm, meta, q, cache, indices, attn_sink, extra_cache, extra_indices, *,
                  kv_cache_dtype):
  """A zero-argument FlashMLA sparse ``flash_mla_with_kvcache`` call; ``meta`` from
  ``fm.get_mla_metadata()[0]``, shared by calls of one shape."""
  args = (_torch(q), cache_view(cache, kv_cache_dtype), None, None, 512, meta, None, None,
          False, True, _torch(indices), _torch(attn_sink),
          None if extra_cache is None else cache_view(extra_cache, kv_cache_dtype),
          _torch(extra_indices))
  return lambda: fm.flash_mla_with_kvcache(*args)


def dense_decode(fm, meta, q, cache, block_table, cache_seqlens, *, causal=False):
  """A zero-argument FlashMLA dense bf16 ``flash_mla_with_kvcache`` call."""
  args = (_torch(q), cache_view(cache, "auto"), _torch(block_table), _torch(cache_seqlens),
          512, meta, None, None, causal)
  return lambda: fm.flash_mla_with_kvcache(*args)


def from_torch(t):
  """FlashMLA's output as a jax.Array (for comparing with ours; a copy where strided)."""
  from torch_bridge import to_jax
  return to_jax(t.contiguous())


def compare_and_time(name: str, ours, theirs, sets, lse_at: int, keep=None,
                     bridged=None) -> SideBySide:
  """``ours`` (a jitted op over a set) against ``theirs`` (one FlashMLA call per set):
  outputs compared on the first set (``out`` asserted, ``lse`` at ``lse_at`` printed;
  ``keep``, where given, selects the part of FlashMLA's outputs that is ours: its
  padding heads dropped), then both timed by ``time_side_by_side``. ``bridged``: the
  same calls on :func:`bridge` (unpadded), whose ``out`` is asserted against ours and
  which is timed beside them."""
  got, peer = ours(*sets[0]), [from_torch(t) for t in theirs[0]()]
  if keep is not None:
    peer = keep(peer)
  check_close(f"{name}: ours vs FlashMLA out", got[0], peer[0])
  lse_err = rel_err(got[lse_at], peer[lse_at])
  if bridged is not None:
    check_close(f"{name}: ours through the torch bridge vs ours out",
                from_torch(bridged[0]()[0]), got[0])
  t = time_side_by_side([functools.partial(ours, *s) for s in sets], theirs, bridged=bridged)
  print(f"side by side {name}: {t.summary('FlashMLA')}; lse rel err {lse_err:.1e}", flush=True)
  return t


def rows(op: str, config: str, t: SideBySide, figure, unit: str) -> list[Row]:
  """The row of the wall-clock times, then (where read) the row of the GPU times;
  ``figure(us)`` is the row's headline figure in ``unit``."""
  dev = device_name()
  return [Row(f"{op}{label}", config, ours, figure(ours), unit, figure(peer), NAME, dev)
          for label, ours, peer in t.measures()]
