"""Test helpers shared by the op tests (import as `from helpers import ...`)."""

import functools

import jax
import numpy as np
import pytest

from jax_mla.testing import rel_err  # noqa: F401  (re-exported for the tests)


@functools.cache
def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def lowers_for_cuda(fn, *args):
  """Lowers ``jax.jit(fn)`` for CUDA from ``jax.ShapeDtypeStruct`` arguments on any
  machine: a Mosaic GPU kernel's whole lowering (layouts, shared memory, grid) runs, so
  what would fail to compile on the GPU fails here. Needs ``absl`` (Mosaic GPU)."""
  pytest.importorskip("absl")
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def poison_like(shape, dtype):
  """An output-sized buffer full of NaN (or the dtype's max for integers)."""
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.integer):
    return np.full(shape, np.iinfo(dtype).max, dtype)
  return np.full(shape, np.nan, dtype)
