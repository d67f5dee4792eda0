"""Pallas Mosaic GPU kernels (Hopper wgmma) for sparse MLA prefill and decode.

The second backend of :func:`jax_mla.sparse_mla.sparse_mla_prefill` and
:func:`jax_mla.sparse_mla.sparse_mla_decode` (``implementation="mosaic"``, and the
default on Hopper GPUs for the shapes it takes). One CTA takes one query token and a
block of its heads, and three warpgroups: a producer that gathers the token's key
rows, 64 per step, into a two-stage shared-memory ring of bf16 tiles
(:mod:`.mosaic_gather`, shared by both kernels), and two consumers that take the
stages in turns:

- ``h_q`` a multiple of 64 (this module): 64 heads per CTA. The two consumer
  warpgroups each own 256 of the 512 output columns; one computes a stage's ``S = Q
  K^T`` (64 x 64 over the 512 + 64 RoPE or 512 columns), masks the invalid columns to
  ``-inf``, runs the online softmax in base 2 and hands ``P`` to both through SMEM;
  both multiply ``P`` by their half of ``V`` (the first 512 columns of the same rows)
  (:func:`jax_mla._mosaic.consume_stages`). With ``Config.pair`` the two head blocks
  of a token (``h_q`` a multiple of 128, quantized caches) run as a 2-CTA cluster and
  split each step's gather between their producers. With ``Config.half_stages`` (bf16
  prefill, the default there) the consumers take the stages in pairs instead
  (:func:`jax_mla._mosaic.consume_pairs`), each stage arriving in two halves. Without a
  pair and with one split the CTAs are persistent, one per SM, taking (token, head
  block) items one after another: the producer gathers an item's first stage while the
  consumers still finish the last item, then loads the item's query once the
  consumers are done with the last one's (with half stages, after their last ``S``;
  otherwise once the output has left the query's SMEM, its staging).
- ``h_q`` up to 32 (:mod:`.mosaic_transposed`): a CTA takes a token with the keys on
  the wgmma M side (``S^T = K Q^T``, ``O^T = V^T P^T``), so no tensor-core row is
  spent on a head that is not there; at up to 16 heads the CTAs are persistent, one
  per SM, each taking token after token.
- decode with few tokens (either kernel): each token's key steps are split over
  ``Config.num_splits`` CTAs and the parts combined by :mod:`jax_mla.merge_mosaic`
  (H200, fp8_ds_mla h128 topk 2048, b 4: 16 splits 44-47 us, one 124-129 us).
- any other ``h_q``: the head-block kernel, whose last head block of fewer than 64
  heads is read and written as it is where :func:`ragged_heads` allows (48 or 80 heads:
  no copy of the query or the output around the kernel), else padded with zero queries
  (``-inf`` sinks) to a multiple of 64. Each CTA gathers all of its token's rows, so
  fewer CTAs gather less (H100, fp8_ds_mla b128 s_q 2 topk 2048: h 48 in two
  transposed 32-head CTAs 472.7 us, padded to one 64-head CTA 255.6 us; h 32
  transposed 252.7 us; h 48 unpadded 201.6-203.3 us, session 42).

Shapes: any ``h_q``; everything else the public functions take: prefill ``d_qk`` 576
or 512, decode in every cache format, with or without the extra set.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _mosaic, merge_mosaic
from jax_mla._common import LOG2E, cdiv, num_sms
from jax_mla.cache.ds_mla import DsMla
from jax_mla.cache.layout import Format
from jax_mla.cache.model1 import Model1
from jax_mla.sparse_mla import mosaic_transposed
from jax_mla.sparse_mla.mosaic_gather import (
  BLOCK_K,
  D_MAIN,
  HALF,
  TILE,
  block_rows,
  combine_tail,
  decode_lse,
  dequantized,
  first_steps,
  init_pair,
  kernel_inputs,
  leading_inputs,
  load_sinks,
  padded_sinks,
  prefill_tail,
  produce,
  produce_halves,
  ragged_block,
  run_items,
  split_steps,
  store_decode_lse,
  tail_row,
)

BLOCK_H = 64  # query heads per CTA: one wgmma M
# The fewest key steps a decode split keeps (H200, fp8_ds_mla h128 topk 2048, s_q 1: at
# b 1 and 4, 16 splits of 2 steps 42-44 us, 8 of 4 steps 48-49 us, one split 128 us).
MIN_SPLIT_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Mosaic GPU sparse MLA kernels (results do not depend on it).

  Attributes:
    num_stages: key stages in the shared-memory ring; 72 KiB query + 2 x 72 KiB key
      stages fill the 227 KiB of SMEM, so 1 or 2.
    consumer_registers, producer_registers: registers per thread of each consumer
      warpgroup and of each producer (``setmaxnreg``: multiples of 8 in [24, 256]).
      ``consumers * consumer + producers * producer`` must be
      :func:`jax_mla._mosaic.register_budget` (504 with three warpgroups, 512 with two
      or four): setmaxnreg only moves registers between warpgroups, and the consumers'
      increase waits forever for registers nobody frees (a hang seen with 224 / 64).
    producers: producer warpgroups, each gathering every ``producers``-th step (its own
      step's loads in flight); 2 needs ``num_stages`` 2 and the transposed kernel (``h_q``
      up to 32, see :func:`transposed`), whose consumers need fewer registers.
    consumers: consumer warpgroups: 2, or 1 on the transposed kernel, where one
      warpgroup takes every stage (``S^T``, softmax and all 512 rows of ``O^T``) and
      the registers it leaves go to the producers.
    pair: head-block kernel, quantized caches, ``h_q`` a multiple of 128 (ignored
      otherwise): the two head blocks of a token run as a 2-CTA cluster and each
      gathers half of every step's rows into both CTAs' stages (FlashMLA's split), so
      each row is loaded and dequantized once per token, not once per head block.
    half_stages: bf16 prefill on the head-block kernel: the consumers take the
      stages in pairs (:func:`jax_mla._mosaic.consume_pairs`) and the producer fills
      each stage in two halves that arrive on their own barriers as the copies land
      (:func:`.mosaic_gather.produce_halves`, FlashMLA's sm90 sparse prefill schedule).
      Each consumer stages its output in its half of the last stage's slot and frees
      the query after its last ``S``, so a persistent CTA loads the next item's query
      and first stage while the last item finishes. On by default for prefill (H100
      figures at :func:`default_config`).
    num_splits: decode: CTAs per token and head block, each taking an equal share of
      the token's key steps; the parts are combined by
      :func:`jax_mla.merge_mosaic.combine` (a second Mosaic GPU kernel). None picks
      :func:`jax_mla._mosaic.default_num_splits` (1 once the tokens' head blocks fill
      the SMs); ``pair`` is off when it is above 1. Prefill runs 1.
  """
  num_stages: int = 2
  consumer_registers: int = 208
  producer_registers: int = 88
  producers: int = 1
  consumers: int = 2
  pair: bool = False
  half_stages: bool = False
  num_splits: int | None = None

  def __post_init__(self):
    if self.num_stages not in (1, 2):
      raise ValueError(f"num_stages must be 1 or 2 (shared memory); got {self.num_stages}")
    if self.producers not in (1, 2) or self.num_stages % self.producers:
      raise ValueError(f"producers must be 1, or 2 with num_stages 2; got {self.producers} "
                       f"with num_stages {self.num_stages}")
    regs = (self.consumer_registers, self.producer_registers)
    if any(r % 8 or not 24 <= r <= 256 for r in regs):
      raise ValueError(f"register counts must be multiples of 8 in [24, 256]; got {regs}")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"num_splits must be None or >= 1; got {self.num_splits}")
    if self.consumers not in (1, 2):
      raise ValueError(f"consumers must be 1 or 2; got {self.consumers}")
    budget = _mosaic.register_budget(self.producers + self.consumers)
    c, p = self.consumers, self.producers
    if c * self.consumer_registers + p * self.producer_registers != budget:
      raise ValueError(
          f"{c} * consumer_registers + {p} * producer_registers must be {budget} "
          f"or the kernel hangs; got {c} * {self.consumer_registers} + {p} * "
          f"{self.producer_registers}")


