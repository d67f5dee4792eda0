"""Shared pieces of the Pallas Mosaic GPU (Hopper) kernels.

The Mosaic GPU modules import absl and only lower for CUDA, so they are imported
on use, never at package import.
"""

from __future__ import annotations

import inspect

import jax


def plgpu():
  """``jax.experimental.pallas.mosaic_gpu``, imported on use."""
  from jax.experimental.pallas import mosaic_gpu
  return mosaic_gpu


def row_layout(plgpu_mod):
  """Layout of a per-row vector reduced from a WGMMA-layout tile (name varies by jax)."""
  wgmma = plgpu_mod.Layout.WGMMA
  return wgmma.reduce(1) if hasattr(wgmma, "reduce") else plgpu_mod.Layout.WGMMA_ROW


def col_layout(plgpu_mod):
  """Layout of a per-column vector of a WGMMA-layout tile (name varies by jax)."""
  wgmma = plgpu_mod.Layout.WGMMA
  return wgmma.reduce(0) if hasattr(wgmma, "reduce") else plgpu_mod.Layout.WGMMA_COL


def out_type_kwarg(plgpu_mod) -> str:
  """``plgpu.kernel``'s output-shape keyword (renamed across jax versions)."""
  params = inspect.signature(plgpu_mod.kernel).parameters
  return "out_type" if "out_type" in params else "out_shape"


def on_hopper() -> bool:
  """Whether ``implementation=None`` may pick a Mosaic GPU kernel: a Hopper GPU, a jax
  the kernels were checked on (0.11), and Mosaic GPU importable."""
  if jax.__version_info__ < (0, 11) or jax.default_backend() != "gpu":
    return False
  if getattr(jax.devices()[0], "compute_capability", "").split(".")[0] != "9":
    return False
  try:
    plgpu()
  except ImportError:
    return False
  return True
