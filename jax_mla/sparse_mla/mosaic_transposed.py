"""Pallas Mosaic GPU sparse MLA kernel for up to 32 heads (not a multiple of 64).

Tensor parallelism leaves a GPU 8, 16 or 32 of DeepSeek's 128 query heads. A wgmma's M
side is 64 rows, so putting the heads there (:mod:`.mosaic`) would spend 75% of the
tensor-core rows on heads that are not there. This kernel puts the 64 keys of a step
on the M side instead and the heads on N (a multiple of 16):

- ``S^T = K Q^T`` (64 keys x heads, over the 512 + 64 RoPE or 512 columns), masked,
  and the online softmax down each column (base 2);
- ``O^T += V^T P^T``: each of the two consumer warpgroups owns 256 of the 512 output
  rows of ``O^T``.

A CTA takes a query token and a block of at most 32 heads
(:func:`jax_mla._mosaic.transposed_tiles`); the producer warpgroup and its ring of
gathered bf16 key stages are the other kernel's
(:func:`jax_mla.sparse_mla.mosaic_gather.produce`). With 16 heads a CTA and one
consumer, the CTAs are persistent, one per SM, each taking token after token: the
producers gather the next token's first stages and its query lands in a second
buffer while the consumer finishes the last one, so a CTA's start-up (5.6 us, H100,
prefill h16) is paid once per SM, not once per token (prefill h16 1643 -> 1576 us,
fp8_model1 h16 130 -> 117 us; benchmarks/RESULTS.md, session 24). By default one
consumer warpgroup takes every stage (``Config(consumers=1)``, :func:`_consume_alone`):
with at most 32 heads its two ``[256, heads]`` accumulators fit, and the registers it
leaves go to a second producer (16 heads a CTA), since the gather of random rows sets
the pace (H100, fp8_ds_mla b128 h16: 211 vs 241-248 us; benchmarks/RESULTS.md, session
21). With two consumers they take the stages in turns as the head-block kernel's do
(:func:`jax_mla._mosaic.consume_stages`): stage ``i``'s ``S^T`` and softmax run in
warpgroup ``i % 2``, which hands ``P^T`` (bf16, its own SMEM tile per stage) and the
columns' rescale factor to both. The column reductions cross the warps of a warpgroup
through one shared SMEM scratch, so the softmaxes of the two warpgroups are serialised:
a warpgroup publishes its stage's max only after its sums.

With one consumer and early loads (fp8_ds_mla, 16 heads a CTA), a slot's RoPE tile is
refilled early: the consumer arrives on ``rope_free`` once the stage's ``S^T`` is done,
and the producer then issues the next stage's RoPE copies, which land while the consumer
finishes the slot (:func:`jax_mla.sparse_mla.mosaic_gather.produce`).

``P^T`` and the output ``O^T`` go to SMEM transposed (``[heads, 64]`` and ``[heads, 256]``
tiles, the 128-byte-swizzled layout of the ring: wgmma needs both operands' swizzles
equal), so the output leaves as ``O`` like the other kernel's. A decode's LSE leaves in
FlashMLA's ``[b, h_q, s_q]`` layout, one head per thread (a TMA row there would be 4
bytes), and the sinks are read from GMEM: the program is then the kernel alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _mosaic, _softmax, merge_mosaic
from jax_mla._common import LOG2E, num_sms
from jax_mla.sparse_mla.mosaic_gather import (
  BLOCK_K,
  D_MAIN,
  EARLY_MIN_REGISTERS,
  HALF,
  TILE,
  block_rows,
  combine_tail,
  decode_lse,
  first_steps,
  kernel_inputs,
  leading_inputs,
  load_sinks,
  padded_sinks,
  prefill_tail,
  produce,
  ragged_block,
  run_items,
  split_steps,
  store_decode_lse,
  tail_row,
)


def _kernel(len_ref, q_ref, sink_ref, *refs, plgpu, heads, h_pad, q_rows, d_qk, config,
            gathers, scale, tokens, splits, query_len, direct_lse, persistent, tail,
            early_rope):
  """``len_ref`` (None: no set has lengths) and ``sink_ref`` (None: no sink) as
  :func:`.mosaic_gather.leading_inputs` gives them. ``refs``: the sets' indices, then
  their caches, then the outputs (``O``
  ``[splits * T * q_rows, 512]``, max logits and LSE ``[splits * T * blocks, max(heads,
  32)]``; split ``s`` writes part ``s``; with ``direct_lse``, the LSE is ``[T /
  query_len, q_rows, query_len]``), the SMEM refs and the barriers. ``q_rows``: the
  query's and the output's rows a token, ``h_pad``, or ``h_q`` where the last head
  block is read and written unpadded (:func:`.mosaic_gather.ragged_block`).
  ``query_len``: the tokens are a decode's ``[b, query_len]`` queries, whose lengths are
  per request.
  ``persistent``: the grid is one CTA per SM (axis ``"p"``), each taking the (token,
  head block) items ``p, p + ctas, ...`` with its ring running on from one item into
  the next (:func:`.mosaic_gather.run_items`); ``tail`` ``(r, parts)``: its last ``r``
  items are taken in ``parts`` shares, whose results (no sink applied) go to three more
  outputs, share ``j`` of tail item ``i`` at row ``j * r + i``: ``O`` ``[parts * r *
  heads, 512]``, max logits and LSE ``[parts * r, max(heads, 32)]``. ``early_rope``: the
  gathers issue their RoPE copies once the consumer has the slot's ``S^T``
  (:func:`.mosaic_gather.produce`'s ``rope_free``; one consumer)."""
  num_sets = len(gathers)
  idx_refs, kv_refs = refs[:num_sets], refs[num_sets:2 * num_sets]
  o_ref, ml_ref, lse_ref, *tail_refs, smem, barriers = refs[2 * num_sets:]
  q_main, q_rope, kv_main, kv_rope, valid, p_t, stats, p_stats = smem
  q_bar, kv_bar, free_bar, done_bar, p_ready, *more = barriers
  q_free = more.pop(0) if persistent else None  # a query buffer is free again
  rope_free = more.pop(0) if early_rope else None  # a slot's RoPE tile is read (S^T done)
  wg = lax.axis_index("wg")
  blocks = h_pad // heads
  last_rows = q_rows - (blocks - 1) * heads  # the last head block's rows to store
  part = 0 if splits == 1 else lax.axis_index("s")
  has_rope = d_qk > D_MAIN
  consumers = config.consumers
  warpgroups = consumers + config.producers

  def item(t, h, share=None):
    """Token ``t``, head block ``h`` (``share`` of it: a tail item's, or -1 for all):
    ``(first query row, request, first, base)``."""
    request = t if query_len is None else lax.div(t, query_len)
    first, base = split_steps(first_steps(len_ref, request, idx_refs, gathers),
                              splits if share is None else tail[1], share)
    return t * q_rows + h * heads, request, first, base

  def key_mask(slot):
    def apply(s):  # the producer wrote each key's validity beside the stage
      ok = plgpu.load(valid.at[slot], (), layout=_mosaic.row_layout(plgpu), optimized=False)
      return jnp.where(lax.broadcast_in_dim(ok, s.shape, [0]) != 0, s, -jnp.inf)

    return apply

  def finish(t, h, q, halves, m, l, share=None):
    """The epilogue once the consumers are done with the item's query buffer ``q``: its
    halves stage O (O^T stored transposed). This consumer writes the output halves
    ``halves`` (``(half, acc)`` pairs) and the per-head rows it owns: all with one
    consumer; with two, consumer 0 the max logits and consumer 1 the LSE. A tail
    item's share (``share >= 0``) goes to the tail outputs, its sink left to the
    combine."""
    r0, h0 = t * q_rows + h * heads, h * heads
    owner = (lambda k: lambda f: f()) if consumers == 1 else (lambda k: pl.when(wg == k))
    sink = load_sinks(plgpu, sink_ref, h0, heads, _mosaic.col_layout(plgpu), share)
    inv, max_logits, lse = _mosaic.sink_epilogue(m, l, sink)
    for half, acc in halves:
      o = (acc * lax.broadcast_in_dim(inv, acc.shape, [1])).astype(q.dtype)
      q.at[half].transpose((1, 0))[...] = plgpu.layout_cast(o, plgpu.Layout.WGMMA_TRANSPOSED)
    for k, vec in enumerate((max_logits, lse)):

      @owner(k)
      def _(k=k, vec=vec):
        stats.at[k, pl.ds(0, heads)][...] = vec

    plgpu.commit_smem()

    def store(o_dst, o_row, ml_dst, lse_dst, row, count=heads):
      """O's rows ``o_row ..`` (``count`` of them), the max logits and LSE at row
      ``row`` of their outputs."""
      for half, _ in halves:
        o = q.at[half] if count == heads else q.at[half, pl.ds(0, count)]
        plgpu.copy_smem_to_gmem(o, o_dst.at[pl.ds(o_row, count), pl.ds(half * HALF, HALF)])
      for k, ref in enumerate((ml_dst, lse_dst)):

        @owner(k)
        def _(k=k, ref=ref):
          if k == 1 and direct_lse:
            store_decode_lse(plgpu, stats.at[k], ref, t=t, h0=h0, count=count,
                             query_len=query_len)
          else:
            plgpu.copy_smem_to_gmem(stats.at[k], ref.at[row])

    def store_item():
      store_rows = functools.partial(store, o_ref, part * tokens * q_rows + r0, ml_ref,
                                     lse_ref, (part * tokens + t) * blocks + h)
      block_rows(store_rows, h, blocks, heads, last_rows)

    if share is None:
      store_item()
    else:
      row = tail_row(tail, tokens, blocks, t, h, share)
      pl.when(share < 0)(store_item)
      pl.when(share >= 0)(lambda: store(tail_refs[0], row * heads, *tail_refs[1:], row))
    plgpu.wait_smem_to_gmem(0)

  q_buffers = q_main.shape[0]

  def query_buffer(k):  # item k's query buffer (they alternate)
    return 0 if q_buffers == 1 else lax.rem(k, q_buffers)

  def for_each_item(body):
    run_items(body, persistent=persistent, tokens=tokens, blocks=blocks, tail=tail)

  @pl.when(wg < consumers)
  def _consumer():
    _mosaic.set_registers(plgpu, config.consumer_registers, warpgroups)

    def consume(k, t, h, ring_start, share=None):
      _, _, first, _ = item(t, h, share)
      b = query_buffer(k)
      q = q_main.at[b]
      rope = q_rope.at[b] if has_rope else None
      if consumers == 1:
        accs, m, l = _consume_alone(
            plgpu, q_main=q, q_rope=rope, k_main=kv_main, k_rope=kv_rope, p_t=p_t,
            steps=first[-1], barriers=(q_bar.at[b], kv_bar, free_bar), mask=key_mask,
            scale=scale, ring_start=ring_start, rope_free=rope_free)
        finish(t, h, q, list(enumerate(accs)), m, l, share)
      else:
        acc, m, l = _mosaic.consume_stages(
            plgpu, wg=wg, q_main=q, q_rope=rope, k_main=kv_main, k_rope=kv_rope,
            steps=first[-1], barriers=(
                q_bar.at[b], *_mosaic.stage_barriers(plgpu, kv_bar, free_bar), done_bar),
            shared=(p_stats, p_ready), mask=lambda i, slot: key_mask(slot), scale=scale,
            p_t=p_t)
        finish(t, h, q, [(wg, acc)], m, l)
      if persistent:  # a later item's query may land in this buffer (the output staging)
        plgpu.barrier_arrive(q_free.at[b])
      return ring_start + first[-1]

    for_each_item(consume)

  for p in range(config.producers):

    @pl.when(wg == consumers + p)
    def _producer(p=p):
      _mosaic.set_registers(plgpu, config.producer_registers, warpgroups)

      def gather(k, t, h, ring_start, share=None):
        r0, request, first, base = item(t, h, share)
        b = query_buffer(k)
        rows = pl.ds(r0, heads)
        q_copies = [(q_ref.at[rows, pl.ds(c * HALF, HALF)], q_main.at[b, c]) for c in range(2)]
        if has_rope:
          q_copies.append((q_ref.at[rows, pl.ds(D_MAIN, d_qk - D_MAIN)], q_rope.at[b]))
        if persistent and p == 0:

          @pl.when(k >= q_buffers)
          def _():
            plgpu.barrier_wait(q_free.at[b])

        produce(plgpu, t=t, q_copies=q_copies, gathers=gathers, idx_refs=idx_refs,
                len_ref=len_ref, kv_refs=kv_refs, kv_main=kv_main, kv_rope=kv_rope,
                valid=valid, barriers=(q_bar.at[b], kv_bar, free_bar), first=first, base=base,
                request=request, producer=p, producers=config.producers,
                ring_start=ring_start, rope_free=rope_free)
        return ring_start + first[-1]

      for_each_item(gather)


def _consume_alone(plgpu, *, q_main, q_rope, k_main, k_rope, p_t, steps, barriers, mask,
                   scale, ring_start=0, rope_free=None):
  """The attention loop of a kernel's only consumer warpgroup (``Config(consumers=1)``):
  every stage's ``S^T = K Q^T``, mask, online softmax down the columns (base 2) and ``O^T
  += V^T P^T`` over all 512 rows, as two ``[256, heads]`` float32 accumulators. Nothing
  is shared with another consumer, so there is no hand-off of ``P^T`` and no wait for
  another warpgroup's max; a stage is freed once its products are done. The column sums
  stay unreduced, ``[64, heads]`` in the tile's own layout, and are summed down the keys
  once at the end: a column reduction crosses the warps through SMEM (two barriers). The
  softmax is 320 cycles a step shorter (H100, fp8_ds_mla b128 h16; per call 188.6 ->
  186.0 us, fp8_model1 h16 145.7 -> 138.7 us, prefill h16 494 -> 468 us;
  benchmarks/RESULTS.md, session 23). ``rope_free`` (None, or one barrier per slot): it
  arrives once a stage's ``S^T`` is done, so the producer may refill the RoPE tile
  early. Returns ``(accs, m, l)`` as :func:`jax_mla._mosaic.consume_stages`."""
  q_bar, kv_bar, free_bar = barriers
  num_stages, _, keys, half = k_main.shape
  rows = q_main.shape[1]
  col = _mosaic.col_layout(plgpu)
  zeros = plgpu.layout_cast(jnp.zeros((half, rows), jnp.float32), plgpu.Layout.WGMMA)
  m = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), col)
  l = plgpu.layout_cast(jnp.zeros((keys, rows), jnp.float32), plgpu.Layout.WGMMA)
  plgpu.barrier_wait(q_bar)

  def step(i, carry):
    accs, m, l = carry
    slot = lax.rem(ring_start + i, num_stages)
    apply_mask = mask(slot)
    plgpu.barrier_wait(kv_bar.at[slot])

    def qk(s_ref):
      for h in range(2):
        plgpu.wgmma(s_ref, k_main.at[slot, h], q_main.at[h].transpose((1, 0)))
      if q_rope is not None:
        plgpu.wgmma(s_ref, k_rope.at[slot], q_rope.transpose((1, 0)))
      return s_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((keys, rows), jnp.float32))
    if rope_free is not None:  # the products have read the RoPE tile
      plgpu.barrier_arrive(rope_free.at[slot])
    s = apply_mask(s)
    m_new = jnp.maximum(m, s.max(axis=0) * scale)
    m_use = _softmax.safe_max(m_new)
    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_use, s.shape, [1]))
    alpha = jnp.exp2(m - m_use)  # 0 while m is -inf (the accumulators are 0 then)
    l = l * lax.broadcast_in_dim(alpha, s.shape, [1]) + p
    p_t.at[slot].transpose((1, 0))[...] = plgpu.layout_cast(
        p.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()  # P^T is read by wgmma (the async proxy)

    def pv(acc_refs):
      for h in range(2):
        plgpu.wgmma(acc_refs[h], k_main.at[slot, h].transpose((1, 0)),
                    p_t.at[slot].transpose((1, 0)))

    accs = pl.run_state(pv)(tuple(
        plgpu.ACC.init(acc * lax.broadcast_in_dim(alpha, acc.shape, [1])) for acc in accs))
    plgpu.barrier_arrive(free_bar.at[slot])
    return accs, m_new, l

  accs, m, l = lax.fori_loop(0, steps, step, ((zeros, zeros), m, l))
  return accs, m, l.sum(axis=0)


def attend(q, sets, attn_sink, *, fmts, sm_scale, config, num_splits: int = 1,
           query_len: int | None = None):
  """:func:`jax_mla.sparse_mla.mosaic.attend` for ``h_q`` up to 32. ``query_len``: the
  tokens are a decode's ``[b, query_len]`` queries (the sets' lengths per request,
  ``[b]``), and the LSE comes as FlashMLA's
  decode LSE ``[b, h_q, query_len]`` (without splits the kernel writes it so: no
  transpose after it)."""
  plgpu = _mosaic.plgpu()
  tokens, h_q, d_qk = q.shape
  blocks, heads = _mosaic.transposed_tiles(h_q)
  h_pad = blocks * heads
  # Two producers (16 heads a CTA) issue a step's quantized row loads before they wait
  # for its slot: fp8_ds_mla b128 h16 220 -> 208 us, fp8_model1 h16 187 -> 175 us (H100,
  # benchmarks/RESULTS.md, session 22). One producer (32 heads) gained nothing.
  early = config.producers > 1 and config.producer_registers >= EARLY_MIN_REGISTERS
  # With one consumer, a producer issues a step's RoPE copies as soon as the consumer
  # has the slot's last S^T, not after the slot is free (where kernel_inputs' gathers
  # take them): fp8_ds_mla b128 h16 GPU time 153.5-154.4 -> 151.3-152.9 us (H100, same
  # process, two runs, bit-equal; benchmarks/RESULTS.md, session 41).
  gathers, lengths, all_indices, all_rows = kernel_inputs(
      sets, fmts, d_qk, early=early, query_len=query_len, early_rope=config.consumers == 1)
  early_rope = any(g.early_rope for g in gathers)
  # One consumer, no splits, at most 16 heads a CTA: a CTA per SM takes item after item,
  # its producers gathering the next item's first stages while the consumer finishes
  # the last one, and the next query landing in a second buffer (190 of 227 KiB of
  # SMEM; 32 heads a CTA do not fit two, and with one they were 2-4% slower). Keep the
  # 16-head kernel within the 196 KiB shared-memory carve-out: past it the driver leaves
  # L1 28 KiB instead of 60, and the gather's row loads, which go through L1, ran 10%
  # slower (16 KiB more SMEM: fp8_ds_mla h16 154 -> 169 us); more L1 than 60 KiB gained
  # nothing (benchmarks/RESULTS.md, session 39).
  persistent = config.consumers == 1 and num_splits == 1 and heads <= 16
  items = tokens * blocks
  ctas = min(items, num_sms())
  tail = prefill_tail(items, ctas, all_indices, persistent=persistent, query_len=query_len)
  # The query's and the output's rows a token: h_q where the last head block goes
  # unpadded (not with splits, whose combine reads whole blocks), else h_pad.
  q_rows = h_q if num_splits == 1 and ragged_block(h_q, heads, tokens, tail) else h_pad
  # The kernel loads a whole block's sinks: -inf in the padding heads.
  sink = padded_sinks(None if attn_sink is None else attn_sink.astype(jnp.float32), h_pad)
  if q_rows > h_q:  # zero queries in the padding heads, dropped after
    q = jnp.pad(q, ((0, 0), (0, h_pad - h_q), (0, 0)))
  row = max(heads, _mosaic.MIN_VECTOR_ROW)
  direct_lse = query_len is not None and num_splits == 1  # the kernel writes [b, h, s_q]
  # Split parts are combined before the sinks apply: the kernel then runs without.
  inputs, restore = leading_inputs(lengths, q.reshape(tokens * q_rows, d_qk),
                                   sink if num_splits == 1 else None)

  tiles = _mosaic.swizzled(plgpu)
  rope = max(d_qk - D_MAIN, TILE)  # d_qk 512: an unused 64-column stand-in
  num_stages = config.num_stages
  shared_smem, shared_barrier = _mosaic.shared_scratch(plgpu, heads, num_stages)
  q_buffers = 2 if persistent else 1
  smem = (
      plgpu.SMEM((q_buffers, 2, heads, HALF), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((q_buffers, heads, rope), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((num_stages, 2, BLOCK_K, HALF), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((num_stages, BLOCK_K, rope), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((num_stages + 2 * config.producers, BLOCK_K), jnp.int32),
      plgpu.SMEM((num_stages, heads, BLOCK_K), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((2, row), jnp.float32),
      shared_smem,
  )
  q_copies = 2 + (d_qk > D_MAIN)  # NoPE halves, RoPE
  barriers = (
      plgpu.Barrier(num_arrivals=q_copies, num_barriers=q_buffers),
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),  # stage gathered (producer)
      plgpu.Barrier(num_arrivals=config.consumers, num_barriers=num_stages),  # stage free
      plgpu.Barrier(num_arrivals=2),  # both consumers done with the query (two only)
      shared_barrier,
  ) + ((plgpu.Barrier(num_arrivals=1, num_barriers=q_buffers),)  # a query buffer is free
         if persistent else ()) + (
      (plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),)  # a RoPE tile is read
      if early_rope else ())
  kernel = functools.partial(_kernel, plgpu=plgpu, heads=heads, h_pad=h_pad, q_rows=q_rows,
                             d_qk=d_qk,
                             config=config, gathers=gathers, scale=sm_scale * LOG2E,
                             tokens=tokens, splits=num_splits, query_len=query_len,
                             direct_lse=direct_lse, persistent=persistent, tail=tail,
                             early_rope=early_rope)

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*restore(refs), smem_refs, bar_refs),
                  smem, barriers, collective_axes="wg")

  n = num_splits * tokens
  shares = tail[0] * tail[1]
  out_type = (jax.ShapeDtypeStruct((n * q_rows, D_MAIN), jnp.bfloat16),
              jax.ShapeDtypeStruct((n * blocks, row), jnp.float32),
              jax.ShapeDtypeStruct((tokens // query_len, q_rows, query_len) if direct_lse
                                   else (n * blocks, row), jnp.float32))
  if shares:
    out_type += (jax.ShapeDtypeStruct((shares * heads, D_MAIN), jnp.bfloat16),
                 jax.ShapeDtypeStruct((shares, row), jnp.float32),
                 jax.ShapeDtypeStruct((shares, row), jnp.float32))
  grid = ({"grid": (ctas,), "grid_names": ("p",)} if persistent
          else {"grid": (tokens, blocks), "grid_names": ("t", "h")} if num_splits == 1
          else {"grid": (tokens, num_splits, blocks), "grid_names": ("t", "s", "h")})
  out, max_logits, lse, *tail_out = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): out_type}, **grid,
      num_threads=config.consumers + config.producers, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*inputs, *all_indices, *all_rows)
  if num_splits > 1:  # the combine reads the padded rows as they are (no slice copies)
    out, max_logits, lse = merge_mosaic.combine(
        out.reshape(num_splits, tokens * h_pad, D_MAIN), lse.reshape(num_splits, -1, row),
        max_logits.reshape(num_splits, -1, row), sink, heads=h_pad)
  else:  # rows of `row`, the first `heads` used; a direct LSE is [b, q_rows, s_q] already
    max_logits = max_logits[:, :heads]
    lse = lse if direct_lse else lse[:, :heads]
  if shares:  # persistent CTAs take 16-head items, one a token: the last r tokens
    out, max_logits, lse = combine_tail(out, max_logits, lse, tail_out, tail, sink,
                                        heads=h_pad)
  max_logits = max_logits.reshape(tokens, h_pad)[:, :h_q]
  lse = (lse[:, :h_q] if direct_lse
         else decode_lse(lse.reshape(tokens, h_pad)[:, :h_q], query_len))
  return out.reshape(tokens, q_rows, D_MAIN)[:, :h_q], max_logits, lse
