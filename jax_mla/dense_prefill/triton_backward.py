"""Pallas Triton backward of ``mla_prefill``: a ``dk, dv`` kernel and a ``dq`` kernel.

FlashAttention-2's recompute scheme on the packed varlen layout. With ``p = exp(s -
lse)`` recomputed from the forward's ``lse`` and ``b = c - rowsum(dO * out)`` per query
and head (``c`` the cotangent of ``lse``, taken in XLA before the kernels)::

  dp = dO V^T;  ds = p (dp + b);  dq = sm_scale ds K;  dk = sm_scale ds^T Q;  dv = p^T dO

The ``dk, dv`` kernel owns ``block_k`` keys of one sequence and head and loops over the
query blocks that see them; the ``dq`` kernel owns ``block_q`` queries and loops over the
visible key blocks, as the forward does. Each writes its rows once: no atomics. Only
blocks on the causal diagonal are masked; rows past a sequence's end load as zero (and
``lse`` as ``+inf``), so they add nothing. Rows no program writes (tokens past
``cu_seqlens[-1]``) keep the zeros the outputs start from. The q/k head (192) is taken as
a power-of-two main part and rest (128 + 64), as in the forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla._common import LOG2E, cdiv, check_power_of_two, next_pow2
from jax_mla.dense_prefill.layout import seq_info
from jax_mla.dense_prefill.triton import MIN_TILE, dot, split_head_dim


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Triton ``mla_prefill`` backward (changes no result beyond rounding):
  the ``dk, dv`` kernel's key and query blocks, the ``dq`` kernel's query and key blocks,
  warps and pipeline stages of both. The defaults won an H100 sweep at 8 x 4096, H 128
  (benchmarks/RESULTS.md); 4 stages or 128 x 128 tiles exceed shared memory there."""
  dkv_block_k: int = 128
  dkv_block_q: int = 64
  dq_block_q: int = 128
  dq_block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    for field in ("dkv_block_k", "dkv_block_q", "dq_block_q", "dq_block_k"):
      check_power_of_two(f"Config.{field}", getattr(self, field), MIN_TILE)


def _load_rows(ref, start, n, ok, cols=None, other=0.0):
  """``ref[start:start + n, cols]`` with rows not ``ok`` as ``other``."""
  idx = pl.ds(start, n) if cols is None else (pl.ds(start, n), pl.ds(*cols))
  return plgpu.load(ref.at[idx], mask=ok[:, None] if len(ref.shape) > 1 else ok, other=other)


def _store_rows(ref, start, ok, val, cols=None):
  idx = pl.ds(start, val.shape[0]) if cols is None else (pl.ds(start, val.shape[0]),
                                                          pl.ds(*cols))
  plgpu.store(ref.at[idx], val.astype(ref.dtype), mask=ok[:, None])


