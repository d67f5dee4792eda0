"""The L2 fetch granularity of this process's CUDA GPUs: an opt-in tuning for gathers.

On an L2 miss the H100 fetches from DRAM in pieces of the context's L2 fetch
granularity (``CU_LIMIT_MAX_L2_FETCH_GRANULARITY``, 64 bytes by default). A 656-byte
``fp8_ds_mla`` row at any slot spans 21 sectors of 32 bytes but 11 pieces of 64: it
costs 704 bytes of DRAM reads at the default and 672 at 32 bytes. The sparse decodes
read random rows, so a process that sets 32 bytes reads 4-5% fewer DRAM bytes there
(ncu, H100: fp8_ds_mla b128 s_q 2 h16 topk 2048, 372.7 -> 356.3 MB; fp8_model1 h16
215.0 -> 206.1 MB) and runs 1-2 us faster at 16 and 32 heads (benchmarks/RESULTS.md,
session 43). In those runs FlashMLA's sparse decode, our 128-head decode (bound by its
tensor cores) and the torch projections of a model loop took the same time either way.

The limit belongs to the CUDA context, which XLA and torch share (the device's primary
context): it applies to every kernel of the process from the next launch on, in JAX and
through :mod:`torch_bridge` alike. It cannot be part of a jitted program, so jax-mla
never sets it itself.
"""

from __future__ import annotations

import ctypes
import functools
import numbers

import jax

# cuda.h: CUlimit.CU_LIMIT_MAX_L2_FETCH_GRANULARITY
_LIMIT = 0x05
GRANULARITIES = (32, 64, 128)  # bytes (CUDA takes 0-128 as a hint; 64 is the H100 default)


@functools.cache
def _driver():
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError as e:
    raise RuntimeError(f"the L2 fetch granularity needs the CUDA driver ({e})") from None
  _check(cuda.cuInit(0), "cuInit")
  return cuda


def _check(result: int, call: str):
  if result != 0:
    raise RuntimeError(f"{call} failed: CUresult {result}")


def _cuda_devices(devices):
  devices = jax.local_devices() if devices is None else list(devices)
  for d in devices:
    if d.platform != "gpu" or "cuda" not in d.client.platform_version.lower():
      raise RuntimeError(f"the L2 fetch granularity is a CUDA setting; {d} is not a CUDA "
                         "GPU (a CPU or ROCm device)")
  return devices


def _with_context(device, body):
  """``body(cuda)`` with ``device``'s primary context (XLA's and torch's) current."""
  cuda = _driver()
  ordinal, ctx, popped = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
  _check(cuda.cuDeviceGet(ctypes.byref(ordinal), device.local_hardware_id), "cuDeviceGet")
  _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal), "cuDevicePrimaryCtxRetain")
  try:
    _check(cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
      return body(cuda)
    finally:
      _check(cuda.cuCtxPopCurrent_v2(ctypes.byref(popped)), "cuCtxPopCurrent")
  finally:
    _check(cuda.cuDevicePrimaryCtxRelease_v2(ordinal), "cuDevicePrimaryCtxRelease")


def _get(cuda) -> int:
  value = ctypes.c_size_t()
  _check(cuda.cuCtxGetLimit(ctypes.byref(value), _LIMIT), "cuCtxGetLimit")
  return value.value


def l2_fetch_granularity(device: jax.Device | None = None) -> int:
  """The L2 fetch granularity in bytes of ``device`` (default: the first local one)."""
  return _with_context(_cuda_devices(None if device is None else [device])[0], _get)


def set_l2_fetch_granularity(nbytes: int, devices=None) -> dict[jax.Device, int]:
  """Sets the L2 fetch granularity of ``devices`` (default: every local device) to
  ``nbytes`` (32, 64 or 128) and returns each device's previous value, to restore it
  with. It applies to the whole process from the next kernel launch on (module
  docstring); 32 suits the sparse decodes' random rows."""
  if (not isinstance(nbytes, numbers.Integral) or isinstance(nbytes, bool)
      or nbytes not in GRANULARITIES):
    raise ValueError(f"nbytes must be one of {GRANULARITIES} (bytes), got {nbytes!r}")
  previous = {}
  for d in _cuda_devices(devices):
    def swap(cuda, d=d):
      before = _get(cuda)
      _check(cuda.cuCtxSetLimit(_LIMIT, ctypes.c_size_t(int(nbytes))), "cuCtxSetLimit")
      if _get(cuda) != nbytes:
        raise RuntimeError(f"{d}: the driver kept the L2 fetch granularity at "
                           f"{_get(cuda)} bytes, not {nbytes}")
      return before
    previous[d] = _with_context(d, swap)
  return previous
