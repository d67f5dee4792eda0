"""Pallas (Triton) sparse MLA kernel: gathered keys, one online softmax.

MLA has a single latent KV head shared by every query head, so one program owns
one query token and a block of ``block_h`` heads, gathers ``block_k`` key rows per
step by index (``ref[idx, cols]``, masked so invalid slots are never read), and
serves all of its heads from that one gather: ``S = Q K^T`` (fp32 accumulation),
an online base-2 softmax, ``acc += P V`` with V the first ``d_v`` columns of the
same rows. Key sets ("sources") are looped one after another with the same
softmax state, which is how decode attends to a main and an extra cache at once.

Triton arrays need power-of-two sizes, so every row is handled as a list of
column pieces (576 = 512 NoPE + 64 RoPE; the fp8 formats split the NoPE further
at their scale groups, see ``decode_pallas``). The score is the sum of one dot
per piece, and V is the pieces that lie inside the first ``d_v`` columns.

This module holds the kernel and the bf16 source (rows stored as bf16, used by
prefill and by decode with ``kv_cache_dtype="auto"``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_mla._common import LN2, LOG2E, cdiv, next_pow2

MIN_TILE = 16  # smallest Triton dot tile


@dataclasses.dataclass(frozen=True)
class KVSource:
  """One gathered key set, as the kernel sees it.

  Attributes:
    pieces: ``(col, width)`` column pieces of a row (powers of two); q is split the
      same way and the score is the sum of one dot per piece.
    num_slots: indices outside ``[0, num_slots)`` are invalid (masked, never read).
    load: ``load(kv_refs, slots, valid) -> [bf16 [block_k, width] per piece]``;
      ``slots`` are in range (0 where invalid) and rows where ``valid`` is False
      must come back as zeros without being read.
    num_refs: how many arrays (views of the cache) ``load`` reads.
  """
  pieces: tuple[tuple[int, int], ...]
  num_slots: int
  load: Callable
  num_refs: int


def col_iota(col: int, width: int) -> jax.Array:
  """``[1, width]`` column indices ``col .. col + width - 1`` for a 2-D gather."""
  return col + lax.broadcasted_iota(jnp.int32, (1, width), 1)


def gather_rows(ref, rows, valid, col, width):
  """Loads ``ref[rows, col:col + width]``; rows where ``valid`` is False read nothing, give 0."""
  return plgpu.load(ref.at[rows[:, None], col_iota(col, width)], mask=valid[:, None], other=0)


def bf16_pieces(d_qk: int) -> tuple[tuple[int, int], ...]:
  """576 -> NoPE 512 + RoPE 64; 512 -> one piece."""
  if d_qk == 576:
    return ((0, 512), (512, 64))
  if d_qk == 512:
    return ((0, 512),)
  raise ValueError(f"d_qk must be 576 or 512; got {d_qk}")


def bf16_source(num_slots: int, d_qk: int) -> KVSource:
  """Rows of a bf16 ``[num_slots, d_qk]`` array (prefill kv, or a flattened bf16 cache)."""
  pieces = bf16_pieces(d_qk)

  def load(kv_refs, slots, valid):
    (kv_ref,) = kv_refs
    return [gather_rows(kv_ref, slots, valid, c, w) for c, w in pieces]

  return KVSource(pieces=pieces, num_slots=num_slots, load=load, num_refs=1)


def _sparse_mla_kernel(*refs, sources: Sequence[KVSource], topks: Sequence[int], h_q: int,
                       block_h: int, block_k: int, num_h_blocks: int, d_v: int,
                       scale_log2: float, has_sink: bool):
  q_ref = refs[0]
  o_ref, ml_ref, lse_ref = refs[-3:]
  pos = 1
  sets = []
  for src in sources:
    sets.append((src, refs[pos], refs[pos + 1], refs[pos + 2:pos + 2 + src.num_refs]))
    pos += 2 + src.num_refs
  sink_ref = refs[pos] if has_sink else None

  pid = pl.program_id(0)
  t = pid // num_h_blocks  # head blocks of one token run side by side: they share the gathers
  h0 = (pid % num_h_blocks) * block_h
  head_ok = h0 + jnp.arange(block_h, dtype=jnp.int32) < h_q
  pieces = sources[0].pieces
  qs = [plgpu.load(q_ref.at[t, pl.ds(h0, block_h), pl.ds(c, w)], mask=head_ok[:, None], other=0)
        for c, w in pieces]
  v_ids = [i for i, (c, w) in enumerate(pieces) if c + w <= d_v]

  m = jnp.full((block_h,), -jnp.inf, jnp.float32)
  l = jnp.zeros((block_h,), jnp.float32)
  accs = tuple(jnp.zeros((block_h, pieces[i][1]), jnp.float32) for i in v_ids)
  carry = (m, l, accs)
  for (src, idx_ref, len_ref, kv_refs), topk in zip(sets, topks, strict=True):
    length = jnp.clip(len_ref[t], 0, topk)

    def body(i, carry, src=src, idx_ref=idx_ref, kv_refs=kv_refs, length=length):
      m, l, accs = carry
      start = i * block_k
      in_range = start + jnp.arange(block_k, dtype=jnp.int32) < length
      idx = plgpu.load(idx_ref.at[t, pl.ds(start, block_k)], mask=in_range, other=-1)
      valid = in_range & (idx >= 0) & (idx < src.num_slots)
      ks = src.load(kv_refs, jnp.where(valid, idx, 0), valid)
      s = None
      for qp, kp in zip(qs, ks, strict=True):
        d = lax.dot_general(qp, kp, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = d if s is None else s + d
      s = jnp.where(valid[None, :], s * scale_log2, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no (-inf) - (-inf)
      alpha = jnp.exp2(m - m_use)
      p = jnp.exp2(s - m_use[:, None])
      l = l * alpha + jnp.sum(p, axis=1)
      pb = p.astype(jnp.bfloat16)
      accs = tuple(
          a * alpha[:, None] + jnp.dot(pb, ks[j], preferred_element_type=jnp.float32)
          for a, j in zip(accs, v_ids, strict=True))
      return m_new, l, accs

    carry = lax.fori_loop(0, (length + block_k - 1) // block_k, body, carry)
  m, l, accs = carry

  empty = l == 0.0  # a valid key contributes exp2(0) = 1 at the row max
  lse2 = m + jnp.log2(jnp.where(empty, 1.0, l))
  scale = 1.0 / jnp.where(empty, 1.0, l)
  if has_sink:
    sink = plgpu.load(sink_ref.at[pl.ds(h0, block_h)], mask=head_ok, other=-jnp.inf)
    # out *= exp(lse) / (exp(lse) + exp(sink)); sink=+inf -> 0, -inf -> 1.
    scale = scale / (1.0 + jnp.exp2(sink * LOG2E - lse2))
  scale = jnp.where(empty, 0.0, scale)
  for a, j in zip(accs, v_ids, strict=True):
    c, w = pieces[j]
    plgpu.store(o_ref.at[t, pl.ds(h0, block_h), pl.ds(c, w)],
                (a * scale[:, None]).astype(o_ref.dtype), mask=head_ok[:, None])
  plgpu.store(ml_ref.at[t, pl.ds(h0, block_h)], m * LN2, mask=head_ok)
  plgpu.store(lse_ref.at[t, pl.ds(h0, block_h)], jnp.where(empty, jnp.inf, lse2 * LN2),
              mask=head_ok)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tuning knobs of the sparse MLA kernel (static).

  ``block_h`` query heads per program (the fp32 accumulator ``[block_h, 512]``
  must fit in registers: 64 with 8 warps), ``block_k`` gathered rows per step.
  """
  block_h: int = 64
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 2