def _dkv_kernel(info_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, b_ref, dk0_ref, dv0_ref,
                dk_ref, dv_ref, *, sm_scale, causal, block_k, block_q, d_main, d_rest):
  del dk0_ref, dv0_ref  # the zeros dk_ref / dv_ref start from
  q_start, len_q = info_ref[0], info_ref[1]
  k_start, len_k = info_ref[2], info_ref[3]
  k0 = pl.program_id(0) * block_k
  d_v = v_ref.shape[-1]

  @pl.when(k0 < len_k)
  def _():
    cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
    cols_ok = cols < len_k
    k_main = _load_rows(k_ref, k_start + k0, block_k, cols_ok, (0, d_main))
    k_rest = _load_rows(k_ref, k_start + k0, block_k, cols_ok, (d_main, d_rest)) if d_rest \
        else None
    v = _load_rows(v_ref, k_start + k0, block_k, cols_ok)
    scale = sm_scale * LOG2E
    row_ids = jnp.arange(block_q, dtype=jnp.int32)
    shift = len_k - len_q  # bottom-right causal: row i sees keys j <= i + shift

    def step(qb, carry, masked):
      dk_main, dk_rest, dv = carry
      rows = qb * block_q + row_ids
      rows_ok = rows < len_q
      q0 = q_start + qb * block_q
      q_main = _load_rows(q_ref, q0, block_q, rows_ok, (0, d_main))
      do = _load_rows(do_ref, q0, block_q, rows_ok)
      lse = _load_rows(lse_ref, q0, block_q, rows_ok, other=jnp.inf) * LOG2E
      b = _load_rows(b_ref, q0, block_q, rows_ok)
      s_t = dot(k_main, q_main, trans_b=True)  # [keys, queries]
      if d_rest:
        q_rest = _load_rows(q_ref, q0, block_q, rows_ok, (d_main, d_rest))
        s_t += dot(k_rest, q_rest, trans_b=True)
      p_t = jnp.exp2(s_t * scale - lse[None, :])
      if masked:
        p_t = jnp.where(cols[:, None] <= rows[None, :] + shift, p_t, 0.0)
      dv += dot(p_t.astype(do.dtype), do)
      ds_t = (p_t * (dot(v, do, trans_b=True) + b[None, :])).astype(q_main.dtype)
      dk_main += dot(ds_t, q_main)
      if d_rest:
        dk_rest += dot(ds_t, q_rest)
      return dk_main, dk_rest, dv

    n_q = cdiv(len_q, block_q)
    if causal:
      # Query blocks before first_qb see none of these keys; from full_qb on, all of them.
      first_qb = lax.div(jnp.maximum(k0 - shift, 0), block_q)
      full_qb = jnp.clip(cdiv(k0 + block_k - 1 - shift, block_q), first_qb, n_q)
    else:
      first_qb = full_qb = jnp.int32(0)
    carry = (jnp.zeros((block_k, d_main), jnp.float32),
             jnp.zeros((block_k, max(d_rest, MIN_TILE)), jnp.float32),
             jnp.zeros((block_k, d_v), jnp.float32))
    carry = lax.fori_loop(first_qb, full_qb, functools.partial(step, masked=True), carry)
    dk_main, dk_rest, dv = lax.fori_loop(full_qb, n_q, functools.partial(step, masked=False),
                                         carry)
    _store_rows(dk_ref, k_start + k0, cols_ok, dk_main * sm_scale, (0, d_main))
    if d_rest:
      _store_rows(dk_ref, k_start + k0, cols_ok, dk_rest * sm_scale, (d_main, d_rest))
    _store_rows(dv_ref, k_start + k0, cols_ok, dv)


