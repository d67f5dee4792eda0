"""Pallas Mosaic GPU kernels (Hopper wgmma + TMA) for ``mla_prefill``: the forward, and the
backward's ``dq`` and ``dk, dv`` kernels (FlashAttention-2's split: no atomics).

FlashAttention-3's forward on the packed varlen layout. One CTA takes 128 query rows
of one sequence and one head and three warpgroups: a producer streams the sequence's
key blocks (``K`` and ``V``, ``block_k`` rows each) into a ring of SMEM stages with
TMA; two consumers each own 64 of the rows (``S = Q K^T`` over the whole q/k head,
online softmax in base 2, ``O += P V``). The consumers take the tensor cores in turns
(a two-arrival barrier, as in JAX's ``attention_mgpu.py``): one's softmax runs while
the other's matmuls do. Only key blocks on the causal diagonal or past the sequence
end are masked; a consumer whose rows see fewer blocks than its partner's still
releases the stages it skips.

The q/k head is held as two SMEM tiles, the first ``d_v`` columns and the rest (128
+ 64 for DeepSeek), so the first one stages the output at the end. TMA into the tiled
(8 x 64) SMEM layout needs row offsets that are multiples of 8, so query tiles and key
blocks start at the sequence's offset rounded down to 8 rows and take up to 7 rows of
the previous sequence; 64-row tiles also run past a sequence's end. Hence:

- such foreign query rows compute garbage that is never stored; foreign keys are
  masked to ``-inf`` (``where``, so a NaN there never enters), and values past
  ``cu_seqlens_k[-1]`` (which may be unwritten) come from a zero-padded copy of the
  rows around it (``P = 0`` there, but ``0 * NaN`` is NaN); the values of the batch's
  other sequences are read under ``P = 0`` and must be finite;
- a consumer stores its 64 rows straight into ``out`` when they all belong to the
  sequence, else into a side buffer (a sequence's first and last tile) that the
  wrapper scatters; the LSE likewise, head-major so its tiles are contiguous;
- an extra grid slot writes ``out = 0``, ``lse = +inf`` for the tokens past
  ``cu_seqlens_q[-1]``, strided over the tile axis.

The ``dq`` kernel (``grad``) is the same machine with other consumer math: per key block
``S = Q K^T`` and ``dP = dO V^T``, ``P = exp2(S - lse)`` from the forward's LSE, ``dS = P
(dP + b)`` and ``dq += dS K`` (two accumulators, the ``d_v`` and the rest columns); the
keys past ``cu_seqlens_k[-1]`` come from a zero-padded copy as well, since ``K`` is now a
factor.

The ``dk, dv`` kernel (:func:`_dkv_kernel`) takes 64 keys of one sequence and head per
CTA, loaded once, and streams the query blocks that see them (``Q``, ``dO`` and the
rows' LSE and ``b``; rows past ``cu_seqlens_q[-1]`` from zero-padded copies, since both
are factors). Its two consumers split the work evenly instead of the rows: one computes
``S^T = K Q^T``, ``P^T`` and ``dV += P^T dO`` and hands ``P^T`` over through SMEM, the
other ``dP^T = V dO^T``, ``dS^T = P^T (dP^T + b)`` and ``dK += dS^T Q`` (one warpgroup
holding both accumulators, 64 x 320 float32, would not fit its registers).

The grid is ``(sequence + 1, head, tile)`` with the tile fastest (the last grid axis
is ``blockIdx.x``), so the CTAs of one head run together and read its keys from L2;
with ``causal`` the heaviest tiles (the last queries) go first.

Shapes: bf16 or fp16, ``d_v`` and ``d_qk - d_v`` multiples of 64 of at most 256 (``d_qk
- d_v`` may be 0). Others belong to the Triton kernel. Token counts that are not a
multiple of 8 cost a padded copy of the inputs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _mosaic, _softmax
from jax_mla._common import LN2, LOG2E, cdiv
from jax_mla.dense_prefill.layout import seq_info

ROWS = 64  # query rows per consumer warpgroup: one wgmma M
TILE = 2 * ROWS  # query rows per CTA
ALIGN = 8  # rows of the SMEM tiling: TMA row offsets are multiples of it
SMEM_BYTES = 227 * 1024  # an H100 CTA's shared memory
MIN_MEAN_LEN = 256  # mean query length from which the default prefers this kernel


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Mosaic GPU ``mla_prefill`` kernel (changes no result beyond rounding).

  Attributes:
    block_k: keys per pipeline stage (64 or 128).
    num_stages: SMEM stages of the key ring (2 to 4; 128-key stages of d 192/128 fit 2).
    consumer_registers, producer_registers: per-thread registers of each consumer
      warpgroup and of the producer (``setmaxnreg``: multiples of 8 with ``2 * consumer
      + producer == 504``, :func:`jax_mla._mosaic.register_budget` of three warpgroups).
  """
  block_k: int = 128
  num_stages: int = 2
  consumer_registers: int = 232
  producer_registers: int = 40

  def __post_init__(self):
    if self.block_k not in (64, 128):
      raise ValueError(f"Config.block_k must be 64 or 128; got {self.block_k}")
    if not 2 <= self.num_stages <= 4:
      raise ValueError(f"Config.num_stages must be 2, 3 or 4; got {self.num_stages}")
    _mosaic.check_register_split(self.consumer_registers, self.producer_registers)