def run_sparse_mla(q: jax.Array, sets: Sequence[tuple[KVSource, jax.Array, jax.Array,
                                                      Sequence[jax.Array]]],
                   attn_sink: jax.Array | None, *, sm_scale: float, d_v: int,
                   config: KernelConfig, interpret: bool):
  """Runs the kernel over query tokens ``q[T, h_q, d_qk]`` and key sets sharing one softmax.

  Each set is ``(source, indices[T, topk] int32, lengths[T] int32, kv_views)``; indices
  at positions ``>= lengths[t]`` are ignored. Returns ``(out bf16[T, h_q, d_v],
  max_logits f32[T, h_q], lse f32[T, h_q])``, natural-log statistics.
  """
  num_tokens, h_q, _ = q.shape
  block_h = max(MIN_TILE, min(config.block_h, next_pow2(h_q)))
  num_h_blocks = cdiv(h_q, block_h)
  pieces = sets[0][0].pieces
  if any(src.pieces != pieces for src, *_ in sets):
    raise ValueError("all key sets must share one row layout")
  operands = [q]
  for _, idx, lengths, views in sets:
    operands += [idx, lengths, *views]
  if attn_sink is not None:
    operands.append(attn_sink)
  kernel = functools.partial(
      _sparse_mla_kernel, sources=tuple(s[0] for s in sets),
      topks=tuple(s[1].shape[1] for s in sets), h_q=h_q, block_h=block_h,
      block_k=config.block_k, num_h_blocks=num_h_blocks, d_v=d_v,
      scale_log2=float(sm_scale) * LOG2E, has_sink=attn_sink is not None)
  out_shape = (jax.ShapeDtypeStruct((num_tokens, h_q, d_v), jnp.bfloat16),
               jax.ShapeDtypeStruct((num_tokens, h_q), jnp.float32),
               jax.ShapeDtypeStruct((num_tokens, h_q), jnp.float32))
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(num_tokens * num_h_blocks,),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret, name="sparse_mla")(*operands)


# Best measured on an H100 (benchmarks/bench_sparse_mla.py): 217 TFLOP/s on the V3.2 row
# vs 208 with 2 stages; 16 warps, block_k 32 and block_h 128 were slower or did not fit.
PREFILL_CONFIG = KernelConfig(num_stages=3)


def sparse_mla_prefill_pallas(q, kv, indices, attn_sink, topk_length, *, sm_scale: float,
                              d_v: int, config: KernelConfig = PREFILL_CONFIG,
                              interpret: bool = False):
  """Sparse prefill on the kernel; shapes already validated and squeezed.

  ``q[s_q, h_q, d_qk]`` bf16, ``kv[s_kv, d_qk]`` bf16, ``indices[s_q, topk]`` int32,
  ``topk_length`` int32 ``[s_q]`` or None.
  """
  s_q, topk = indices.shape
  lengths = (jnp.full((s_q,), topk, jnp.int32) if topk_length is None else topk_length)
  src = bf16_source(kv.shape[0], kv.shape[1])
  return run_sparse_mla(q, [(src, indices, lengths, (kv,))], attn_sink, sm_scale=sm_scale,
                        d_v=d_v, config=config, interpret=interpret)