def transposed(h_q: int) -> bool:
  """Whether ``h_q`` heads run on the transposed kernel (else on the head-block one:
  :func:`ragged_heads`)."""
  return h_q % BLOCK_H != 0 and h_q <= _mosaic.TRANSPOSED_MAX_ROWS


def ragged_heads(h_q: int, tokens: int, indices, *, num_splits: int,
                 query_len: int | None) -> bool:
  """Whether ``h_q`` heads (not a multiple of 64, above the transposed kernel's) run on
  the head-block kernel unpadded (:func:`.mosaic_gather.ragged_block`); ``indices``: the
  key sets' ``[T, topk]``."""
  items = tokens * cdiv(h_q, BLOCK_H)
  tail = prefill_tail(items, min(items, num_sms()), indices, persistent=num_splits == 1,
                      query_len=query_len)
  return ragged_block(h_q, BLOCK_H, tokens, tail)


def default_config(fmt: Format | None, h_q: int = BLOCK_H) -> Config:
  """The register split for rows of ``fmt`` (``None``: prefill's bf16 rows; a decode's
  main set decides for its extra set, which is quantized too when the main set is) and
  ``h_q`` heads; bf16 prefill on the head-block kernel: ``half_stages``.

  The producers are latency-bound. Head-block kernel (``h_q`` a multiple of 64): the
  consumers hold a 64 x 256 float32 accumulator; at 88 registers the fp8 producer keeps
  more rows' loads in flight than at 56 (H100, fp8_ds_mla b128 row: 269 vs 210 TFLOP/s;
  104 and 120 gave no more). The bf16 producer only issues ``cp.async`` copies: 40
  registers for bf16 decode rows. Prefill fills each stage in halves (``half_stages``;
  H100 side by side, 2026-11-26, three machines: V3.2 0.875-0.899x, V4 h128
  0.867-0.909x FlashMLA, against 0.817x and 0.841x without; with warpgroup 0 leading the
  pairs, session 29, one machine: 0.918x and 0.955x), now in persistent CTAs: the
  producer tracks the ring across items and fills the next item's first stage out of
  order (session 31, H100, s_q 4096, interleaved A/Bs at 208 / 88 against the
  persistent kernel without halves: h 64 topk 128 346 / 387 vs 458 / 490 us, 256 442 /
  452 vs 494 / 509, 512 719 / 681 vs 789 / 762; h 128 topk 256 762 / 797 vs 910 / 906,
  512 1282 / 1271 vs 1450 / 1417; against the non-persistent half stages: h 64 topk
  1024 1206 / 1193 vs 1199 / 1177, 2048 2230-2274 vs 2099-2175, slower; h 128 topk
  1024 2272 vs 2300, V3.2 4508 / 4594 vs 4642 / 4497). Its producer spills 392 bytes
  at 232 / 40, 100 at 216 / 72, 16 at 208 / 88, 8 at 200 / 104, 48 at 192 / 120; medians
  of three interleaved rounds, h 64 topk 512 / h 128 topk 1024: 208 / 88 717 / 2307 us,
  200 / 104 717 / 2260, 192 / 120 729 / 2323. Transposed kernel: one consumer
  warpgroup takes every stage (``consumers=1``), which frees the registers for a
  second producer (H100,
  interleaved medians of two runs, against two consumers and one producer at 176 / 152):
  16 heads a CTA, two producers at 160 beside a consumer at 184: fp8_ds_mla b128 h16
  225.5 / 237.5 vs 240.8 / 247.5 us, fp8_model1 h16 174.1 / 171.0 vs 183.8 / 186.4 us;
  bf16 prefill h16 (s_q 1024) 512.1 us at 232 / 136 vs 603.6 us. 32 heads a CTA: the
  consumer's accumulators need 256 registers, so one producer (fp8_ds_mla b128 h32 258.3
  / 257.4 vs 280.1 / 283.4 us; two producers beside a consumer at 184-232: 310-483 us).
  With two consumers, two producers left them 168 or fewer registers (285 us at 168 /
  88).

  ``pair`` (H100, V4 decode rows b256 h128, interleaved medians): fp8_v41 542 / 531 us
  with it, 576 / 585 us without; fp8_model1 540 / 548 us with, 548 / 552 us without;
  fp8_ds_mla b128 is slower with it (532 vs 477 us: its 656-byte rows, RoPE included,
  then go through registers twice), so it stays off there (2026-11-26: 502-525 vs 450
  us). A paired producer gathers half the rows: 72 registers leave the consumers 216
  (H100, fp8_model1 b256 h128, interleaved medians of two runs: 461.4 / 475.3 us against
  487.8 / 510.4 at 208 / 88; 224 / 56 509.8, 200 / 104 498.2). Unpaired, 216 / 72 is
  slower (fp8_ds_mla b128 498.1 vs 435.6 us, fp8_model1 h64 214.1 vs 202.5) and 200 /
  104 the same (436.5, 201.2). The V4.1 formats' paired producers keep 88 (fp8_v41,
  fp8_v41 + fp4_v41, fp4_v41 h128: 477.8 / 475.2 / 477.0 us at 208 / 88, 478.6 / 484.1 /
  489.4 at 216 / 72).
  """
  if transposed(h_q):
    if _mosaic.transposed_tiles(h_q)[1] > _mosaic.TRANSPOSED_ROW_ALIGN:
      return Config(consumer_registers=256, producer_registers=256, consumers=1)
    if dequantized(fmt):
      return Config(consumer_registers=184, producer_registers=160, consumers=1, producers=2)
    return Config(consumer_registers=232, producer_registers=136, consumers=1, producers=2)
  if dequantized(fmt):
    pair = h_q % (2 * BLOCK_H) == 0 and not isinstance(fmt, DsMla)
    if pair and isinstance(fmt, Model1):
      return Config(consumer_registers=216, producer_registers=72, pair=True)
    return Config(consumer_registers=208, producer_registers=88, pair=pair)
  if fmt is None:
    return Config(consumer_registers=200, producer_registers=104, half_stages=True)
  return Config(consumer_registers=232, producer_registers=40)


