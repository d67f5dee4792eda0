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

from jax_mla._common import runs_on_gpu


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
  """Whether ``implementation=None`` runs a Mosaic GPU kernel: :func:`on_hopper`, the
  first of ``args`` (the op's first array) lives on the GPU, and ``check(*args,
  **kwargs)`` (the kernel's ``ValueError``-raising shape check) passes."""
  if not on_hopper() or (args and not runs_on_gpu(args[0])):
    return False
  try:
    check(*args, **kwargs)
  except ValueError:
    return False
  return True


def shared_scratch(plgpu_mod, rows: int, num_stages: int):
  """What :func:`consume_stages` passes between its two warpgroups besides ``P``, for a
  kernel's ``run_scoped``: float32 ``[num_stages + 2, rows]`` SMEM (each ring slot's
  rescale factor, then the running row max and sum) and ``num_stages + 1`` barriers
  (one "``P`` ready" per slot, then warpgroup 0's own one)."""
  return (plgpu_mod.SMEM((num_stages + 2, rows), jnp.float32),
          plgpu_mod.Barrier(num_arrivals=1, num_barriers=num_stages + 1))


def consume_stages(plgpu_mod, *, wg, q_main, q_rope, k_main, k_rope, steps, barriers, shared,
                   mask, scale: float):
  """The attention loop of a consumer warpgroup in the warp-specialised MLA kernels
  (dense decode and sparse MLA; call after ``set_max_registers``).

  A producer warpgroup fills a ring of key stages in SMEM; the two consumers (``wg``
  0 and 1) each own 256 of the 512 output columns. Per stage warpgroup 0 computes
  ``S = Q K^T`` over the two 256-wide halves of the 512 main columns plus the RoPE
  columns, masks it and runs the online softmax in base 2; it hands ``P`` (bf16) and
  the rows' rescale factor to warpgroup 1 through SMEM, and both multiply ``P`` by
  their half of ``V`` (the main columns of the same key rows). ``S`` is computed once
  (FlashMLA's split): computing it in both warpgroups cost a third of the tensor-core
  work of a step. Warpgroup 1's ``P V`` of a stage overlaps warpgroup 0's ``Q K^T``
  of the next. ``P`` goes into the stage's RoPE tile, dead once ``S`` is computed
  (``V`` is the main columns), and the rescale factor into the slot's row of
  ``stats``: both are free again when the stage is.

  Args:
    wg: this consumer's index (``lax.axis_index("wg")``).
    q_main, q_rope: SMEM ``[2, rows, 256]`` and ``[rows, rope]`` queries (``q_rope``
      None: no RoPE columns).
    k_main, k_rope: SMEM rings ``[stages, 2, keys, 256]`` and ``[stages, keys, rope]``;
      ``k_rope`` holds ``P`` after ``S`` (``rope == rows``), also when ``q_rope`` is None.
    steps: key stages to consume (traced).
    barriers: ``(q_bar, kv_bar, free_bar, done_bar)``: query loaded, stage loaded (one
      per stage), stage free (one per stage, both consumers arrive), both consumers done
      with the query.
    shared: ``(stats, p_ready)`` from :func:`shared_scratch`.
    mask: ``mask(i, slot)`` runs (in warpgroup 0) before stage ``i`` (ring slot
      ``slot``) is waited for, so work that does not read the stage overlaps the wait;
      it returns the function that sets the float32 scores of absent keys to ``-inf``.
    scale: the softmax scale times ``log2(e)``.

  Returns:
    ``(acc, m, l)`` in both warpgroups once both are done with the query, whose SMEM
    may then stage the output: the float32 accumulator ``[rows, 256]``, the row max
    (scaled base-2 units) and sum. Finish with :func:`empty_rows`.
  """
  plgpu = plgpu_mod
  q_bar, kv_bar, free_bar, done_bar = barriers
  stats, p_ready = shared
  num_stages, _, keys, half = k_main.shape
  rows = q_main.shape[1]
  m_row, l_row = num_stages, num_stages + 1
  row = row_layout(plgpu)
  load_row = lambda k: plgpu.load(stats.at[k], (), layout=row, optimized=False)  # noqa: E731
  acc = plgpu.layout_cast(jnp.zeros((rows, half), jnp.float32), plgpu.Layout.WGMMA)

  @pl.when(wg == 0)
  def _init():
    # The running max and sum live in SMEM: only warpgroup 0 updates them. Its own
    # barrier orders these stores (by whichever threads hold a row) before any load.
    stats.at[m_row][...] = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row)
    stats.at[l_row][...] = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row)
    plgpu.barrier_arrive(p_ready.at[num_stages])
    plgpu.barrier_wait(p_ready.at[num_stages])

  plgpu.barrier_wait(q_bar)

  def step(i, acc):
    slot = lax.rem(i, num_stages)

    @pl.when(wg == 0)
    def _scores():
      apply_mask = mask(i, slot)
      plgpu.barrier_wait(kv_bar.at[slot])

      def qk(s_ref):
        for h in range(2):
          plgpu.wgmma(s_ref, q_main.at[h], k_main.at[slot, h].transpose((1, 0)))
        if q_rope is not None:
          plgpu.wgmma(s_ref, q_rope, k_rope.at[slot].transpose((1, 0)))
        return s_ref[...]

      s = apply_mask(pl.run_scoped(qk, plgpu.ACC((rows, keys), jnp.float32)))
      # The previous step's P-ready barrier ordered the stores of m and l before these.
      p, alpha, m, l = online_softmax(s, load_row(m_row), load_row(l_row), scale)
      k_rope.at[slot][...] = p  # S is done (read above): the RoPE tile is dead
      stats.at[slot][...] = alpha
      stats.at[m_row][...] = m
      stats.at[l_row][...] = l
      plgpu.commit_smem()  # P is read by wgmma (the async proxy)
      plgpu.barrier_arrive(p_ready.at[slot])

    @pl.when(wg == 1)
    def _():
      plgpu.barrier_wait(kv_bar.at[slot])

    plgpu.barrier_wait(p_ready.at[slot])
    alpha = load_row(slot)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, k_rope.at[slot], k_main.at[slot, wg])

    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(free_bar.at[slot])
    return acc

  acc = lax.fori_loop(0, steps, step, acc)
  plgpu.barrier_arrive(done_bar)
  plgpu.barrier_wait(done_bar)
  return acc, load_row(m_row), load_row(l_row)


def empty_rows(l):
  """``(empty, l_safe)`` after the last stage: rows with no key, and ``l`` with 1 there.

  A row is empty iff ``l == 0`` (a key adds ``exp2(0) = 1`` at the row max). A NaN
  score (a NaN query, say) makes ``l`` NaN, which is not empty: the row's output and
  LSE come out NaN, as the references give.
  """
  empty = l == 0.0
  return empty, jnp.where(empty, 1.0, l)


def online_softmax(s, m, l, scale: float):
  """One key block of the online softmax: ``s`` float32 scores (WGMMA layout, ``-inf``
  where there is no key), ``m`` the running row max in scaled base-2 units, ``l`` the
  running sum, ``scale`` the softmax scale times ``log2(e)``. Returns ``(P in bf16, the
  factor that rescales what was accumulated before, m, l)``, updated."""
  # The scale folds into the exp2's FMA.
  m_new = jnp.maximum(m, s.max(axis=1) * scale)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
  return p.astype(jnp.bfloat16), alpha, m_new, l * alpha + p.sum(axis=1)