def _smem_bytes(d_qk: int, d_v: int, config: Config, grad: bool = False) -> int:
  """The forward: the queries and LSE staging of both consumers plus the key ring. With
  ``grad``, the larger of the two backward kernels: ``dq`` (the forward's, with the
  consumers' dO rows and b) and ``dk, dv`` (the CTA's keys and values plus a ring of query
  blocks: Q, dO, LSE and b, and P^T)."""
  ring = config.num_stages * config.block_k * (d_qk + d_v) * 2
  if not grad:
    return 2 * ROWS * (d_qk * 2 + 4) + ring
  dq = 2 * ROWS * (d_qk * 2 + 4 + d_v * 2 + 4) + ring
  query_block = ROWS * (d_qk + d_v) * 2 + 2 * ROWS * 4 + ROWS * ROWS * 2
  return max(dq, ROWS * (d_qk + d_v) * 2 + config.num_stages * query_block)


def default_config(d_qk: int, d_v: int, grad: bool = False) -> Config | None:
  """The forward: ``Config()`` where its two 128-key stages fit shared memory (d 192/128),
  else two 64-key stages. The backward kernels (``grad``): 64-row stages (the ``dq``
  kernel's scores, dP and two dq accumulators fill the registers at 128), three where
  they fit; None where even two do not (the backward then runs on Triton)."""
  configs = [Config(block_k=64, num_stages=3)] if grad else [Config()]
  configs.append(Config(block_k=64))
  fits = [c for c in configs if _smem_bytes(d_qk, d_v, c, grad) <= SMEM_BYTES]
  return fits[0] if fits else None if grad else configs[-1]


def check_supported(q, v, config: Config | None = None):
  """Raises ``ValueError`` for inputs this kernel does not take (the Triton one does);
  ``config`` ``None``: :func:`default_config`."""
  d_qk, d_v = q.shape[-1], v.shape[-1]
  config = config or default_config(d_qk, d_v)
  why = None
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    why = f"bf16 or fp16 inputs (got {q.dtype})"
  elif d_v % 64 or not 64 <= d_v <= 256:
    why = f"a v head size that is a multiple of 64 in [64, 256] (got {d_v})"
  elif (d_qk - d_v) % 64 or not 0 <= d_qk - d_v <= 256:
    why = f"d_qk - d_v a multiple of 64 in [0, 256] (got d_qk={d_qk}, d_v={d_v})"
  elif _smem_bytes(d_qk, d_v, config) > SMEM_BYTES:
    why = (f"{config.num_stages} stages of {config.block_k} keys within 227 KiB of shared "
           f"memory at d_qk={d_qk}, d_v={d_v}")
  if why:
    raise ValueError(f"the Mosaic GPU mla_prefill kernel needs {why}; use "
                     "implementation='triton' for this input")


def check_default(q, k, v, num_seqs: int):
  """Raises ``ValueError`` where ``implementation=None`` should run Triton instead, as
  measured on an H100 (benchmarks/RESULTS.md): token counts that are not multiples of 8
  (the padded copy costs up to 2.5x) or sequences shorter than ``MIN_MEAN_LEN`` on
  average (partial tiles and side buffers dominate)."""
  check_supported(q, v)
  if q.shape[0] % ALIGN or k.shape[0] % ALIGN:
    raise ValueError(f"token counts that are multiples of {ALIGN} (got {q.shape[0]}, "
                     f"{k.shape[0]})")
  if q.shape[0] < MIN_MEAN_LEN * num_seqs:
    raise ValueError(f"sequences of {MIN_MEAN_LEN} query tokens on average (got "
                     f"{q.shape[0]} tokens in {num_seqs} sequences)")


def _origin(info_ref):
  """This CTA's ``(seq, head, wg)`` and its sequence's ``(len_q, len_k)``, with the 8-row
  aligned starts ``q8``, ``k8`` (in units of 8 rows) and the rows ``q_off``, ``k_off`` of
  the previous sequence that lead the first aligned query / key tile (the SMEM tiling
  needs TMA row offsets that are multiples of 8)."""
  seq, head, wg = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("wg")
  q_start, len_q = info_ref[seq, 0], info_ref[seq, 1]
  k_start, len_k = info_ref[seq, 2], info_ref[seq, 3]
  q8, k8 = lax.div(q_start, ALIGN), lax.div(k_start, ALIGN)
  return (seq, head, wg, len_q, len_k, q8, k8, q_start - ALIGN * q8, k_start - ALIGN * k8)


def _load_block(plgpu, src, tail, dst, bar, *, head, first8, rows, tail8, past_end, cols=None):
  """TMA of ``rows`` rows from ``8 * first8`` of ``src[:, head]`` (column range ``cols``),
  or, when ``past_end``, of the same rows of ``tail`` (:func:`_tail_rows`, first row ``8 *
  tail8``); ``tail`` None: always ``src``."""
  idx = (slice(None),) if cols is None else (pl.ds(*cols),)
  from_src = lambda: plgpu.copy_gmem_to_smem(  # noqa: E731
      src.at[(pl.ds(ALIGN * first8, rows), head) + idx], dst, bar)
  if tail is None:
    from_src()
    return
  pl.when(jnp.logical_not(past_end))(from_src)
  pl.when(past_end)(lambda: plgpu.copy_gmem_to_smem(
      tail.at[(pl.ds(ALIGN * (first8 - tail8), rows), head) + idx], dst, bar))


