"""Pallas Mosaic GPU kernel of the split-KV combine (:func:`jax_mla.merge.combine_splits`),
with attention sinks.

A split-KV decode whose kernels are all Mosaic GPU stays one program of Mosaic GPU
kernels (the torch bridge then launches it on torch's stream, without PJRT:
``torch_bridge._direct``). The reduce is small (each part row read once) and plain
per-thread work, written inline (:mod:`jax_mla._inline`): each CTA takes 8 rows, each
thread one 16-byte chunk (8 values) of 4 of them; it weighs the parts by their LSE,
sums them in float32 and stores bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import _inline, _mosaic
from jax_mla._common import LN2, LOG2E

ROWS = 8  # rows per CTA: 128 threads x 4 rows x 16 bytes covers 8 rows of 512 values
_CHUNK = 8  # bf16 values a thread moves at once (16 bytes)


def combine(out_parts, lse_parts, max_parts, sink, *, heads: int):
  """Combines ``S`` partial results (call under jit).

  Args:
    out_parts: bf16 ``[S, n, d]``, each part normalised over its own keys; ``d`` a
      multiple of 8 with ``d / 8`` dividing 512, ``n`` a multiple of 8.
    lse_parts, max_parts: float32 ``[S, n]`` natural-log LSE and max logit of each part
      (``+inf`` or ``-inf`` LSE: a part without keys); or ``[S, m, pitch]``, rows of
      ``pitch`` of which the first ``n / m`` are used (a kernel's per-CTA rows, padded
      for its copies), so that no slice copies them between the two kernels.
    sink: float32 ``[heads]`` attention sinks (row ``r`` is head ``r % heads``;
      ``-inf``: none), or None.

  Returns:
    ``(out bf16 [n, d], max_logits [n], lse [n])``: as :func:`jax_mla.merge.combine_splits`
    (a row empty in every part: ``out = 0``, ``lse = +inf``, max ``-inf``), then ``out``
    times ``exp(lse) / (exp(lse) + exp(sink))``, as the sparse kernels apply sinks.
  """
  parts, n, d = out_parts.shape
  chunks = d // _CHUNK
  if d % _CHUNK or 128 % chunks or (ROWS * chunks) % 128 or n % ROWS:
    raise ValueError(f"combine takes d a multiple of 8 dividing 1024 and n a multiple of "
                     f"{ROWS}; got d={d}, n={n}")
  # The parts' stats as ``groups`` rows of ``pitch`` values, the first ``n / groups`` used.
  if lse_parts.shape == (parts, n):
    groups, pitch = 1, n
  elif lse_parts.ndim == 3 and lse_parts.shape[0] == parts:
    groups, pitch = lse_parts.shape[1:]
  else:
    groups = pitch = 0  # refused below
  if not groups or n % groups or pitch < n // groups or max_parts.shape != lse_parts.shape:
    raise ValueError(f"combine takes lse and max parts [S, n] or [S, m, pitch >= n / m]; got "
                     f"{lse_parts.shape} and {max_parts.shape} for out parts {out_parts.shape}")
  plgpu = _mosaic.plgpu()
  if sink is None:
    sink = jnp.full((heads,), -jnp.inf, jnp.float32)
  reduce = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 7)(
      functools.partial(_combine_rows, parts=parts, n=n, d=d, heads=heads,
                        stats=(n // groups, groups * pitch, pitch)))

  def body(o_ref, l_ref, m_ref, sink_ref, out_ref, ml_ref, lse_ref):
    reduce(o_ref, l_ref, m_ref, sink_ref, out_ref, ml_ref, lse_ref)

  out_type = (jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32))
  return plgpu.kernel(body, **{_mosaic.out_type_kwarg(plgpu): out_type}, grid=(n // ROWS,),
                      grid_names=("r",))(
      out_parts.reshape(parts * n, d), lse_parts.reshape(-1), max_parts.reshape(-1),
      sink.astype(jnp.float32))


def _combine_rows(ctx, o_ref, l_ref, m_ref, sink_ref, out_ref, ml_ref, lse_ref, *, parts, n,
                  d, heads, stats):
  """One thread's rows (inline Mosaic GPU, :mod:`jax_mla._inline`): see :func:`combine`.
  ``stats``: ``(used, part, pitch)``, where row ``r``'s LSE and max of part ``s`` lie in
  the flat parts: element ``s * part + (r // used) * pitch + r % used``."""
  del ctx
  from jax._src.lib.mlir.dialects import arith

  c32, cf = _inline.const, _inline.fconst

  def at(base, elem, size):  # byte address of element ``elem`` (i32) of ``size`` bytes
    return _inline.at(base, arith.muli(_inline.wide(elem), _inline.const(size, 64)))

  eq = lambda a, b: arith.cmpf(arith.CmpFPredicate.OEQ, a, b)  # noqa: E731
  o, lse_in, max_in, sinks = map(_inline.global_ptr, (o_ref, l_ref, m_ref, sink_ref))
  out, ml_out, lse_out = map(_inline.global_ptr, (out_ref, ml_ref, lse_ref))
  tid = _inline.warpgroup_thread()
  chunks = d // _CHUNK
  chunk = arith.remui(tid, c32(chunks))
  first = arith.addi(arith.muli(_inline.block_x(), c32(ROWS)), arith.divui(tid, c32(chunks)))
  inf, ninf = cf(float("inf")), cf(float("-inf"))
  used, part, pitch = stats
  for r in range(ROWS * chunks // 128):
    row = arith.addi(first, c32(r * 128 // chunks))
    stat = row if used == pitch else arith.addi(
        arith.muli(arith.divui(row, c32(used)), c32(pitch)), arith.remui(row, c32(used)))
    # Weights: a part without keys (+-inf) weighs 0; NaN propagates (maximumf).
    lses = [_inline.load_f32(at(lse_in, arith.addi(c32(s * part), stat), 4)) for s in range(parts)]
    lses = [arith.select(eq(v, inf), ninf, v) for v in lses]
    m = lses[0]
    for v in lses[1:]:
      m = arith.maximumf(m, v)
    empty = eq(m, ninf)
    m_safe = arith.select(empty, cf(0.0), m)
    ws = [_inline.exp2(arith.mulf(arith.subf(v, m_safe), cf(LOG2E))) for v in lses]
    total = ws[0]
    for w in ws[1:]:
      total = arith.addf(total, w)
    total_safe = arith.select(empty, cf(1.0), total)
    lse = arith.addf(m_safe, arith.mulf(_inline.log2(total_safe), cf(LN2)))
    lse = arith.select(empty, inf, lse)
    # The sink's share: 1 / (1 + exp(sink - lse)) (sink -inf: 1; an empty row is 0 anyway).
    sink = _inline.load_f32(at(sinks, arith.remui(row, c32(heads)), 4))
    kept = arith.divf(cf(1.0), arith.addf(cf(1.0), _inline.exp2(
        arith.mulf(arith.subf(sink, lse), cf(LOG2E)))))
    scale = arith.select(empty, cf(0.0), arith.divf(kept, total_safe))
    acc = [cf(0.0)] * _CHUNK
    for s, w in enumerate(ws):
      ws_scaled = arith.mulf(w, scale)
      chunk_at = at(o, arith.addi(arith.muli(arith.addi(c32(s * n), row), c32(chunks)), chunk),
                    16)
      values = _inline.bf16_floats(_inline.load_words(chunk_at, 4))
      acc = [arith.addf(a, arith.mulf(v, ws_scaled)) for a, v in zip(acc, values, strict=True)]
    packed = [_inline.pack(acc[2 * k], acc[2 * k + 1], "bf16") for k in range(_CHUNK // 2)]
    _inline.store_words(at(out, arith.addi(arith.muli(row, c32(chunks)), chunk), 16), packed)
    first_chunk = arith.extui(_inline.int_type(), arith.cmpi(arith.CmpIPredicate.eq, chunk,
                                                            c32(0)))
    maxes = [_inline.load_f32(at(max_in, arith.addi(c32(s * part), stat), 4)) for s in range(parts)]
    mx = maxes[0]
    for v in maxes[1:]:
      mx = arith.maximumf(mx, v)
    for ptr, value in ((at(lse_out, row, 4), lse), (at(ml_out, row, 4), mx)):
      _inline.store_words(ptr, [arith.bitcast(_inline.int_type(), value)], first_chunk)
