"""Pallas Mosaic GPU sparse MLA kernel for up to 32 heads (not a multiple of 64).

Tensor parallelism leaves a GPU 8, 16 or 32 of DeepSeek's 128 query heads. A wgmma's M
side is 64 rows, so putting the heads there (:mod:`.mosaic`) would spend 75% of the
tensor-core rows on heads that are not there. This kernel puts the 64 keys of a step
on the M side instead and the heads on N (a multiple of 16):

- ``S^T = K Q^T`` (64 keys x heads, over the 512 + 64 RoPE or 512 columns), masked,
  and the online softmax down each column (base 2);
- ``O^T += V^T P^T``: each of the two consumer warpgroups owns 256 of the 512 output
  rows of ``O^T``.

One CTA takes one query token and a block of at most 32 heads
(:func:`jax_mla._mosaic.transposed_tiles`); the producer warpgroup and its ring of
gathered bf16 key stages are the other kernel's
(:func:`jax_mla.sparse_mla.mosaic_gather.produce`). The consumers take the
stages in turns as there (:func:`jax_mla._mosaic.consume_stages`): stage ``i``'s
``S^T`` and softmax run in warpgroup ``i % 2``, which hands ``P^T`` (bf16, its own SMEM
tile per stage) and the columns' rescale factor to both. The column reductions cross
the warps of a warpgroup through one shared SMEM scratch, so the softmaxes of the two
warpgroups are serialised: a warpgroup publishes its stage's max only after its sums.

``P^T`` and the output ``O^T`` go to SMEM transposed (``[heads, 64]`` and ``[heads, 256]``
tiles, the 128-byte-swizzled layout of the ring: wgmma needs both operands' swizzles
equal), so the output leaves as ``O`` like the other kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _mosaic, merge_mosaic
from jax_mla._common import LOG2E
from jax_mla.sparse_mla.mosaic_gather import (
  BLOCK_K,
  D_MAIN,
  HALF,
  TILE,
  first_steps,
  kernel_inputs,
  produce,
  split_steps,
)


def _kernel(len_ref, q_ref, sink_ref, *refs, plgpu, heads, h_pad, d_qk, config, gathers,
            scale, tokens, splits):
  """``refs``: the sets' indices, then their caches, then the outputs (``O``
  ``[splits * T * h_pad, 512]``, max logits and LSE ``[splits * T * blocks, max(heads,
  32)]``; split ``s`` writes part ``s``), the SMEM refs and the barriers."""
  num_sets = len(gathers)
  idx_refs, kv_refs = refs[:num_sets], refs[num_sets:2 * num_sets]
  o_ref, ml_ref, lse_ref, smem, barriers = refs[2 * num_sets:]
  q_main, q_rope, kv_main, kv_rope, valid, sink_smem, p_t, stats, p_stats = smem
  q_bar, kv_bar, free_bar, done_bar, p_ready = barriers
  t = lax.axis_index("t")
  h0 = lax.axis_index("h") * heads
  wg = lax.axis_index("wg")
  r0 = t * h_pad + h0
  first, base = split_steps(first_steps(len_ref, t, idx_refs), splits)
  part = 0 if splits == 1 else lax.axis_index("s")
  has_rope = d_qk > D_MAIN

  @pl.when(wg < 2)
  def _consumer():
    _mosaic.set_registers(plgpu, config.consumer_registers, 2 + config.producers)

    def mask(i, slot):
      del i

      def apply(s):  # the producer wrote each key's validity beside the stage
        ok = plgpu.load(valid.at[slot], (), layout=_mosaic.row_layout(plgpu), optimized=False)
        return jnp.where(lax.broadcast_in_dim(ok, s.shape, [0]) != 0, s, -jnp.inf)

      return apply

    acc, m, l = _mosaic.consume_stages(
        plgpu, wg=wg, q_main=q_main, q_rope=q_rope if has_rope else None, k_main=kv_main,
        k_rope=kv_rope, steps=first[-1], barriers=(q_bar, kv_bar, free_bar, done_bar),
        shared=(p_stats, p_ready), mask=mask, scale=scale, p_t=p_t)
    sink = plgpu.load(sink_smem.at[pl.ds(0, heads)], (), layout=_mosaic.col_layout(plgpu),
                      optimized=False)
    inv, max_logits, lse = _mosaic.sink_epilogue(m, l, sink)
    # Both consumers are done with Q: its halves stage O (O^T stored transposed).
    o = (acc * lax.broadcast_in_dim(inv, acc.shape, [1])).astype(q_main.dtype)
    q_main.at[wg].transpose((1, 0))[...] = plgpu.layout_cast(o, plgpu.Layout.WGMMA_TRANSPOSED)

    @pl.when(wg == 0)
    def _():
      stats.at[0, pl.ds(0, heads)][...] = max_logits

    @pl.when(wg == 1)
    def _():
      stats.at[1, pl.ds(0, heads)][...] = lse

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_main.at[wg], o_ref.at[pl.ds(part * tokens * h_pad + r0, heads),
                                                     pl.ds(wg * HALF, HALF)])
    block = (part * tokens + t) * lax.axis_size("h") + lax.axis_index("h")

    @pl.when(wg == 0)
    def _():
      plgpu.copy_smem_to_gmem(stats.at[0], ml_ref.at[block])

    @pl.when(wg == 1)
    def _():
      plgpu.copy_smem_to_gmem(stats.at[1], lse_ref.at[block])

    plgpu.wait_smem_to_gmem(0)

  rows = pl.ds(r0, heads)
  q_copies = [(q_ref.at[rows, pl.ds(h * HALF, HALF)], q_main.at[h]) for h in range(2)]
  if has_rope:
    q_copies.append((q_ref.at[rows, pl.ds(D_MAIN, d_qk - D_MAIN)], q_rope))
  q_copies.append((sink_ref.at[pl.ds(h0, sink_smem.shape[0])], sink_smem))
  for p in range(config.producers):

    @pl.when(wg == 2 + p)
    def _producer(p=p):
      _mosaic.set_registers(plgpu, config.producer_registers, 2 + config.producers)
      produce(plgpu, t=t, q_copies=q_copies, gathers=gathers, idx_refs=idx_refs, len_ref=len_ref,
              kv_refs=kv_refs, kv_main=kv_main, kv_rope=kv_rope, valid=valid,
              barriers=(q_bar, kv_bar, free_bar), first=first, base=base, producer=p,
              producers=config.producers)


def attend(q, sets, attn_sink, *, fmts, sm_scale, config, num_splits: int = 1):
  """:func:`jax_mla.sparse_mla.mosaic.attend` for ``h_q`` up to 32."""
  plgpu = _mosaic.plgpu()
  tokens, h_q, d_qk = q.shape
  blocks, heads = _mosaic.transposed_tiles(h_q)
  h_pad = blocks * heads
  gathers, lengths, all_indices, all_rows = kernel_inputs(sets, fmts, d_qk)
  sink = (jnp.full((h_q,), -jnp.inf, jnp.float32) if attn_sink is None
          else attn_sink.astype(jnp.float32))
  q = jnp.pad(q, ((0, 0), (0, h_pad - h_q), (0, 0)))
  row = max(heads, _mosaic.MIN_VECTOR_ROW)
  sink = jnp.pad(sink, (0, h_pad - h_q + row - heads), constant_values=-jnp.inf)
  # Split parts are combined before the sinks apply: the kernel then runs without.
  kernel_sink = sink if num_splits == 1 else jnp.full_like(sink, -jnp.inf)

  tiles = _mosaic.swizzled(plgpu)
  rope = max(d_qk - D_MAIN, TILE)  # d_qk 512: an unused 64-column stand-in
  num_stages = config.num_stages
  shared_smem, shared_barrier = _mosaic.shared_scratch(plgpu, heads, num_stages)
  smem = (
      plgpu.SMEM((2, heads, HALF), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((heads, rope), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((num_stages, 2, BLOCK_K, HALF), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((num_stages, BLOCK_K, rope), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((num_stages + 2 * config.producers, BLOCK_K), jnp.int32),
      plgpu.SMEM((row,), jnp.float32),
      plgpu.SMEM((num_stages, heads, BLOCK_K), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((2, row), jnp.float32),
      shared_smem,
  )
  q_copies = 2 + (d_qk > D_MAIN) + 1  # NoPE halves, RoPE, sink
  barriers = (
      plgpu.Barrier(num_arrivals=q_copies),
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),  # stage gathered (producer)
      plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),  # stage free: both consumers
      plgpu.Barrier(num_arrivals=2),  # both consumers done with the query
      shared_barrier,
  )
  kernel = functools.partial(_kernel, plgpu=plgpu, heads=heads, h_pad=h_pad, d_qk=d_qk,
                             config=config, gathers=gathers, scale=sm_scale * LOG2E,
                             tokens=tokens, splits=num_splits)

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*refs, smem_refs, bar_refs), smem,
                  barriers, collective_axes="wg")

  n = num_splits * tokens
  out_type = (jax.ShapeDtypeStruct((n * h_pad, D_MAIN), jnp.bfloat16),
              jax.ShapeDtypeStruct((n * blocks, row), jnp.float32),
              jax.ShapeDtypeStruct((n * blocks, row), jnp.float32))
  grid = ({"grid": (tokens, blocks), "grid_names": ("t", "h")} if num_splits == 1 else
          {"grid": (tokens, num_splits, blocks), "grid_names": ("t", "s", "h")})
  out, max_logits, lse = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): out_type}, **grid,
      num_threads=2 + config.producers, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lengths, q.reshape(tokens * h_pad, d_qk), kernel_sink, *all_indices, *all_rows)
  max_logits, lse = (x[:, :heads].reshape(n * h_pad) for x in (max_logits, lse))
  if num_splits > 1:
    out, max_logits, lse = merge_mosaic.combine(
        out.reshape(num_splits, tokens * h_pad, D_MAIN), lse.reshape(num_splits, -1),
        max_logits.reshape(num_splits, -1), sink[:h_pad], heads=h_pad)
  return (out.reshape(tokens, h_pad, D_MAIN)[:, :h_q],
          max_logits.reshape(tokens, h_pad)[:, :h_q], lse.reshape(tokens, h_pad)[:, :h_q])