def check_supported(q, fmts: tuple[Format, ...] = ()) -> None:
  """Raises ``ValueError`` for what these kernels do not take (Triton does): decode
  caches (formats ``fmts``) other than bf16 ``"auto"``, ``"fp8_ds_mla"``,
  ``"fp8_model1"``, ``"fp8_v41"`` and ``"fp4_v41"``. Every ``q`` shape the public
  functions take is taken."""
  del q
  for fmt in fmts:
    if not (dequantized(fmt) or fmt.name == "auto"):
      raise ValueError(f"the Mosaic GPU sparse MLA kernel does not read {fmt.name!r} caches; "
                       "use implementation='triton'")


def _kernel(len_ref, q_ref, sink_ref, *refs, plgpu, h_q, d_qk, config, gathers, scale, pair,
            tokens, splits, query_len, direct_lse, persistent, halves, tail):
  """``gathers``: one :func:`.mosaic_gather.gather_fn` per key set; ``len_ref`` (None:
  no set has lengths) and ``sink_ref`` (None: no sink) as
  :func:`.mosaic_gather.leading_inputs` gives them; ``refs``: the sets' indices, then
  their caches, then the outputs, the SMEM refs and the barriers.
  ``splits`` above 1: this CTA takes split ``s`` of the token's steps and writes part
  ``s`` of the outputs (rows ``s * tokens * h_q + ...``). ``query_len``: the tokens are a
  decode's ``[b, query_len]`` queries, whose lengths are per request (``[n, b]``);
  ``direct_lse``: the LSE output is ``[b, h_q, query_len]``. ``persistent``: one CTA
  per SM takes (token, head block) items one after another
  (:func:`.mosaic_gather.run_items`); ``tail`` ``(r, parts)``: its last ``r`` items are
  taken in ``parts`` shares, whose results (no sink applied) go to three more outputs,
  share ``j`` of tail item ``i`` at rows ``(j * r + i) * 64 ..``: ``O`` ``[parts * r * 64,
  512]``, max logits and LSE ``[parts * r * 64]``. ``halves``: ``Config.half_stages``
  applies (each gather is a pair of halves; the consumers run
  :func:`jax_mla._mosaic.consume_pairs`)."""
  num_sets = len(gathers)
  idx_refs, kv_refs = refs[:num_sets], refs[num_sets:2 * num_sets]
  o_ref, ml_ref, lse_ref, *tail_refs, smem, barriers = refs[2 * num_sets:]
  q_main, q_rope, kv_main, kv_rope, valid, stats, p_stats, *pair_bars = smem
  q_bar, kv_bar, free_bar, done_bar, p_ready, *q_free = barriers
  q_free = q_free[0] if persistent else None
  if halves:  # consume_pairs' scratch rows 0-1 are free once it returns: the output staging
    stats = p_stats
    valid_bar = kv_bar  # a slot's validity row written
    # The halves' mbarriers, hand-rolled (cp.async arrives on them), in valid's spare
    # row 2: an allocation of their own takes a 1 KiB block, and 928 bytes are left.
    loaded = lambda part: valid.at[2, pl.ds(2 * part, 2)]  # noqa: E731
    valid[3, 0] = jnp.int32(0)  # consume_pairs' zero_ref: an offset LLVM cannot fold
    _mosaic.init_mbarriers(plgpu, valid.at[2], count=4, arrivals=128)  # the producer's threads
  wg = lax.axis_index("wg")
  blocks = cdiv(h_q, BLOCK_H)
  last_heads = h_q - (blocks - 1) * BLOCK_H  # the last head block's (below 64: see attend)
  has_rope = d_qk > D_MAIN
  if pair:
    init_pair(plgpu, pair_bars[0])

  def item(t, h, share=None):
    """Token ``t``, head block ``h`` (``share`` of it: a tail item's, or -1 for all):
    ``(first head, request, first, base)``. The sets' steps run back to back in one
    softmax: set k's rows are steps first[k] .. first[k + 1] - 1."""
    if pair:
      h = h * 2 + lax.axis_index("c")
    request = t if query_len is None else lax.div(t, query_len)
    first, base = split_steps(first_steps(len_ref, request, idx_refs,
                                          [g[0] for g in gathers] if halves else gathers),
                              splits if share is None else tail[1], share)
    return h * BLOCK_H, request, first, base

  def for_each_item(body):
    # The ring's state after an item: its steps so far, or with halves how often each
    # slot was filled (stage i of an item goes into slot i % 2).
    run_items(body, persistent=persistent, tokens=tokens, blocks=blocks // (1 + pair),
              ring=(0, 0) if halves else 0, tail=tail)

  def ring_after(ring, steps):
    if halves:
      return ring[0] + lax.div(steps + 1, 2), ring[1] + lax.div(steps, 2)
    return ring + steps

  @pl.when(wg < 2)
  def _consumer():
    _mosaic.set_registers(plgpu, config.consumer_registers, 3)

    def mask(i, slot):
      del i

      def apply(s):  # the producer wrote each row's validity beside the stage
        if halves:
          plgpu.barrier_wait(valid_bar.at[slot])
        ok = plgpu.load(valid.at[slot], (), layout=_mosaic.col_layout(plgpu), optimized=False)
        return jnp.where(lax.broadcast_in_dim(ok, s.shape, [1]) != 0, s, -jnp.inf)

      return apply

    def loaded_after(uses):
      def wait_loaded(i, slot, half):  # stage i is slot's (uses[slot] + i // 2)-th fill
        _mosaic.wait_parity(plgpu, loaded(_mosaic.half_part(slot, half)),
                            lax.rem(uses[slot] + lax.div(i, 2), 2))

      return wait_loaded

    def release(slot, half):
      plgpu.barrier_arrive(free_bar.at[_mosaic.half_part(slot, half)])

    def consume(k, t, h, ring_start, share=None):
      del k
      h0, _, first, _ = item(t, h, share)
      r0 = t * h_q + h0
      out_r0 = r0 if splits == 1 else lax.axis_index("s") * tokens * h_q + r0
      if halves:
        acc, m, l = _mosaic.consume_pairs(
            plgpu, wg=wg, q_main=q_main, k_main=kv_main, rope=kv_rope, has_rope=has_rope,
            steps=first[-1], barriers=(q_bar, loaded_after(ring_start), release),
            shared=p_stats, mask=mask, scale=scale,
            zero_ref=valid.at[3, pl.ds(0, 1)], query_done=lambda: plgpu.barrier_arrive(q_free))
      else:
        acc, m, l = _mosaic.consume_stages(
            plgpu, wg=wg, q_main=q_main, q_rope=q_rope if has_rope else None, k_main=kv_main,
            k_rope=kv_rope, steps=first[-1], barriers=(
                q_bar, *_mosaic.stage_barriers(plgpu, kv_bar, free_bar), done_bar),
            shared=(p_stats, p_ready), mask=mask, scale=scale, ring_start=ring_start,
            persistent=persistent)
      sink = load_sinks(plgpu, sink_ref, h0, BLOCK_H, _mosaic.row_layout(plgpu), share)
      inv, max_logits, lse = _mosaic.sink_epilogue(m, l, sink)
      out = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(q_main.dtype)

      def store(staging):
        staging[...] = out

        @pl.when(wg == 0)
        def _():
          stats.at[0][...] = max_logits

        @pl.when(wg == 1)
        def _():
          stats.at[1][...] = lse

        plgpu.commit_smem()

        def copy_out(o_dst, ml_dst, lse_dst, r0, count, direct):
          rows = pl.ds(r0, count)
          used = lambda ref: ref if count == BLOCK_H else ref.at[pl.ds(0, count)]  # noqa: E731
          plgpu.copy_smem_to_gmem(used(staging), o_dst.at[rows, pl.ds(wg * HALF, HALF)])

          @pl.when(wg == 0)
          def _():
            plgpu.copy_smem_to_gmem(used(stats.at[0]), ml_dst.at[rows])

          @pl.when(wg == 1)
          def _():
            if not direct:
              plgpu.copy_smem_to_gmem(used(stats.at[1]), lse_dst.at[rows])
            else:
              store_decode_lse(plgpu, stats.at[1], lse_dst, t=t, h0=h0, count=count,
                               query_len=query_len)

        def item_rows():  # a ragged last head block writes its heads' rows alone
          block_rows(lambda count: copy_out(o_ref, ml_ref, lse_ref, out_r0, count,
                                            direct_lse), h, blocks, BLOCK_H, last_heads)

        if share is None:
          item_rows()
        else:
          row = tail_row(tail, tokens, blocks, t, h, share)
          pl.when(share < 0)(item_rows)
          pl.when(share >= 0)(lambda: copy_out(
              *tail_refs, row * BLOCK_H, BLOCK_H, False))

      steps = first[-1]
      if halves:
        # The output is staged in this warpgroup's half of the last stage's slot, which
        # consume_pairs left held, so the next query loads while this item finishes.
        # Without a stage, in the query's SMEM (nothing read it).
        last = lax.rem(steps + 1, 2)
        pl.when(steps > 0)(lambda: store(kv_main.at[last, wg]))
        pl.when(steps == 0)(lambda: store(q_main.at[wg]))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        # Its warpgroup barrier keeps the next item's hand-off stores into stats
        # (consume_pairs' store_unsynced) behind this store's reads of its rows.
        plgpu.commit_smem()
        pl.when(steps > 0)(lambda: release(last, wg))
        pl.when(steps == 0)(lambda: plgpu.barrier_arrive(q_free))
      else:
        # Both consumers are done with Q: its halves become the output staging.
        store(q_main.at[wg])
        if persistent:  # the next query may land once the output has left its SMEM
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          plgpu.barrier_arrive(q_free)
        plgpu.wait_smem_to_gmem(0)
      return ring_after(ring_start, steps)

    for_each_item(consume)

  @pl.when(wg == 2)
  def _producer():
    _mosaic.set_registers(plgpu, config.producer_registers, 3)

    def gather(k, t, h, ring_start, share=None):
      h0, request, first, base = item(t, h, share)
      rows = pl.ds(t * h_q + h0, BLOCK_H)
      q_copies = [(q_ref.at[rows, pl.ds(c * HALF, HALF)], q_main.at[c]) for c in range(2)]
      if has_rope:
        q_copies.append((q_ref.at[rows, pl.ds(D_MAIN, d_qk - D_MAIN)],
                         kv_rope.at[2] if halves else q_rope))
      # A persistent CTA's next query waits until its SMEM is free: the last item's output
      # has left it, or with halves, the consumers computed their last S.
      q_gate = (None if q_free is None
                else lambda: pl.when(k > 0)(lambda: plgpu.barrier_wait(q_free)))
      if halves:
        produce_halves(plgpu, t=t, q_copies=q_copies, gather=gathers[0], idx_ref=idx_refs[0],
                       kv_ref=kv_refs[0], len_ref=len_ref, kv_main=kv_main, kv_rope=kv_rope,
                       valid=valid, barriers=(q_bar, loaded, free_bar, valid_bar),
                       first=first, base=base, request=request, uses=ring_start,
                       q_gate=q_gate)
        return ring_after(ring_start, first[-1])
      produce(plgpu, t=t, q_copies=q_copies, gathers=gathers, idx_refs=idx_refs,
              len_ref=len_ref, kv_refs=kv_refs, kv_main=kv_main, kv_rope=kv_rope, valid=valid,
              barriers=(q_bar, kv_bar, free_bar), first=first, base=base, request=request,
              pair=pair_bars[0] if pair else None, ring_start=ring_start, q_gate=q_gate)
      return ring_after(ring_start, first[-1])

    for_each_item(gather)

  if pair:  # neither CTA leaves while the other may still write to or arrive in it
    _mosaic.cluster_sync(plgpu)


