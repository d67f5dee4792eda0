"""Pallas Triton backward of sparse MLA prefill: a ``dq`` kernel and a ``dkv`` kernel.

FlashAttention's recompute scheme on gathered rows: with ``p = exp(s - lse)``
recomputed from the forward's ``lse`` and ``K`` a step's gathered rows (``V`` their
first ``d_v`` columns)::

  dp  = dO V^T
  ds  = p (f dp + b)               (f, b per head: see ``sparse_prefill_bwd``)
  dq  = sm_scale sum ds K           (dq kernel: one token, a block of heads, all keys)
  dK  = sm_scale ds^T Q + (f p)^T dO  (dkv kernel: one token, a block of keys, all heads)

Two kernels, each recomputing ``s`` and ``dp`` (1.4x the FLOPs of one pass), because
``dK`` leaves by float32 atomics into ``dkv[idx]`` and atomics, not FLOPs, bound this
kernel on an H100 (about 1e11 scalar adds a second): summing ``dK`` over every head in
registers before the one atomic add per (token, key, column) cuts them 8x against a
kernel that owns 16 heads. A sorted segment sum would first write every (token, key)
row (``s_q * topk * d_qk`` float32: 19 GB at the V3.2 shape) and read them back.
Duplicate indices add; invalid or masked indices add nothing. Columns are taken in
pieces of at most 128.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla._common import LOG2E, cdiv, next_pow2
from jax_mla.sparse_mla.triton import MIN_TILE, col_iota, gather_rows

PIECE = 128  # widest column piece


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Triton sparse MLA backward (results do not depend on it, up to the
  order of float32 atomic adds). ``dq`` kernel: ``dq_block_h`` heads per program,
  ``dq_block_k`` rows per step; ``dkv`` kernel: ``dkv_block_k`` rows per program, its
  heads taken ``dkv_block_h`` at a time."""
  dq_block_h: int = 32
  dq_block_k: int = 32
  dkv_block_h: int = 16
  dkv_block_k: int = 32
  num_warps: int = 4
  num_stages: int = 1


def _pieces(d: int) -> tuple[tuple[int, int], ...]:
  """``(col, width)`` pieces of ``d`` columns, at most ``PIECE`` wide, powers of two."""
  out, col = [], 0
  while col < d:
    w = min(PIECE, 1 << ((d - col).bit_length() - 1))
    out.append((col, w))
    col += w
  return tuple(out)


def _dot_t(a, b):
  """``a^T b`` with float32 accumulation (``a[k, m]``, ``b[k, n]`` -> ``[m, n]``)."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nt(a, b):
  """``a b^T`` with float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _add_rows(ref, rows, valid, col: int, val, *, row_by_row: bool):
  """``ref[rows, col:col + w] += val`` by float32 atomics where ``valid``; duplicate rows add.

  ``row_by_row`` (interpret mode): the interpreter's discharge of a gathered atomic
  add stores ``old + val`` per index, so duplicates within one call would keep only
  one of their adds, and it takes no mask; there each row is added on its own, the
  invalid ones into the spare last row of ``ref``.
  """
  w = val.shape[1]
  if not row_by_row:
    plgpu.atomic_add(ref, (rows[:, None], col_iota(col, w)), val,
                     mask=jnp.broadcast_to(valid[:, None], val.shape))
    return
  rows = jnp.where(valid, rows, ref.shape[0] - 1)
  for r in range(val.shape[0]):
    plgpu.atomic_add(ref, (rows[r], pl.ds(col, w)), val[r])


def _load_heads(t, h0, block_h, h_q, pieces, v_ids, q_ref, g_ref, lse_ref, coef_ref, bias_ref):
  """One token's heads ``h0 .. h0 + block_h``: q and dO pieces, lse (base 2), f, b.
  Absent heads get lse = +inf (so p = 0: they add nothing)."""
  heads = pl.ds(h0, block_h)
  ok = h0 + jnp.arange(block_h, dtype=jnp.int32) < h_q
  qs = [plgpu.load(q_ref.at[t, heads, pl.ds(c, w)], mask=ok[:, None], other=0)
        for c, w in pieces]
  gs = [plgpu.load(g_ref.at[t, heads, pl.ds(pieces[i][0], pieces[i][1])], mask=ok[:, None],
                   other=0) for i in v_ids]
  lse2 = plgpu.load(lse_ref.at[t, heads], mask=ok, other=jnp.inf) * LOG2E
  coef = plgpu.load(coef_ref.at[t, heads], mask=ok, other=0.0)
  bias = plgpu.load(bias_ref.at[t, heads], mask=ok, other=0.0)
  return ok, qs, gs, lse2, coef, bias