def _kernel(*refs, plgpu, grad, num_seqs, num_tiles, causal, scale, sm_scale, block_k,
            num_stages, registers):
  """The forward (``grad=False``) or the ``dq`` kernel (``grad=True``): the same tiles,
  key ring and stores, different consumer math."""
  if grad:
    (info_ref, end_ref, q_ref, k_ref, v_ref, k_tail_ref, v_tail_ref, do_ref, vec_ref, o_ref,
     o_side_ref, smem, barriers) = refs
    lse_ref = lse_side_ref = None
    q_a, q_b, k_a, k_b, v_s, vec_s, do_s = smem
  else:
    (info_ref, end_ref, q_ref, k_ref, v_ref, v_tail_ref, o_ref, lse_ref, o_side_ref,
     lse_side_ref, smem, barriers) = refs
    k_tail_ref = do_ref = vec_ref = do_s = None
    q_a, q_b, k_a, k_b, v_s, vec_s = smem
  q_bar, k_bar, v_bar, k_free, v_free, turn = barriers
  seq, head, wg, len_q, len_k, q8, k8, q_off, k_off = _origin(info_ref)
  d_v = q_a.shape[-1]
  d_b = 0 if q_b is None else q_b.shape[-1]
  row = _mosaic.row_layout(plgpu)
  wgmma_layout = lambda x: plgpu.layout_cast(x, plgpu.Layout.WGMMA)  # noqa: E731
  # (SMEM staging tile, its columns in the output); the forward's output has d_v columns.
  parts = [(q_a, (0, d_v))] + ([(q_b, (d_v, d_b))] if grad and d_b else [])

  def rows_of(m):
    return pl.ds(ALIGN * (q8 + m * (ROWS // ALIGN)), ROWS)

  def store(m, outs, lse):
    """This warpgroup's 64 rows, 64-row tile ``m`` from the aligned start: into the
    outputs when all are the sequence's, else into a side slot (a sequence's first or
    last tile)."""
    for (tile, _), out in zip(parts, outs, strict=True):
      tile.at[wg][...] = out.astype(tile.dtype)
    if lse is not None:
      vec_s.at[wg][...] = lse
    plgpu.commit_smem()
    i0 = m * ROWS - q_off  # the tile's first row within the sequence
    dst = rows_of(m)

    @pl.when((i0 >= 0) & (i0 + ROWS <= len_q))
    def _():
      for tile, cols in parts:
        plgpu.copy_smem_to_gmem(tile.at[wg], o_ref.at[dst, head, pl.ds(*cols)])
      if lse is not None:
        plgpu.copy_smem_to_gmem(vec_s.at[wg], lse_ref.at[head, dst])

    @pl.when(((i0 < 0) | (i0 + ROWS > len_q)) & (i0 < len_q))
    def _():
      side = jnp.where(m == 0, 0, 1)
      for tile, cols in parts:
        plgpu.copy_smem_to_gmem(tile.at[wg], o_side_ref.at[seq, side, head, :, pl.ds(*cols)])
      if lse is not None:
        plgpu.copy_smem_to_gmem(vec_s.at[wg], lse_side_ref.at[seq, side, head])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when((seq == num_seqs) & (wg < 2))  # tokens past cu_seqlens_q[-1]: out 0, lse +inf
  def _tail():
    zeros = [wgmma_layout(jnp.zeros((ROWS, cols[1]), jnp.float32)) for _, cols in parts]
    inf = None if grad else plgpu.layout_cast(jnp.full((ROWS,), jnp.inf, jnp.float32), row)

    @pl.loop(0, cdiv(len_q + q_off, TILE * num_tiles))
    def _(j):
      m = 2 * (j * num_tiles + lax.axis_index("t")) + wg
      pl.when(m * ROWS - q_off < len_q)(lambda: store(m, zeros, inf))

  # With causal, tile 0 is the last (heaviest) one.
  t = (num_tiles - 1 - lax.axis_index("t")) if causal else lax.axis_index("t")
  shift = len_k - len_q  # bottom-right causal: row i sees keys j <= i + shift

  def visible(lo, hi):
    """Key blocks seen by the sequence's rows in ``[lo, hi)`` (0 if there are none)."""
    lo, hi = jnp.maximum(lo, 0), jnp.minimum(hi, len_q)
    keys = jnp.clip(hi + shift, 0, len_k) if causal else len_k
    return jnp.where((hi > lo) & (keys > 0), cdiv(keys + k_off, block_k), 0)

  cta_rows = t * TILE - q_off
  cta_steps = visible(cta_rows, cta_rows + TILE)

  @pl.when((seq < num_seqs) & (cta_rows < len_q) & (wg < 2))
  def _consumer():
    plgpu.set_max_registers(registers[0], action="increase")
    m = 2 * t + wg
    i0 = m * ROWS - q_off
    steps = visible(i0, i0 + ROWS)
    # Blocks [first_full, full_end) are seen whole by every real row: no mask. Block 0
    # starts with the previous sequence's keys when k_off > 0.
    first_full = jnp.minimum((k_off > 0).astype(jnp.int32), steps)
    lim = jnp.clip(jnp.maximum(i0, 0) + shift + 1, 0, len_k) if causal else len_k
    full_end = jnp.clip(lax.div(lim + k_off, block_k), first_full, steps)
    src = rows_of(m)
    plgpu.copy_gmem_to_smem(q_ref.at[src, head, pl.ds(0, d_v)], q_a.at[wg], q_bar.at[wg])
    if d_b:
      plgpu.copy_gmem_to_smem(q_ref.at[src, head, pl.ds(d_v, d_b)], q_b.at[wg], q_bar.at[wg])
    if grad:  # dO rows, and the rows' base-2 LSE and b = d_lse - rowsum(dO * out)
      plgpu.copy_gmem_to_smem(do_ref.at[src, head], do_s.at[wg], q_bar.at[wg])
      for j in range(2):
        plgpu.copy_gmem_to_smem(vec_ref.at[j, head, src], vec_s.at[wg, j], q_bar.at[wg])
    plgpu.barrier_wait(q_bar.at[wg])
    if grad:
      lse2, b = (plgpu.load(vec_s.at[wg, j], (), layout=row, optimized=False) for j in range(2))

    def take_turn():
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

    rows_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 0, layout=plgpu.Layout.WGMMA)
    cols_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 1, layout=plgpu.Layout.WGMMA)

    def visible_keys(i):
      keys = i * block_k - k_off + cols_iota
      ok = (keys >= 0) & (keys < len_k)
      return ok & (keys <= i0 + rows_iota + shift) if causal else ok

    def scores(s_ref, slot):
      plgpu.wgmma(s_ref, q_a.at[wg], k_a.at[slot].transpose((1, 0)))
      if d_b:
        plgpu.wgmma(s_ref, q_b.at[wg], k_b.at[slot].transpose((1, 0)))

    def fwd_step(i, carry, masked):
      acc, m_run, l = carry
      slot = lax.rem(i, num_stages)

      def qk(s_ref):
        scores(s_ref, slot)
        take_turn()
        return s_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((ROWS, block_k), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])
      if masked:
        s = jnp.where(visible_keys(i), s, -jnp.inf)
      m_new = jnp.maximum(m_run, s.max(axis=1) * scale)
      m_use = _softmax.safe_max(m_new)
      p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
      alpha = jnp.exp2(m_run - m_use)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l = l * alpha + p.sum(axis=1)
      p = p.astype(q_a.dtype)
      plgpu.barrier_arrive(turn)  # softmax done
      plgpu.barrier_wait(v_bar.at[slot])
      plgpu.barrier_wait(turn)  # the tensor cores are ours

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_s.at[slot])

        @pl.when(i + 1 < steps)
        def _():
          plgpu.barrier_wait(k_bar.at[lax.rem(i + 1, num_stages)])

      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    def dq_step(i, acc, masked):
      # p = exp2(s - lse) from the forward's LSE; ds = p (dO V^T + b); dq += ds K.
      slot = lax.rem(i, num_stages)
      plgpu.barrier_wait(v_bar.at[slot])

      def qk_dov(s_ref, dp_ref):
        scores(s_ref, slot)
        plgpu.wgmma(dp_ref, do_s.at[wg], v_s.at[slot].transpose((1, 0)))
        take_turn()
        return s_ref[...], dp_ref[...]

      s, dp = pl.run_scoped(qk_dov, plgpu.ACC((ROWS, block_k), jnp.float32),
                            plgpu.ACC((ROWS, block_k), jnp.float32))
      plgpu.barrier_arrive(v_free.at[slot])
      p = jnp.exp2(s * scale - lax.broadcast_in_dim(lse2, s.shape, [0]))
      if masked:
        p = jnp.where(visible_keys(i), p, 0.0)
      ds = (p * (dp + lax.broadcast_in_dim(b, dp.shape, [0]))).astype(q_a.dtype)
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

      def dsk(acc_refs):
        for ref, k_part in zip(acc_refs, (k_a, k_b), strict=False):
          plgpu.wgmma(ref, ds, k_part.at[slot])

        @pl.when(i + 1 < steps)
        def _():
          plgpu.barrier_wait(k_bar.at[lax.rem(i + 1, num_stages)])

      acc = pl.run_state(dsk)(tuple(plgpu.ACC.init(a) for a in acc))
      plgpu.barrier_arrive(k_free.at[slot])
      return acc

    def skip(i, _):  # a stage the partner needs and this warpgroup does not
      slot = lax.rem(i, num_stages)
      plgpu.barrier_arrive(k_free.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])
      take_turn()
      take_turn()

    if grad:
      step = dq_step
      carry = tuple(wgmma_layout(jnp.zeros((ROWS, n), jnp.float32)) for _, (_, n) in parts)
    else:
      step = fwd_step
      carry = (wgmma_layout(jnp.zeros((ROWS, d_v), jnp.float32)),
               plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row),
               plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row))
    pl.when(steps > 0)(lambda: plgpu.barrier_wait(k_bar.at[0]))
    pl.when(wg == 1)(take_turn)  # warpgroup 0 takes the tensor cores first
    masked_step = functools.partial(step, masked=True)
    carry = lax.fori_loop(0, first_full, masked_step, carry)
    carry = lax.fori_loop(first_full, full_end, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(full_end, steps, masked_step, carry)
    lax.fori_loop(steps, cta_steps, skip, None)
    pl.when(wg == 0)(take_turn)

    if grad:
      store(m, [acc * sm_scale for acc in carry], None)
    else:
      acc, m_run, l = carry
      empty, l_safe = _mosaic.empty_rows(l)
      inv = jnp.where(empty, 0.0, 1.0 / l_safe)
      lse = jnp.where(empty, jnp.inf, (m_run + jnp.log2(l_safe)) * LN2)
      store(m, [acc * lax.broadcast_in_dim(inv, acc.shape, [0])], lse)

  @pl.when((seq < num_seqs) & (cta_rows < len_q) & (wg == 2))
  def _producer():
    plgpu.set_max_registers(registers[1], action="decrease")
    end, tail8 = end_ref[0], end_ref[1]  # cu_seqlens_k[-1]: rows from it may be unwritten

    @pl.loop(0, cta_steps)
    def _(i):
      slot = lax.rem(i, num_stages)
      first8 = k8 + i * (block_k // ALIGN)
      load = functools.partial(_load_block, plgpu, head=head, first8=first8, rows=block_k,
                               tail8=tail8, past_end=ALIGN * first8 + block_k > end)
      # The forward masks foreign keys' scores; dq also multiplies by K: zero its tail.
      pl.when(i >= num_stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
      load(k_ref, k_tail_ref, k_a.at[slot], k_bar.at[slot], cols=(0, d_v))
      if d_b:
        load(k_ref, k_tail_ref, k_b.at[slot], k_bar.at[slot], cols=(d_v, d_b))
      pl.when(i >= num_stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
      load(v_ref, v_tail_ref, v_s.at[slot], v_bar.at[slot])


def _tail_rows(x, end, block_k):
  """``(tail, first8)``: ``x``'s rows from ``8 * first8 = floor8(max(end - block_k,
  0))`` on, ``2 * block_k + 8`` of them, zero from ``end`` on: every key block that
  crosses ``end`` (``cu_seqlens_k[-1]``) lies in it."""
  first8 = jnp.maximum(end - block_k, 0) // ALIGN
  idx = ALIGN * first8 + jnp.arange(2 * block_k + ALIGN, dtype=jnp.int32)
  ok = idx < end
  tail = jnp.where(ok[:, None, None], x[jnp.clip(idx, 0, x.shape[0] - 1)], 0).astype(x.dtype)
  return tail, first8


def _side_rows(starts, lens, num_tokens):
  """``[(S + 1) * 2 * 64]``: the token of each side-buffer row (a sequence's partial
  first tile, then its partial last one), ``num_tokens`` (dropped) where none."""
  off = starts % ALIGN
  last = jnp.maximum(lens - 1 + off, 0) // ROWS  # the tile holding the last row
  first_partial = (off > 0) | (lens < ROWS)
  last_partial = (last > 0) & ((last + 1) * ROWS - off > lens)
  r = jnp.arange(ROWS, dtype=jnp.int32)
  m = jnp.stack([jnp.zeros_like(last), last], axis=1)  # [S, 2] tile of each slot
  i = m[..., None] * ROWS - off[:, None, None] + r  # [S, 2, 64] row within the sequence
  used = jnp.stack([first_partial, last_partial], axis=1)[..., None]
  ok = used & (i >= 0) & (i < lens[:, None, None])
  return jnp.where(ok, starts[:, None, None] + i, num_tokens).reshape(-1)


def _scatter(out, side, idx):
  """``out[:T]`` with the side buffer's ``[S + 1, 2, H, 64, d]`` rows written at ``idx``."""
  rows = jnp.moveaxis(side, 2, 3).reshape(-1, *out.shape[1:])
  return out.at[idx].set(rows, mode="drop")


def _launch(plgpu, inputs, *, grad, q, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            sm_scale, causal, config: Config):
  """Runs :func:`_kernel` on padded ``inputs`` (``q, k, v`` and for ``grad`` also dO and
  :func:`_row_vectors`); returns its outputs, each partial tile scattered from the side
  buffers, cut to ``q``'s tokens."""
  num_q_tokens, num_heads, d_qk = q.shape
  d_v = v.shape[-1]
  d_b = d_qk - d_v
  d_out = d_qk if grad else d_v
  num_seqs = cu_seqlens_q.shape[0] - 1
  block_k, num_stages = config.block_k, config.num_stages
  num_tiles = max(1, cdiv(max_seqlen_q + ALIGN - 1, TILE))  # + the leading q_off rows
  info = seq_info(cu_seqlens_q, cu_seqlens_k, num_q_tokens)
  rows_q = inputs[0].shape[0]

  swizzled = _mosaic.swizzled(plgpu)
  tiles = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=swizzled)  # noqa: E731
  smem = (tiles(2, ROWS, d_v), tiles(2, ROWS, d_b) if d_b else None,
          tiles(num_stages, block_k, d_v), tiles(num_stages, block_k, d_b) if d_b else None,
          tiles(num_stages, block_k, d_v),
          plgpu.SMEM((2, 2, ROWS) if grad else (2, ROWS), jnp.float32))
  if grad:
    smem += (tiles(2, ROWS, d_v),)
  copies = 2 if d_b else 1
  barriers = (
      plgpu.Barrier(num_arrivals=copies + 3 * grad, num_barriers=2),  # a consumer's rows
      plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),  # K stage loaded
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),  # V stage loaded
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),  # K stage free: both consumers
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),  # V stage free
      plgpu.Barrier(num_arrivals=2),  # the consumers' turns on the tensor cores
  )
  kernel = functools.partial(
      _kernel, plgpu=plgpu, grad=grad, num_seqs=num_seqs, num_tiles=num_tiles, causal=causal,
      scale=float(sm_scale) * LOG2E, sm_scale=float(sm_scale), block_k=block_k,
      num_stages=num_stages, registers=(config.consumer_registers, config.producer_registers))

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                  barriers, collective_axes="wg")

  side = (num_seqs + 1, 2, num_heads, ROWS)
  out_type = [jax.ShapeDtypeStruct((rows_q, num_heads, d_out), q.dtype)]
  if not grad:
    out_type.append(jax.ShapeDtypeStruct((num_heads, rows_q), jnp.float32))
  out_type.append(jax.ShapeDtypeStruct(side + (d_out,), q.dtype))
  if not grad:
    out_type.append(jax.ShapeDtypeStruct(side, jnp.float32))
  v_tail, tail8 = _tail_rows(v, cu_seqlens_k[-1], block_k)
  end = jnp.stack([cu_seqlens_k[-1], tail8]).astype(jnp.int32)
  tails = (_tail_rows(inputs[1], cu_seqlens_k[-1], block_k)[0], v_tail) if grad else (v_tail,)
  outs = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): tuple(out_type)},
      grid=(num_seqs + 1, num_heads, num_tiles), grid_names=("s", "h", "t"), num_threads=3,
      thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
  )(info, end, *inputs[:3], *tails, *inputs[3:])
  idx = _side_rows(info[:, 0], info[:, 1], num_q_tokens)
  out = _scatter(outs[0][:num_q_tokens], outs[-1 if grad else 2], idx)
  if grad:
    return out
  lse = outs[1].at[:, idx].set(jnp.moveaxis(outs[3], 2, 0).reshape(num_heads, -1), mode="drop")
  return out, lse[:, :num_q_tokens].T


