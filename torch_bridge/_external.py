"""Shared plumbing for calling installed torch kernel libraries on jax.Arrays."""

from __future__ import annotations

import importlib

import jax

from torch_bridge import _interop


def load(module: str, library: str, hint: str):
  """Imports ``module`` or raises ImportError naming ``library`` and how to install it."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f"{library} is not installed (import {module!r} failed: {e}). {hint}") \
        from None


def require_gpu(library: str, platform: str, arrays: dict) -> None:
  """Raises RuntimeError unless every array is a jax.Array on a ``platform`` GPU."""
  for name, a in arrays.items():
    if a is None:
      continue
    _interop.check_array(name, a)
    dev = next(iter(a.sharding.device_set))
    version = getattr(dev.client, "platform_version", "").lower()
    if dev.platform != "gpu" or platform not in version:
      raise RuntimeError(f"{library} runs on {platform.upper()} GPUs; {name} is on {dev} "
                         f"({dev.platform}, {version or 'no GPU platform'})")


def to_torch(a):
  return None if a is None else _interop.to_torch(a)


def to_jax(t):
  return _interop.to_jax(t.contiguous())


def jax_outputs(*ts) -> tuple[jax.Array, ...]:
  return tuple(to_jax(t) for t in ts)