def _keys(t, start, block_k, length, kv_ref, idx_ref, pieces):
  """Rows ``start .. start + block_k`` of token ``t``'s indices: (idx, valid, K pieces)."""
  in_range = start + jnp.arange(block_k, dtype=jnp.int32) < length
  idx = plgpu.load(idx_ref.at[t, pl.ds(start, block_k)], mask=in_range, other=-1)
  valid = in_range & (idx >= 0) & (idx < kv_ref.shape[0])
  ks = [gather_rows(kv_ref, jnp.where(valid, idx, 0), valid, c, w) for c, w in pieces]
  return idx, valid, ks


def _ds(heads, ks, valid, v_ids, sm_scale):
  """``(sm_scale ds, f p)`` bf16 ``[heads, keys]`` recomputed from the saved lse."""
  _, qs, gs, lse2, coef, bias = heads
  s = sum(_dot_nt(qp, kp) for qp, kp in zip(qs, ks, strict=True))
  p = jnp.where(valid[None, :], jnp.exp2(s * (sm_scale * LOG2E) - lse2[:, None]), 0.0)
  dp = sum(_dot_nt(g, ks[j]) for g, j in zip(gs, v_ids, strict=True))
  ds = sm_scale * p * (coef[:, None] * dp + bias[:, None])
  return ds.astype(jnp.bfloat16), (coef[:, None] * p).astype(jnp.bfloat16)


def _dq_kernel(q_ref, kv_ref, idx_ref, len_ref, g_ref, lse_ref, coef_ref, bias_ref, dq_ref, *,
               h_q, block_h, block_k, d_v, sm_scale):
  """One token, ``block_h`` heads: ``dq += sm_scale ds K`` over its keys."""
  pieces = _pieces(kv_ref.shape[1])
  v_ids = [i for i, (c, w) in enumerate(pieces) if c + w <= d_v]
  t, h0 = pl.program_id(0), pl.program_id(1) * block_h
  heads = _load_heads(t, h0, block_h, h_q, pieces, v_ids, q_ref, g_ref, lse_ref, coef_ref,
                      bias_ref)
  length = jnp.clip(len_ref[t], 0, idx_ref.shape[1])

  def body(i, dqs):
    _, valid, ks = _keys(t, i * block_k, block_k, length, kv_ref, idx_ref, pieces)
    ds, _ = _ds(heads, ks, valid, v_ids, sm_scale)
    return tuple(dq + jnp.dot(ds, kp, preferred_element_type=jnp.float32)
                 for dq, kp in zip(dqs, ks, strict=True))

  dqs = tuple(jnp.zeros((block_h, w), jnp.float32) for _, w in pieces)
  dqs = lax.fori_loop(0, cdiv(length, block_k), body, dqs)
  for dq, (c, w) in zip(dqs, pieces, strict=True):
    plgpu.store(dq_ref.at[t, pl.ds(h0, block_h), pl.ds(c, w)], dq.astype(dq_ref.dtype),
                mask=heads[0][:, None])


def _dkv_kernel(q_ref, kv_ref, idx_ref, len_ref, g_ref, lse_ref, coef_ref, bias_ref, _,
                dkv_ref, *, h_q, block_h, block_k, d_v, sm_scale, row_by_row):
  """One token, ``block_k`` of its keys, every head: ``dK = sm_scale ds^T Q + (f p)^T dO``
  summed over the heads in registers, then added into ``dkv[idx]`` once."""
  pieces = _pieces(kv_ref.shape[1])
  v_ids = [i for i, (c, w) in enumerate(pieces) if c + w <= d_v]
  t, start = pl.program_id(0), pl.program_id(1) * block_k
  length = jnp.clip(len_ref[t], 0, idx_ref.shape[1])
  idx, valid, ks = _keys(t, start, block_k, length, kv_ref, idx_ref, pieces)

  def body(hb, dks):
    heads = _load_heads(t, hb * block_h, block_h, h_q, pieces, v_ids, q_ref, g_ref, lse_ref,
                        coef_ref, bias_ref)
    ds, fp = _ds(heads, ks, valid, v_ids, sm_scale)
    qs, gs = heads[1], heads[2]
    out = []
    for j, dk in enumerate(dks):
      dk += _dot_t(ds, qs[j])
      if j in v_ids:
        dk += _dot_t(fp, gs[v_ids.index(j)])
      out.append(dk)
    return tuple(out)

  dks = tuple(jnp.zeros((block_k, w), jnp.float32) for _, w in pieces)
  # A block past the token's length has nothing to add.
  num_blocks = lax.select(start < length, jnp.int32(cdiv(h_q, block_h)), jnp.int32(0))
  dks = lax.fori_loop(jnp.int32(0), num_blocks, body, dks)
  for dk, (c, _) in zip(dks, pieces, strict=True):
    _add_rows(dkv_ref, idx, valid, c, dk, row_by_row=row_by_row)