def _pad_tokens(*xs):
  """TMA into tiled SMEM views the GMEM rows as tiles of 8: pads token counts to that."""
  return tuple(jnp.pad(x, ((0, -x.shape[0] % ALIGN),) + ((0, 0),) * (x.ndim - 1)) for x in xs)


def _row_vectors(lse, b):
  """The backward kernels' per-row inputs, head-major ``[2, H, Tq]`` (the token axis
  padded as :func:`_pad_tokens` pads ``q``): the base-2 LSE and ``b``."""
  vec = jnp.stack([lse * LOG2E, b]).swapaxes(1, 2)
  return jnp.pad(vec, ((0, 0), (0, 0), (0, -lse.shape[0] % ALIGN)))


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "sm_scale", "causal", "config"))
def mla_prefill_mosaic(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, sm_scale, causal,
                       config: Config):
  """Kernel entry (inputs validated by :func:`jax_mla.dense_prefill.mla_prefill` and
  :func:`check_supported`): ``(out[Tq, H, d_v], lse f32[Tq, H])``."""
  num_q_tokens, num_heads, _ = q.shape
  if num_q_tokens == 0 or k.shape[0] == 0:
    return (jnp.zeros((num_q_tokens, num_heads, v.shape[-1]), q.dtype),
            jnp.full((num_q_tokens, num_heads), jnp.inf, jnp.float32))
  return _launch(_mosaic.plgpu(), _pad_tokens(q, k, v), grad=False, q=q, v=v,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, sm_scale=sm_scale, causal=causal, config=config)


