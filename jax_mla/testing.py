"""Numerical comparison used by the tests, the benchmarks and the demo."""

from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
  """``||out - ref|| / ||ref||`` in float64 over the entries where ``ref`` is finite.

  ``lse = +inf`` of an empty row in both is not an error; NaN anywhere in ``out``,
  or a non-finite ``out`` where ``ref`` is finite, gives inf.
  """
  out = np.asarray(out, dtype=np.float64)
  ref = np.asarray(ref, dtype=np.float64)
  fin = np.isfinite(ref)
  if np.isnan(out).any() or not np.isfinite(out[fin]).all():
    return float("inf")
  with np.errstate(invalid="ignore"):  # inf - inf where ref is not finite; masked out
    diff = (out - ref)[fin]
  return float(np.linalg.norm(diff) / max(np.linalg.norm(ref[fin]), 1e-30))