def _dq_kernel(info_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, b_ref, dq0_ref, dq_ref, *,
               sm_scale, causal, block_q, block_k, d_main, d_rest):
  del dq0_ref  # the zeros dq_ref starts from
  q_start, len_q = info_ref[0], info_ref[1]
  k_start, len_k = info_ref[2], info_ref[3]
  # The heaviest causal blocks (the last queries) launch first, as in the forward.
  row0 = (pl.num_programs(0) - 1 - pl.program_id(0)) * block_q

  @pl.when(row0 < len_q)
  def _():
    rows = row0 + jnp.arange(block_q, dtype=jnp.int32)
    rows_ok = rows < len_q
    q_main = _load_rows(q_ref, q_start + row0, block_q, rows_ok, (0, d_main))
    q_rest = _load_rows(q_ref, q_start + row0, block_q, rows_ok, (d_main, d_rest)) if d_rest \
        else None
    do = _load_rows(do_ref, q_start + row0, block_q, rows_ok)
    lse = _load_rows(lse_ref, q_start + row0, block_q, rows_ok, other=jnp.inf) * LOG2E
    b = _load_rows(b_ref, q_start + row0, block_q, rows_ok)
    scale = sm_scale * LOG2E
    col_ids = jnp.arange(block_k, dtype=jnp.int32)
    shift = len_k - len_q

    def step(kb, carry, masked):
      dq_main, dq_rest = carry
      cols = kb * block_k + col_ids
      cols_ok = cols < len_k  # keys past the end load as zero: ds K adds nothing
      k_main = _load_rows(k_ref, k_start + kb * block_k, block_k, cols_ok, (0, d_main))
      s = dot(q_main, k_main, trans_b=True)
      if d_rest:
        k_rest = _load_rows(k_ref, k_start + kb * block_k, block_k, cols_ok, (d_main, d_rest))
        s += dot(q_rest, k_rest, trans_b=True)
      p = jnp.exp2(s * scale - lse[:, None])
      if masked:
        p = jnp.where(cols[None, :] <= rows[:, None] + shift, p, 0.0)
      v = _load_rows(v_ref, k_start + kb * block_k, block_k, cols_ok)
      ds = (p * (dot(do, v, trans_b=True) + b[:, None])).astype(k_main.dtype)
      dq_main += dot(ds, k_main)
      if d_rest:
        dq_rest += dot(ds, k_rest)
      return dq_main, dq_rest

    if causal:  # blocks before n_full are seen by every row, the rest up to n_all masked
      n_full = lax.div(jnp.clip(row0 + shift + 1, 0, len_k), block_k)
      n_all = cdiv(jnp.clip(row0 + block_q + shift, 0, len_k), block_k)
    else:  # keys past the end load as zero: no mask needed
      n_full = n_all = cdiv(len_k, block_k)
    carry = (jnp.zeros((block_q, d_main), jnp.float32),
             jnp.zeros((block_q, max(d_rest, MIN_TILE)), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    dq_main, dq_rest = lax.fori_loop(n_full, jnp.maximum(n_all, n_full),
                                     functools.partial(step, masked=True), carry)
    _store_rows(dq_ref, q_start + row0, rows_ok, dq_main * sm_scale, (0, d_main))
    if d_rest:
      _store_rows(dq_ref, q_start + row0, rows_ok, dq_rest * sm_scale, (d_main, d_rest))


def row_term(out, lse, d_out, d_lse):
  """``b = d_lse - rowsum(dO * out)`` float32 ``[Tq, H]``, 0 where ``lse`` is ``+inf`` (no
  key: ``p = 0``, b unused)."""
  b = d_lse - jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  return jnp.where(jnp.isfinite(lse), b, 0.0)


def mla_prefill_bwd(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, d_out, d_lse, *,
                    max_seqlen_q: int, max_seqlen_k: int, sm_scale: float, causal: bool,
                    config: Config, interpret: bool = False):
  """``(dq, dk, dv)`` of ``mla_prefill`` in the dtypes of ``q, k, v`` (``lse``, ``d_lse``
  token-major float32 ``[Tq, H]``)."""
  num_q_tokens, num_heads, d_qk = q.shape
  num_k_tokens, d_v = k.shape[0], v.shape[-1]
  zeros = lambda x: jnp.zeros_like(x)  # noqa: E731
  if num_q_tokens == 0 or num_k_tokens == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
    return zeros(q), zeros(k), zeros(v)
  d_main, d_rest = split_head_dim(d_qk)
  num_seqs = cu_seqlens_q.shape[0] - 1
  info = seq_info(cu_seqlens_q, cu_seqlens_k, num_q_tokens)[:num_seqs]
  b = row_term(out, lse, d_out, d_lse)
  cap_q, cap_k = next_pow2(max_seqlen_q), next_pow2(max_seqlen_k)
  params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  common = dict(sm_scale=float(sm_scale), causal=causal, d_main=d_main, d_rest=d_rest)

  def per_head(shape, rows):  # a [T, H, d] / [T, H] operand seen one head at a time
    return (pl.BlockSpec((rows, None, shape), lambda i, h, s: (0, h, 0)) if shape else
            pl.BlockSpec((rows, None), lambda i, h, s: (0, h)))

  in_specs = [pl.BlockSpec((None, 4), lambda i, h, s: (s, 0)), per_head(d_qk, num_q_tokens),
              per_head(d_qk, num_k_tokens), per_head(d_v, num_k_tokens),
              per_head(d_v, num_q_tokens), per_head(None, num_q_tokens),
              per_head(None, num_q_tokens)]
  operands = (info, q, k, v, d_out.astype(q.dtype), lse, b)

  block_k = max(MIN_TILE, min(config.dkv_block_k, cap_k))
  block_q = max(MIN_TILE, min(config.dkv_block_q, cap_q))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_k=block_k, block_q=block_q, **common),
      grid=(cdiv(max_seqlen_k, block_k), num_heads, num_seqs),
      in_specs=in_specs + [per_head(d_qk, num_k_tokens), per_head(d_v, num_k_tokens)],
      out_specs=[per_head(d_qk, num_k_tokens), per_head(d_v, num_k_tokens)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      input_output_aliases={7: 0, 8: 1}, compiler_params=params, interpret=interpret,
      name="mla_prefill_bwd_dkv")(*operands, zeros(k), zeros(v))

  block_q = max(MIN_TILE, min(config.dq_block_q, cap_q))
  block_k = max(MIN_TILE, min(config.dq_block_k, cap_k))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_q=block_q, block_k=block_k, **common),
      grid=(cdiv(max_seqlen_q, block_q), num_heads, num_seqs),
      in_specs=in_specs + [per_head(d_qk, num_q_tokens)],
      out_specs=per_head(d_qk, num_q_tokens),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      input_output_aliases={7: 0}, compiler_params=params, interpret=interpret,
      name="mla_prefill_bwd_dq")(*operands, zeros(q))
  return dq, dk, dv