def _dkv_kernel(info_ref, end_ref, q_ref, do_ref, q_tail_ref, do_tail_ref, vec_ref, k_ref,
                v_ref, dk_ref, dv_ref, dk_side_ref, dv_side_ref, smem, barriers, *, plgpu,
                num_seqs, num_tiles, causal, scale, sm_scale, num_stages, registers):
  """``dk, dv`` for 64 keys of one sequence and head. Warpgroup 0 takes ``S^T = K Q^T``,
  ``P^T`` (handed over through SMEM) and ``dV += P^T dO``; warpgroup 1 ``dP^T = V dO^T``,
  ``dS^T = P^T (dP^T + b)`` and ``dK += dS^T Q``: equal tensor-core work, no atomics. The
  producer streams the query blocks (Q, dO and the rows' LSE and b) that see the keys."""
  k_a, k_b, v_s, q_a, q_b, do_s, vec_s, p_s = smem
  kv_bar, q_bar, p_ready, free, done = barriers
  seq, head, wg, len_q, len_k, q8, k8, q_off, k_off = _origin(info_ref)
  d_v = v_s.shape[-1]
  d_b = 0 if q_b is None else q_b.shape[-1]
  wgmma_layout = lambda x: plgpu.layout_cast(x, plgpu.Layout.WGMMA)  # noqa: E731
  col = _mosaic.col_layout(plgpu)
  # (owner warpgroup, SMEM staging tile, output, side output, columns)
  parts = [(1, k_a, dk_ref, dk_side_ref, (0, d_v))]
  if d_b:
    parts.append((1, k_b, dk_ref, dk_side_ref, (d_v, d_b)))
  parts.append((0, v_s, dv_ref, dv_side_ref, (0, d_v)))

  def key_rows(t):
    return pl.ds(ALIGN * (k8 + t * (ROWS // ALIGN)), ROWS)

  def store(t, owner, values):
    """Warpgroup ``owner``'s parts of key tile ``t``: straight out when all 64 rows are
    the sequence's, else into a side slot."""
    mine = [part[1:] for part in parts if part[0] == owner]
    for (tile, _, _, _), value in zip(mine, values, strict=True):
      tile[...] = value.astype(tile.dtype)
    plgpu.commit_smem()
    j0 = t * ROWS - k_off

    @pl.when((j0 >= 0) & (j0 + ROWS <= len_k))
    def _():
      for tile, out, _, cols in mine:
        plgpu.copy_smem_to_gmem(tile, out.at[key_rows(t), head, pl.ds(*cols)])

    @pl.when(((j0 < 0) | (j0 + ROWS > len_k)) & (j0 < len_k))
    def _():
      slot = jnp.where(t == 0, 0, 1)
      for tile, _, side, cols in mine:
        plgpu.copy_smem_to_gmem(tile, side.at[seq, slot, head, :, pl.ds(*cols)])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def zeros_of(owner):
    return [wgmma_layout(jnp.zeros((ROWS, cols[1]), jnp.float32))
            for o, _, _, _, cols in parts if o == owner]

  @pl.when((seq == num_seqs) & (wg < 2))  # keys past cu_seqlens_k[-1]: zero gradients
  def _tail():
    @pl.loop(0, cdiv(len_k + k_off, ROWS * num_tiles))
    def _(j):
      t = j * num_tiles + lax.axis_index("t")
      for owner in range(2):
        pl.when((wg == owner) & (t * ROWS - k_off < len_k))(
            lambda owner=owner, t=t: store(t, owner, zeros_of(owner)))

  t = lax.axis_index("t")
  j0 = t * ROWS - k_off  # the tile's first key within the sequence
  shift = len_k - len_q  # bottom-right causal: row i sees keys j <= i + shift
  j_first, j_last = jnp.maximum(j0, 0), jnp.minimum(j0 + ROWS, len_k) - 1  # its real keys
  n_blocks = cdiv(len_q + q_off, ROWS)  # query blocks with rows of the sequence
  if causal:  # blocks before `first` see none of the keys; from `full` on, all of them
    first = lax.div(jnp.clip(j_first - shift, 0, len_q) + q_off, ROWS)
    full = cdiv(jnp.clip(j_last - shift, 0, len_q) + q_off, ROWS)
  else:
    first, full = jnp.int32(0), cdiv(q_off, ROWS)
  first = jnp.minimum(first, n_blocks)
  full = jnp.clip(full, first, n_blocks)
  inner_end = jnp.clip(lax.div(len_q + q_off, ROWS), full, n_blocks)  # no rows past the end
  active = (seq < num_seqs) & (j0 < len_k)

  @pl.when(active & (wg < 2))
  def _consumer():
    plgpu.set_max_registers(registers[0], action="increase")
    rows_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, ROWS), 0, layout=plgpu.Layout.WGMMA)
    cols_iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, ROWS), 1, layout=plgpu.Layout.WGMMA)

    def visible(qb):  # [keys, queries] of this tile and query block
      i = qb * ROWS - q_off + cols_iota
      ok = (i >= 0) & (i < len_q)
      return ok & (j0 + rows_iota <= i + shift) if causal else ok

    def vec(slot, j):
      return plgpu.load(vec_s.at[slot, j], (), layout=col, optimized=False)

    plgpu.barrier_wait(kv_bar)

    @pl.when(wg == 0)
    def _dv():
      def step(qb, dv, masked):
        slot = lax.rem(qb - first, num_stages)
        plgpu.barrier_wait(q_bar.at[slot])

        def st(s_ref):
          plgpu.wgmma(s_ref, k_a, q_a.at[slot].transpose((1, 0)))
          if d_b:
            plgpu.wgmma(s_ref, k_b, q_b.at[slot].transpose((1, 0)))
          return s_ref[...]

        s_t = pl.run_scoped(st, plgpu.ACC((ROWS, ROWS), jnp.float32))
        p_t = jnp.exp2(s_t * scale - lax.broadcast_in_dim(vec(slot, 0), s_t.shape, [1]))
        if masked:
          p_t = jnp.where(visible(qb), p_t, 0.0)
        p_t = p_t.astype(q_a.dtype)
        p_s.at[slot][...] = p_t
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready.at[slot])
        dv = pl.run_state(lambda ref: plgpu.wgmma(ref, p_t, do_s.at[slot]))(plgpu.ACC.init(dv))
        plgpu.barrier_arrive(free.at[slot])
        return dv

      dv = _blocks(step, zeros_of(0)[0], first, full, inner_end, n_blocks)
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
      store(t, 0, [dv])

    @pl.when(wg == 1)
    def _dk():
      def step(qb, dk, masked):
        del masked  # P^T comes masked
        slot = lax.rem(qb - first, num_stages)
        plgpu.barrier_wait(q_bar.at[slot])
        def vdo(ref):
          plgpu.wgmma(ref, v_s, do_s.at[slot].transpose((1, 0)))
          return ref[...]

        dp_t = pl.run_scoped(vdo, plgpu.ACC((ROWS, ROWS), jnp.float32))
        b = lax.broadcast_in_dim(vec(slot, 1), dp_t.shape, [1])
        plgpu.barrier_wait(p_ready.at[slot])
        ds_t = (p_s.at[slot][...].astype(jnp.float32) * (dp_t + b)).astype(q_a.dtype)

        def dsq(refs):
          for ref, q_part in zip(refs, (q_a, q_b), strict=False):
            plgpu.wgmma(ref, ds_t, q_part.at[slot])

        dk = pl.run_state(dsq)(tuple(plgpu.ACC.init(x) for x in dk))
        plgpu.barrier_arrive(free.at[slot])
        return dk

      dk = _blocks(step, tuple(zeros_of(1)), first, full, inner_end, n_blocks)
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
      store(t, 1, [x * sm_scale for x in dk])

  @pl.when(active & (wg == 2))
  def _producer():
    plgpu.set_max_registers(registers[1], action="decrease")
    rows = key_rows(t)
    plgpu.copy_gmem_to_smem(k_ref.at[rows, head, pl.ds(0, d_v)], k_a, kv_bar)
    if d_b:
      plgpu.copy_gmem_to_smem(k_ref.at[rows, head, pl.ds(d_v, d_b)], k_b, kv_bar)
    plgpu.copy_gmem_to_smem(v_ref.at[rows, head], v_s, kv_bar)
    end, tail8 = end_ref[0], end_ref[1]  # cu_seqlens_q[-1]: rows from it may be unwritten

    @pl.loop(first, n_blocks)
    def _(qb):
      slot = lax.rem(qb - first, num_stages)
      pl.when(qb - first >= num_stages)(lambda: plgpu.barrier_wait(free.at[slot]))
      first8 = q8 + qb * (ROWS // ALIGN)
      load = functools.partial(_load_block, plgpu, bar=q_bar.at[slot], head=head,
                               first8=first8, rows=ROWS, tail8=tail8,
                               past_end=ALIGN * first8 + ROWS > end)
      load(q_ref, q_tail_ref, q_a.at[slot], cols=(0, d_v))
      if d_b:
        load(q_ref, q_tail_ref, q_b.at[slot], cols=(d_v, d_b))
      load(do_ref, do_tail_ref, do_s.at[slot])
      for j in range(2):  # rows past the end read zeros from the padding; they are masked
        plgpu.copy_gmem_to_smem(vec_ref.at[j, head, pl.ds(ALIGN * first8, ROWS)],
                                vec_s.at[slot, j], q_bar.at[slot])


def _blocks(step, carry, first, full, inner_end, n_blocks):
  """``step`` over the query blocks ``[first, n_blocks)``, masked where some pair is not
  visible: before ``full`` (the causal diagonal, foreign leading rows) and from
  ``inner_end`` (rows past the sequence's end)."""
  carry = lax.fori_loop(first, full, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(full, inner_end, functools.partial(step, masked=False), carry)
  return lax.fori_loop(inner_end, n_blocks, functools.partial(step, masked=True), carry)


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "max_seqlen_k", "sm_scale",
                                             "causal", "config"))