def attend(q, sets, attn_sink, *, fmts, sm_scale, config, num_splits: int = 1,
           query_len: int | None = None):
  """The kernels over tokens ``q[T, h_q, d_qk]`` and key sets sharing one softmax.

  Each set is ``(cache, indices[T, topk], lengths[T])``: ``cache[num_blocks,
  block_size, width]`` holds bf16 latents or the bytes of its format in ``fmts`` (one
  per set; see :func:`.mosaic_gather.gather_fn`); ``lengths`` (int32) are clipped to
  ``[0, topk]`` in the kernel, and None means the whole ``topk``. ``num_splits``: see
  ``Config.num_splits``. Returns ``(out bf16[T, h_q, 512], max_logits f32[T, h_q], lse
  f32[T, h_q])``; with ``query_len`` (the tokens are a decode's ``[b, query_len]``
  queries), the sets' lengths are per request (``[b]``) and ``lse`` is FlashMLA's
  decode LSE ``[b, h_q, query_len]``.
  """
  h_q = q.shape[1]
  if transposed(h_q):
    return mosaic_transposed.attend(q, sets, attn_sink, fmts=fmts, sm_scale=sm_scale,
                                    config=config, num_splits=num_splits, query_len=query_len)
  tokens = q.shape[0]
  ragged = h_q % BLOCK_H != 0 and ragged_heads(h_q, tokens, [idx for _, idx, _ in sets],
                                               num_splits=num_splits, query_len=query_len)
  if h_q % BLOCK_H and not ragged:  # zero queries, -inf sinks in the padding heads, dropped
    pad = cdiv(h_q, BLOCK_H) * BLOCK_H - h_q
    sink = padded_sinks(None if attn_sink is None else attn_sink.astype(jnp.float32),
                        h_q + pad)
    out, max_logits, lse = attend(jnp.pad(q, ((0, 0), (0, pad), (0, 0))), sets, sink,
                                  fmts=fmts, sm_scale=sm_scale, config=config,
                                  num_splits=num_splits, query_len=query_len)
    return out[:, :h_q], max_logits[:, :h_q], lse[:, :h_q]
  if config.producers != 1 or config.consumers != 2:
    raise ValueError(f"the Mosaic GPU kernel for h_q a multiple of {BLOCK_H} runs one "
                     f"producer and two consumers; got Config(producers={config.producers}, "
                     f"consumers={config.consumers})")
  plgpu = _mosaic.plgpu()
  tokens, h_q, d_qk = q.shape
  pair = (config.pair and num_splits == 1 and h_q % (2 * BLOCK_H) == 0
          and all(map(dequantized, fmts)))
  halves = (config.half_stages and fmts == (None,) and num_splits == 1
            and config.num_stages == 2)
  gathers, lengths, all_indices, all_rows = kernel_inputs(sets, fmts, d_qk, pair=pair,
                                                          query_len=query_len, halves=halves)
  # Split parts are combined before the sinks apply: the kernel then runs without.
  sink = None if attn_sink is None or num_splits > 1 else attn_sink.astype(jnp.float32)
  if ragged:  # the kernel loads a whole block's sinks
    sink = padded_sinks(sink, cdiv(h_q, BLOCK_H) * BLOCK_H)
  direct_lse = query_len is not None and num_splits == 1  # the kernel writes [b, h_q, s_q]
  inputs, restore = leading_inputs(lengths, q.reshape(tokens * h_q, d_qk), sink)

  tiles = _mosaic.swizzled(plgpu)
  rope = max(d_qk - D_MAIN, TILE)  # d_qk 512: an unused 64-column stand-in
  # consume_pairs hands off through named barriers: it takes no mbarriers of its own.
  shared_smem, shared_barrier = ((_mosaic.pair_scratch(plgpu, BLOCK_H), None) if halves else
                                 _mosaic.shared_scratch(plgpu, BLOCK_H, config.num_stages))
  smem = (
      plgpu.SMEM((2, BLOCK_H, HALF), jnp.bfloat16, transforms=tiles),
      None if halves else plgpu.SMEM((BLOCK_H, rope), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((config.num_stages, 2, BLOCK_K, HALF), jnp.bfloat16, transforms=tiles),
      plgpu.SMEM((config.num_stages + 2 * halves, BLOCK_K, rope), jnp.bfloat16,
                 transforms=tiles),
      plgpu.SMEM((config.num_stages + 2, BLOCK_K), jnp.int32),  # one producer
      None if halves else plgpu.SMEM((2, BLOCK_H), jnp.float32),
      shared_smem,
  ) + ((plgpu.SMEM((config.num_stages, 4), jnp.uint32),) if pair else ())
  q_copies = 2 + (d_qk > D_MAIN)  # NoPE halves, RoPE
  # Without a pair or splits, one CTA per SM takes item after item: the producer
  # gathers the next item's first stage while the consumers finish the last one.
  persistent = not pair and num_splits == 1
  items = tokens * cdiv(h_q, BLOCK_H)
  ctas = min(items, num_sms())
  tail = prefill_tail(items, ctas, all_indices, persistent=persistent, query_len=query_len)
  # A pair's producers store into both CTAs' stages: both CTAs' consumers free a stage.
  free_barrier = (functools.partial(plgpu.ClusterBarrier, collective_axes=("c",)) if pair
                  else plgpu.Barrier)
  parts = config.num_stages * (1 + halves)
  barriers = (
      plgpu.Barrier(num_arrivals=q_copies),
      # A stage gathered (halves: a slot's validity written).
      plgpu.Barrier(num_arrivals=1, num_barriers=config.num_stages),
      free_barrier(num_arrivals=2 - halves, num_barriers=parts),  # free: its readers
      None if halves else plgpu.Barrier(num_arrivals=2),  # both consumers done with Q
      shared_barrier,
  ) + ((plgpu.Barrier(num_arrivals=2),) if persistent else ())  # the query's SMEM is free
  kernel = functools.partial(_kernel, plgpu=plgpu, h_q=h_q, d_qk=d_qk, config=config,
                             gathers=tuple(gathers), scale=sm_scale * LOG2E, pair=pair,
                             tokens=tokens, splits=num_splits, query_len=query_len,
                             direct_lse=direct_lse, persistent=persistent, halves=halves,
                             tail=tail)

  def entry(*refs):
    pl.run_scoped(lambda smem_refs, bar_refs: kernel(*restore(refs), smem_refs, bar_refs),
                  smem, barriers, collective_axes="wg")

  n = tokens * h_q
  tail_rows = tail[0] * tail[1] * BLOCK_H
  out_type = (jax.ShapeDtypeStruct((num_splits * n, D_MAIN), jnp.bfloat16),
              jax.ShapeDtypeStruct((num_splits * n,), jnp.float32),
              jax.ShapeDtypeStruct((tokens // query_len, h_q, query_len) if direct_lse
                                   else (num_splits * n,), jnp.float32))
  if tail_rows:
    out_type += (jax.ShapeDtypeStruct((tail_rows, D_MAIN), jnp.bfloat16),
                 jax.ShapeDtypeStruct((tail_rows,), jnp.float32),
                 jax.ShapeDtypeStruct((tail_rows,), jnp.float32))
  # The head blocks of one token run side by side (adjacent in launch order, the last
  # grid axis being blockIdx.x, or adjacent items of adjacent persistent CTAs): they
  # gather the same rows, which L2 then serves once; a pair's are one cluster.
  grid = ({"grid": (tokens, h_q // BLOCK_H // 2), "grid_names": ("t", "h"), "cluster": (2,),
           "cluster_names": ("c",)} if pair
          else {"grid": (tokens, num_splits, cdiv(h_q, BLOCK_H)), "grid_names": ("t", "s", "h")}
          if num_splits > 1
          else {"grid": (ctas,), "grid_names": ("p",)})
  out, max_logits, lse, *tail_out = plgpu.kernel(
      entry, **{_mosaic.out_type_kwarg(plgpu): out_type}, **grid, num_threads=3,
      thread_name="wg", compiler_params=plgpu.CompilerParams(
          approx_math=True, **({"reduction_scratch_bytes": 0} if halves else {})),
  )(*inputs, *all_indices, *all_rows)
  if num_splits > 1:
    out, max_logits, lse = merge_mosaic.combine(
        out.reshape(num_splits, n, D_MAIN), lse.reshape(num_splits, n),
        max_logits.reshape(num_splits, n), attn_sink, heads=h_q)
  if tail_rows:  # the tail items' rows are the last r * 64
    out, max_logits, lse = combine_tail(out, max_logits, lse, tail_out, tail, sink, heads=h_q)
  if not direct_lse:
    lse = decode_lse(lse.reshape(tokens, h_q), query_len)
  return out.reshape(tokens, h_q, D_MAIN), max_logits.reshape(tokens, h_q), lse


def sparse_prefill(q, kv, indices, attn_sink, lengths, *, sm_scale, config: Config):
  """Prefill on the kernel (call under jit); inputs validated by
  :func:`jax_mla.sparse_mla.sparse_mla_prefill` and :func:`check_supported`.

  ``q[s_q, h_q, d_qk]``, ``kv[s_kv, d_qk]``, ``indices[s_q, topk]``, ``attn_sink``
  ``[h_q]`` float32 or None, ``lengths`` ``[s_q]`` int32 or None (every entry counts).
  Returns ``(out, max_logits, lse)``.
  """
  return attend(q, [(kv[:, None], indices, lengths)], attn_sink, fmts=(None,),
                 sm_scale=sm_scale, config=config)


def sparse_decode(q, sets, attn_sink, *, fmts: tuple[Format, ...], sm_scale, config: Config,
                  query_len: int | None = None):
  """Decode on the kernel (call under jit); inputs validated by
  :func:`jax_mla.sparse_mla.sparse_mla_decode` and :func:`check_supported`.

  ``q[T, h_q, d_qk]`` (batch and query position flattened); ``sets`` one or two
  ``(kv_cache[num_blocks, block_size, *], indices[T, topk] global slots, lengths[T] or
  None)`` (with ``query_len``: ``lengths[T / query_len]``, one per request),
  set ``k`` in format ``fmts[k]``, attended in one softmax. Returns ``(out, max_logits,
  lse)`` over ``T``; with ``query_len`` (``T = b * query_len``), ``lse`` is FlashMLA's
  decode LSE ``[b, h_q, query_len]`` (without splits, either kernel writes it so itself).
  """
  steps = sum(cdiv(idx.shape[1], BLOCK_K) for _, idx, _ in sets)
  ctas = q.shape[0] * (_mosaic.transposed_tiles(q.shape[1])[0] if transposed(q.shape[1])
                       else cdiv(q.shape[1], BLOCK_H))
  num_splits = config.num_splits or _mosaic.default_num_splits(ctas, steps,
                                                               min_blocks=MIN_SPLIT_STEPS)
  return attend(q, sets, attn_sink, fmts=fmts, sm_scale=sm_scale, config=config,
                num_splits=num_splits, query_len=query_len)