def _operands_and_params(q, kv, indices, lengths, d_out, lse, coef, bias, sm_scale, d_v,
                         config):
  operands = (q, kv, indices, lengths, d_out, lse, coef, bias)
  params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  return operands, params, dict(h_q=q.shape[1], d_v=d_v, sm_scale=float(sm_scale))


def sparse_prefill_dq(q, kv, indices, lengths, d_out, lse, coef, bias, *, sm_scale: float,
                      d_v: int, config: Config, interpret: bool = False):
  """bf16 ``dq[s_q, h_q, d_qk]`` of sparse prefill (arguments: :func:`sparse_prefill_bwd`)."""
  operands, params, common = _operands_and_params(q, kv, indices, lengths, d_out, lse, coef,
                                                  bias, sm_scale, d_v, config)
  s_q, h_q, _ = q.shape
  block_h = max(MIN_TILE, min(config.dq_block_h, next_pow2(h_q)))
  return pl.pallas_call(
      functools.partial(_dq_kernel, block_h=block_h, block_k=config.dq_block_k, **common),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(s_q, cdiv(h_q, block_h)),
      compiler_params=params, interpret=interpret, name="sparse_mla_bwd_dq")(*operands)


def sparse_prefill_dkv(q, kv, indices, lengths, d_out, lse, coef, bias, *, sm_scale: float,
                       d_v: int, config: Config, interpret: bool = False):
  """float32 ``dkv[s_kv, d_qk]`` of sparse prefill (arguments: :func:`sparse_prefill_bwd`)."""
  operands, params, common = _operands_and_params(q, kv, indices, lengths, d_out, lse, coef,
                                                  bias, sm_scale, d_v, config)
  s_q, h_q, d_qk = q.shape
  topk = indices.shape[1]
  block_h = max(MIN_TILE, min(config.dkv_block_h, next_pow2(h_q)))
  dkv0 = jnp.zeros((kv.shape[0] + 1, d_qk), jnp.float32)  # + the interpreter's spare row
  dkv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_h=block_h, block_k=config.dkv_block_k,
                        row_by_row=interpret, **common),
      out_shape=jax.ShapeDtypeStruct(dkv0.shape, jnp.float32),
      grid=(s_q, cdiv(topk, config.dkv_block_k)), input_output_aliases={8: 0},
      compiler_params=params, interpret=interpret, name="sparse_mla_bwd_dkv")(*operands, dkv0)
  return dkv[:-1]


def sparse_prefill_bwd(q, kv, indices, lengths, d_out, lse, coef, bias, *, sm_scale: float,
                       d_v: int, config: Config, interpret: bool = False):
  """``(dq bf16 [s_q, h_q, d_qk], dkv float32 [s_kv, d_qk])`` of sparse prefill.

  ``q``, ``kv``, ``indices``, ``lengths`` as the forward's; ``d_out`` bf16 ``[s_q, h_q,
  d_v]``; ``lse``, ``coef``, ``bias`` float32 ``[s_q, h_q]``: the forward's ``lse`` and
  ``ds = p (coef dp + bias)`` per head (``coef`` the sink factor ``f``, ``bias = c - f
  g.out`` with ``c`` the cotangent of ``lse``).
  """
  args = (q, kv, indices, lengths, d_out, lse, coef, bias)
  kwargs = dict(sm_scale=sm_scale, d_v=d_v, config=config, interpret=interpret)
  return sparse_prefill_dq(*args, **kwargs), sparse_prefill_dkv(*args, **kwargs)