def mla_prefill_bwd_mosaic(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, lse, b, *, max_seqlen_q,
                           max_seqlen_k, sm_scale, causal, config: Config):
  """``(dq, dk, dv)`` of ``mla_prefill`` in the dtypes of ``q, k, v``, from the forward's
  token-major natural-log ``lse`` and ``b = d_lse - rowsum(dO * out)`` (float32 ``[Tq,
  H]``): the ``dq`` kernel and the ``dk, dv`` kernel on one padded copy of the inputs."""
  if q.shape[0] == 0 or k.shape[0] == 0:
    return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
  padded = _pad_tokens(q, k, v, d_out.astype(q.dtype))
  vec = _row_vectors(lse, b)
  common = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sm_scale=sm_scale,
                causal=causal, config=config)
  dq = _launch(_mosaic.plgpu(), padded + (vec,), grad=True, q=q, v=v,
               max_seqlen_q=max_seqlen_q, **common)
  return (dq, *_launch_dkv(*padded, vec, q=q, k=k, v=v, max_seqlen_k=max_seqlen_k, **common))


def _launch_dkv(q_p, k_p, v_p, do_p, vec, *, q, k, v, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_k, sm_scale, causal, config: Config):
  """Runs :func:`_dkv_kernel` on the padded inputs; returns ``(dk, dv)`` with each
  partial key tile scattered from the side buffers, cut to ``k``'s tokens."""
  plgpu = _mosaic.plgpu()
  num_q_tokens, num_heads, d_qk = q.shape
  num_k_tokens, d_v = k.shape[0], v.shape[-1]
  d_b = d_qk - d_v
  num_seqs = cu_seqlens_q.shape[0] - 1
  num_stages = config.num_stages
  num_tiles = max(1, cdiv(max_seqlen_k + ALIGN - 1, ROWS))
  info = seq_info(cu_seqlens_q, cu_seqlens_k, num_q_tokens)
  # The last row: the keys past cu_seqlens_k[-1], no queries (zero gradients).
  end_k = cu_seqlens_k[-1]
  info = info.at[num_seqs].set(jnp.stack([jnp.int32(0), jnp.int32(0), end_k,
                                          num_k_tokens - end_k]))
  q_tail, tail8 = _tail_rows(q_p, cu_seqlens_q[-1], ROWS)
  do_tail, _ = _tail_rows(do_p, cu_seqlens_q[-1], ROWS)
  end = jnp.stack([cu_seqlens_q[-1], tail8]).astype(jnp.int32)

  swizzled = _mosaic.swizzled(plgpu)
  tiles = lambda *shape: plgpu.SMEM(shape, q.dtype, transforms=swizzled)  # noqa: E731
  smem = (tiles(ROWS, d_v), tiles(ROWS, d_b) if d_b else None, tiles(ROWS, d_v),
          tiles(num_stages, ROWS, d_v), tiles(num_stages, ROWS, d_b) if d_b else None,
          tiles(num_stages, ROWS, d_v), plgpu.SMEM((num_stages, 2, ROWS), jnp.float32),
          tiles(num_stages, ROWS, ROWS))
  copies = 2 if d_b else 1
  barriers = (
      plgpu.Barrier(num_arrivals=copies + 1),  # the keys and values loaded
      plgpu.Barrier(num_arrivals=copies + 3, num_barriers=num_stages),  # a query block
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),  # its P^T handed over
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),  # its stage free
      plgpu.Barrier(num_arrivals=2),  # both warpgroups done with K and V
  )
  kernel = functools.partial(
      _dkv_kernel, plgpu=plgpu, num_seqs=num_seqs, num_tiles=num_tiles, causal=causal,
      scale=float(sm_scale) * LOG2E, sm_scale=float(sm_scale), num_stages=num_stages,
      registers=(config.consumer_registers, config.producer_registers))

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                  barriers, collective_axes="wg")

  side = (num_seqs + 1, 2, num_heads, ROWS)
  out_type = (jax.ShapeDtypeStruct(k_p.shape, k.dtype), jax.ShapeDtypeStruct(v_p.shape, v.dtype),
              jax.ShapeDtypeStruct(side + (d_qk,), k.dtype),
              jax.ShapeDtypeStruct(side + (d_v,), v.dtype))
  dk, dv, dk_side, dv_side = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): out_type},
      grid=(num_seqs + 1, num_heads, num_tiles), grid_names=("s", "h", "t"), num_threads=3,
      thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
  )(info, end, q_p, do_p, q_tail, do_tail, vec, k_p, v_p)
  idx = _side_rows(info[:, 2], info[:, 3], num_k_tokens)
  return (_scatter(dk[:num_k_tokens], dk_side, idx), _scatter(dv[:num_k_tokens], dv_side, idx))
