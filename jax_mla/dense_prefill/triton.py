"""Pallas Triton varlen flash-attention forward with d_qk != d_v.

Grid ``(q block within sequence, head, sequence + 1)``. Each program owns
``block_q`` query rows of one sequence and one head, loops over the key blocks of
the same sequence with the online base-2 softmax of :mod:`jax_mla._softmax`, and
writes ``out`` and the natural-log LSE (token-major ``[Tq, H]``). Key blocks fully
visible to every row run without masks; only the blocks on the causal diagonal or
past the sequence end are masked.

Triton arrays need power-of-two sizes, so the q/k head (192 for DeepSeek) is
split into a power-of-two main part and a power-of-two rest (128 + 64) and the
score is the sum of two dots. The extra last grid slot writes ``out = 0`` and
``lse = +inf`` for tokens past ``cu_seqlens_q[-1]`` so every output is defined.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla import _softmax
from jax_mla._common import LOG2E, cdiv, check_power_of_two, next_pow2
from jax_mla.dense_prefill.layout import seq_info

MIN_TILE = 16  # smallest Triton dot tile


def split_head_dim(d: int) -> tuple[int, int]:
  """Splits a q/k head size into power-of-two parts ``(main, rest)``, rest possibly 0.

  Raises ValueError when ``d`` is not a power of two or a sum of two powers of two
  each >= 16 (192 -> (128, 64), 128 -> (128, 0), 576 -> (512, 64)).
  """
  main = 1 << (max(int(d), 1).bit_length() - 1)
  rest = d - main
  if main < MIN_TILE or (rest and (rest < MIN_TILE or rest & (rest - 1))):
    raise ValueError(
        f"the Triton kernel needs a q/k head size that is a power of two or a sum of two "
        f"powers of two, each >= {MIN_TILE} (e.g. 192 = 128 + 64); got {d}")
  return main, rest


def dot(a, b, *, trans_a=False, trans_b=False):
  """``plgpu.dot``; float32 inputs get IEEE dots (Triton would use TF32), bf16/fp16 dots
  are unchanged."""
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _store_rows(o_ref, lse_ref, start, rows_ok, out, lse):
  plgpu.store(o_ref.at[pl.ds(start, out.shape[0]), :], out.astype(o_ref.dtype),
              mask=rows_ok[:, None])
  plgpu.store(lse_ref.at[pl.ds(start, out.shape[0])], lse, mask=rows_ok)


def _prefill_kernel(info_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, sm_scale, causal,
                    block_q, block_k, d_main, d_rest, num_q_blocks, num_seqs):
  qb = num_q_blocks - 1 - pl.program_id(0)  # heaviest causal blocks launch first
  seq = pl.program_id(2)
  q_start, len_q = info_ref[0], info_ref[1]
  k_start, len_k = info_ref[2], info_ref[3]
  d_v = v_ref.shape[-1]
  row_ids = jnp.arange(block_q, dtype=jnp.int32)

  @pl.when(seq == num_seqs)
  def _tail():
    # Tokens past cu_seqlens_q[-1]: out = 0, lse = +inf. Strided over the q-block axis.
    stride = num_q_blocks * block_q
    n_iter = lax.div(jnp.maximum(len_q - qb * block_q, 0) + stride - 1, stride)

    def body(j, carry):
      row0 = qb * block_q + j * stride
      _store_rows(o_ref, lse_ref, q_start + row0, row0 + row_ids < len_q,
                  jnp.zeros((block_q, d_v), jnp.float32),
                  jnp.full((block_q,), jnp.inf, jnp.float32))
      return carry

    lax.fori_loop(0, n_iter, body, jnp.int32(0))

  row0 = qb * block_q

  @pl.when((seq < num_seqs) & (row0 < len_q))
  def _attend():
    rows = row0 + row_ids
    rows_ok = rows < len_q
    # One indexer per load: the Triton lowering takes no chained `.at` views.
    q_rows = pl.ds(q_start + row0, block_q)
    q_main = plgpu.load(q_ref.at[q_rows, pl.ds(0, d_main)], mask=rows_ok[:, None], other=0.0)
    q_rest = (plgpu.load(q_ref.at[q_rows, pl.ds(d_main, d_rest)], mask=rows_ok[:, None],
                         other=0.0) if d_rest else None)
    scale = sm_scale * LOG2E  # scores in the base-2 domain: exp(x) = exp2(x * log2 e)
    col_ids = jnp.arange(block_k, dtype=jnp.int32)
    # Bottom-right causal alignment: row i sees keys j <= i + (len_k - len_q).
    shift = len_k - len_q

    def step(kb, carry, masked):
      acc, m, l = carry
      cols = kb * block_k + col_ids
      cols_ok = cols < len_k
      k_rows = pl.ds(k_start + kb * block_k, block_k)
      # Masked blocks load zeros past the sequence end: no foreign value enters a dot.
      kmask = cols_ok[:, None] if masked else None
      other = 0.0 if masked else None
      k_main = plgpu.load(k_ref.at[k_rows, pl.ds(0, d_main)], mask=kmask, other=other)
      s = dot(q_main, k_main, trans_b=True)
      if d_rest:
        k_rest = plgpu.load(k_ref.at[k_rows, pl.ds(d_main, d_rest)], mask=kmask, other=other)
        s += dot(q_rest, k_rest, trans_b=True)
      s *= scale
      ok = None
      if masked:
        ok = cols_ok[None, :]
        if causal:
          ok = ok & (cols[None, :] <= rows[:, None] + shift)
      m, l, alpha, p = _softmax.step(m, l, s, ok)
      v = plgpu.load(v_ref.at[k_rows, :], mask=kmask, other=other)
      acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
      return acc, m, l

    if causal:
      first_row_keys = jnp.minimum(len_k, row0 + shift + 1)  # keys every row sees
      last_row_keys = jnp.minimum(len_k, row0 + block_q + shift)
    else:
      first_row_keys = last_row_keys = len_k
    n_full = lax.div(jnp.maximum(first_row_keys, 0), block_k)
    n_all = lax.div(jnp.maximum(last_row_keys, 0) + block_k - 1, block_k)
    carry = (jnp.zeros((block_q, d_v), jnp.float32), *_softmax.init(block_q))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, jnp.maximum(n_all, n_full),
                              functools.partial(step, masked=True), carry)
    inv, lse = _softmax.finish(m, l)
    _store_rows(o_ref, lse_ref, q_start + row0, rows_ok, acc * inv[:, None], lse)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Triton prefill kernel (static; changes no result beyond rounding).

  The defaults were the best of a sweep on an H100 (8 x 4096 tokens, H 128, bf16):
  323 TFLOP/s causal, 355 non-causal (``benchmarks/bench_mla_prefill.py``). Tiles are
  capped at the next power of two of the longest query / all keys (>= 16).
  """
  block_q: int = 128
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    check_power_of_two("Config.block_q", self.block_q, MIN_TILE)
    check_power_of_two("Config.block_k", self.block_k, MIN_TILE)


