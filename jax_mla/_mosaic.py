"""Shared pieces of the Pallas Mosaic GPU (Hopper) kernels.

The Mosaic GPU modules import absl and only lower for CUDA, so they are imported
on use, never at package import.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


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


def default_for(check, *args, **kwargs) -> bool:
  """Whether ``implementation=None`` runs a Mosaic GPU kernel: :func:`on_hopper` and
  ``check(*args, **kwargs)`` (the kernel's ``ValueError``-raising shape check) passes."""
  if not on_hopper():
    return False
  try:
    check(*args, **kwargs)
  except ValueError:
    return False
  return True


def online_softmax_step(plgpu_mod, s, m, l, acc, v_ref, scale: float):
  """One key block of a consumer warpgroup's online softmax and ``P V``.

  ``s`` float32 scores (WGMMA layout, ``-inf`` where there is no key), ``m`` the running
  row max in scaled base-2 units, ``l`` the running sum, ``acc`` the float32 output
  accumulator, ``v_ref`` the SMEM values for ``acc``'s columns, ``scale`` the softmax
  scale times ``log2(e)``. Returns the new ``(acc, m, l)``.
  """
  # The scale folds into the exp2's FMA.
  m_new = jnp.maximum(m, s.max(axis=1) * scale)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
  l = l * alpha + p.sum(axis=1)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
  p16 = p.astype(jnp.bfloat16)

  def pv(acc_ref):
    plgpu_mod.wgmma(acc_ref, p16, v_ref)

  return pl.run_state(pv)(plgpu_mod.ACC.init(acc)), m_new, l
