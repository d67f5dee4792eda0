"""Test helpers shared by the op tests (import as `from helpers import ...`)."""

import jax
import numpy as np


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def rel_err(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
  out = np.asarray(out, dtype=np.float64)
  ref = np.asarray(ref, dtype=np.float64)
  if not np.all(np.isfinite(out[np.isfinite(ref)])) or np.isnan(out).any():
    return float("inf")
  denom = np.linalg.norm(ref[np.isfinite(ref)])
  diff = np.linalg.norm((out - ref)[np.isfinite(ref)])
  return float(diff / max(denom, 1e-30))


def poison_like(shape, dtype):
  """An output-sized buffer full of NaN (or the dtype's max for integers)."""
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.integer):
    return np.full(shape, np.iinfo(dtype).max, dtype)
  return np.full(shape, np.nan, dtype)