def mla_prefill_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, sm_scale, causal,
                       config: Config, interpret=False):
  """Kernel entry (inputs already validated): ``(out[Tq, H, d_v], lse f32[Tq, H])``."""
  num_q_tokens, num_heads, d_qk = q.shape
  d_v = v.shape[-1]
  num_seqs = cu_seqlens_q.shape[0] - 1
  d_main, d_rest = split_head_dim(d_qk)
  if num_q_tokens == 0 or k.shape[0] == 0:
    return (jnp.zeros((num_q_tokens, num_heads, d_v), q.dtype),
            jnp.full((num_q_tokens, num_heads), jnp.inf, jnp.float32))
  block_q = max(MIN_TILE, min(config.block_q, next_pow2(max(max_seqlen_q, 1))))
  block_k = max(MIN_TILE, min(config.block_k, next_pow2(k.shape[0])))
  num_q_blocks = max(1, cdiv(max_seqlen_q, block_q))
  info = seq_info(cu_seqlens_q, cu_seqlens_k, num_q_tokens)

  kernel = functools.partial(
      _prefill_kernel, sm_scale=float(sm_scale), causal=causal, block_q=block_q,
      block_k=block_k, d_main=d_main, d_rest=d_rest, num_q_blocks=num_q_blocks,
      num_seqs=num_seqs)
  out, lse = pl.pallas_call(
      kernel,
      grid=(num_q_blocks, num_heads, num_seqs + 1),
      in_specs=[
          pl.BlockSpec((None, 4), lambda i, h, b: (b, 0)),
          pl.BlockSpec((num_q_tokens, None, d_qk), lambda i, h, b: (0, h, 0)),
          pl.BlockSpec((k.shape[0], None, d_qk), lambda i, h, b: (0, h, 0)),
          pl.BlockSpec((v.shape[0], None, d_v), lambda i, h, b: (0, h, 0)),
      ],
      out_specs=[
          pl.BlockSpec((num_q_tokens, None, d_v), lambda i, h, b: (0, h, 0)),
          pl.BlockSpec((num_q_tokens, None), lambda i, h, b: (0, h)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((num_q_tokens, num_heads, d_v), q.dtype),
          jax.ShapeDtypeStruct((num_q_tokens, num_heads), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="mla_prefill",
  )(info, q, k, v)
  return out, lse
