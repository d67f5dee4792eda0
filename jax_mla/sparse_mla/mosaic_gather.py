"""The producer of the Pallas Mosaic GPU sparse MLA kernels: key rows gathered into SMEM.

Both sparse MLA kernels (:mod:`.mosaic`: 64 query heads per CTA; :mod:`.mosaic_transposed`:
fewer) run one producer warpgroup that loads the token's query tile once with TMA, then
gathers its key rows, 64 per step, into a ring of shared-memory stages of bf16 tiles
in the swizzled wgmma layout (:func:`produce`). Hopper has no gather TMA, so each
thread moves 16-byte pieces itself (8 threads per 128-byte tile row, FlashMLA's
split): bf16 rows with ``cp.async``; ``fp8_ds_mla`` and ``fp8_model1`` rows by loading
the fp8 bytes and their scales into registers, dequantizing, and storing bf16 (the
RoPE part, bf16 already, with ``cp.async``); DeepSeek V4.1's ``fp8_v41`` and
``fp4_v41`` rows likewise (Hopper has no fp4 tensor cores: e2m1 codes become bf16 by
a byte-permute table lookup on the way into shared memory). An invalid index reads
nothing and leaves a zero row, so NaN in unused slots never reaches the arithmetic.
It also writes each row's validity next to the stage. A decode with an extra key set
(DeepSeek V4) gathers the main set's steps, then the extra set's, into the same ring:
the consumers see one longer run of keys. Each step's indices were staged in SMEM by
the step before (``cp.async``), so only the rows' loads wait on memory (1.14x on the
fp8_ds_mla b128 h128 row). Where a producer has the registers (two producers at 16 heads
a CTA), it issues a step's quantized row loads before it waits for the step's slot to be
free, and dequantizes once the slot is (``gather_fn(early=True)``). Each set has its
own format (V4.1 pairs an ``fp8_v41`` main set with an ``fp4_v41`` extra set). The
quantized rows are read at the offsets of the formats' layout objects
(:mod:`jax_mla.cache.ds_mla`, :mod:`jax_mla.cache.model1`,
:class:`jax_mla.cache.layout.TileScaled`).

The two head-block CTAs of one token may run as a 2-CTA cluster (``pair``): each
producer then gathers half of every step's rows and stores them into both CTAs' stages
(``st.async``, counted by a per-stage mbarrier, :func:`init_pair`), so a row is
loaded and dequantized once per token, not once per head block.

With ``Config.half_stages`` (bf16 prefill on the head-block kernel) the producer fills
each stage in two halves for :func:`jax_mla._mosaic.consume_pairs`
(:func:`produce_halves`, FlashMLA's sm90 sparse prefill producer): each thread's copies
arrive on the half's own mbarrier as they land (``cp.async.mbarrier.arrive.noinc``),
so the producer waits only for free halves, never for its loads. It loads a pair of
stages' indices from GMEM into registers before it waits for the pair's first free
half, so no index load lies between a freed half and its refill (H100, V3.2 prefill
h128: 4605 -> 4196 us; benchmarks/RESULTS.md, session 37).

The gather refuses slots outside the cache itself, and, where a set has lengths, the
positions past its token's length (``gather_fn(masked=True)``), so with a ``topk`` that
is a multiple of 64 the indices and lengths go in as the caller gave them: the program
is the kernel alone (the torch bridge then launches it directly). Another ``topk`` is
padded to a multiple of 64 by an XLA pre-pass that also folds the positions past the
length into ``-1`` (:func:`clean_indices`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jax_mla import _inline, _mosaic, merge_mosaic
from jax_mla._common import cdiv
from jax_mla.cache import e2m1
from jax_mla.cache.ds_mla import DsMla
from jax_mla.cache.layout import Format, TileScaled
from jax_mla.cache.model1 import Model1
from jax_mla.sparse_mla.layout import valid_slots

BLOCK_K = 64  # gathered key rows per pipeline step
HALF = 256  # columns of one half of the 512 main columns (wgmma N <= 256)
D_MAIN = 512  # columns held as two 256-wide halves: V, and K's NoPE part
TILE = 64  # bf16 columns in one 128-byte swizzled tile row
THREADS_PER_ROW = TILE * 2 // 16  # 16-byte copies per tile row
_ROW_GROUPS = 128 // THREADS_PER_ROW  # a thread's rows: group, group + 16, group + 32, ...
# A producer's registers for early loads (:func:`gather_fn`): a step's loaded words (80
# for fp8_ds_mla) held across the wait, beside the gather's addresses.
EARLY_MIN_REGISTERS = 160


def dequantized(fmt: Format | None) -> bool:
  """Whether the producer dequantizes the rows (else it copies bf16 rows)."""
  return isinstance(fmt, (DsMla, Model1, TileScaled))


def clean_indices(indices, lengths, num_slots):
  """``indices[T, topk]`` -> ``[T, topk padded to 64]`` with every unusable entry ``-1``."""
  topk = indices.shape[1]
  indices = jnp.pad(indices, ((0, 0), (0, cdiv(topk, BLOCK_K) * BLOCK_K - topk)),
                    constant_values=-1)
  return jnp.where(valid_slots(indices, lengths, num_slots), indices, -1)


def kernel_inputs(sets, fmts, d_qk: int, pair: bool = False, early: bool = False,
                  query_len: int | None = None, halves: bool = False,
                  early_rope: bool = False):
  """What :func:`produce` reads, from key sets ``(cache[num_blocks, block_size, width],
  indices[T, topk], lengths[T] or None)`` (None: every entry counts) in formats
  ``fmts``: ``(gathers, lengths, indices (cleaned where ``topk`` is not a multiple of
  64), cache rows)``. ``lengths`` is ``[n, T]``, one row for each set that has lengths
  (:func:`first_steps` clips them to [0, topk]; a gather's ``length_row`` is its set's
  row, or None), or None where no set has any: the kernel then takes no lengths, and the
  program has no XLA op before it. ``query_len``: the tokens are a decode's ``[b,
  query_len]`` queries and the lengths are per request, ``[b]`` (rows ``[n, b]``; the
  kernel reads request ``t // query_len``'s). ``pair``: see :func:`gather_fn`;
  ``early``: its early loads for the quantized sets, and with ``early_rope`` (``d_qk``
  576) their RoPE copies apart (:func:`gather_fn`); ``halves`` (bf16 sets): each
  gather is a pair, the two halves of a stage (:func:`produce_halves`)."""
  gathers, all_indices, all_lengths, all_rows = [], [], [], []
  for (cache, indices, lengths), fmt in zip(sets, fmts, strict=True):
    num_blocks, block_size, width = cache.shape
    num_slots = num_blocks * block_size
    topk = indices.shape[1]
    masked = lengths is not None and topk % BLOCK_K == 0
    if topk % BLOCK_K:  # a partial last step: indices padded, unusable entries -1
      lengths = None if lengths is None else jnp.clip(lengths, 0, topk)
      per_token = (lengths if lengths is None or query_len is None
                   else jnp.repeat(lengths, query_len))
      indices = clean_indices(indices, per_token, num_slots)
    # Otherwise the gather refuses slots outside the cache and (masked) positions past
    # the length itself, and the kernel clips the lengths: no XLA pre-pass.
    all_indices.append(indices)
    all_rows.append(cache.reshape(num_slots, width))
    make = functools.partial(gather_fn, fmt=fmt, num_slots=num_slots, block_size=block_size,
                             row_bytes=width * cache.dtype.itemsize, d_qk=d_qk, pair=pair,
                             masked=masked, early=early and dequantized(fmt),
                             early_rope=early_rope and early and dequantized(fmt)
                             and d_qk > D_MAIN,
                             length_row=None if lengths is None else len(all_lengths))
    gathers.append((make(half=0), make(half=1)) if halves else make())
    if lengths is not None:
      all_lengths.append(lengths)
  rows = [n.reshape(1, -1) for n in all_lengths]  # a reshape, not a broadcast: no XLA op
  return tuple(gathers), jnp.concatenate(rows) if rows else None, all_indices, all_rows


def leading_inputs(lengths, q, sink):
  """``(inputs, restore)``: a kernel's leading inputs ``lengths`` (None: no set has
  any, :func:`kernel_inputs`), ``q`` and ``sink`` (None: no sink) without the absent
  ones, and ``restore(refs)``, the kernel's refs with None in their places: an absent
  input costs no XLA op that builds a stand-in before the kernel."""
  present = [x is not None for x in (lengths, q, sink)]

  def restore(refs):
    refs = list(refs)
    return [refs.pop(0) if here else None for here in present] + refs

  return [x for x in (lengths, q, sink) if x is not None], restore


def decode_lse(lse, query_len: int | None):
  """A kernel's ``[T, h]`` LSE as FlashMLA's decode LSE ``[T / query_len, h,
  query_len]`` (None: left as it is, a prefill's)."""
  if query_len is None:
    return lse
  return lse.reshape(-1, query_len, lse.shape[1]).transpose(0, 2, 1)


def padded_sinks(sink, heads: int):
  """``sink`` (float32 ``[h_q]``, or None: no sink) with ``-inf`` for the padding heads
  up to ``heads``: their sinks change nothing."""
  if sink is None or sink.shape[0] == heads:
    return sink
  return jnp.pad(sink, (0, heads - sink.shape[0]), constant_values=-jnp.inf)


def load_sinks(plgpu, sink_ref, h0, count: int, layout, share=None):
  """The sinks of heads ``h0 .. h0 + count - 1`` from GMEM ``sink_ref`` (None: no sink)
  in ``layout``, for :func:`jax_mla._mosaic.sink_epilogue` (a few floats: no TMA). A
  tail item's share (``share >= 0``, :func:`run_items`) gets none (-inf): the combine
  of the shares applies them."""
  if sink_ref is None:
    return None
  sink = plgpu.load(sink_ref.at[pl.ds(h0, count)], (), layout=layout, optimized=False)
  if share is None:
    return sink
  no_sink = plgpu.layout_cast(jnp.full((count,), -jnp.inf, jnp.float32), layout)
  return lax.cond(share < 0, lambda: sink, lambda: no_sink)


def store_decode_lse(plgpu, src_ref, lse_ref, *, t, h0, count: int, query_len: int):
  """Token ``t``'s per-head LSE ``src_ref[:count]`` (SMEM, after a ``commit_smem``) for
  heads ``h0 ..`` into FlashMLA's decode LSE ``lse_ref[b, h_q, query_len]`` (4-byte rows:
  :func:`jax_mla._mosaic.store_lse_rows`, not a TMA)."""
  b, s = lax.div(t, query_len), lax.rem(t, query_len)
  _mosaic.store_lse_rows(plgpu, src_ref, lse_ref.at[b], s * lse_ref.shape[1] + h0,
                         count=count)


def first_steps(len_ref, request, idx_refs, gathers):
  """``first``: set ``k``'s steps are ``first[k] .. first[k + 1] - 1`` (the sets' steps
  run back to back in one softmax); ``first[-1]`` is the token's number of steps. Set
  ``k``'s length (row ``gathers[k].length_row`` of ``len_ref``, column ``request``: the
  token, or a decode's request; none: ``topk``) is clipped to ``[0, topk]``
  (``idx_refs[k]``: its ``[T, topk]`` indices)."""
  first = [0]
  for idx_ref, gather in zip(idx_refs, gathers, strict=True):
    topk = idx_ref.shape[1]
    row = gather.length_row
    length = (topk if row is None
              else jnp.minimum(jnp.maximum(len_ref[row, request], 0), topk))
    first.append(first[-1] + lax.div(length + (BLOCK_K - 1), BLOCK_K))
  return first


def split_steps(first, splits: int, part=None):
  """This CTA's share of its token's steps when a token's steps are split over
  ``splits`` CTAs (equal shares, the last ones possibly empty): share ``part`` (traced;
  None: grid axis ``"s"``; negative: every step), as ``(first, base)`` for
  :func:`produce`, renumbered from 0; ``(first, None)`` for 1."""
  if splits == 1:
    return first, None
  total = first[-1]
  per = lax.div(total + splits - 1, splits)
  if part is None:
    part = lax.axis_index("s")
  lo = jnp.minimum(jnp.maximum(part, 0) * per, total)
  hi = jnp.where(part < 0, total, jnp.minimum(lo + per, total))
  return ([jnp.clip(f - lo, 0, hi - lo) for f in first],
          [jnp.maximum(lo - f, 0) for f in first[:-1]])


def produce(plgpu, *, t, q_copies, gathers, idx_refs, kv_refs, len_ref, kv_main, kv_rope,
            valid, barriers, first, base=None, request=None, producer: int = 0,
            producers: int = 1, pair=None, ring_start=0, q_gate=None, rope_free=None):
  """A producer warpgroup's work for token ``t`` (call after ``set_max_registers``).

  With ``producers`` warpgroups, producer ``p`` gathers the steps ``i`` with
  ``(ring_start + i) % producers == p`` into ring slot ``(ring_start + i) % stages`` (so
  ``stages`` is a multiple of ``producers``): each has its own step's loads in flight.
  ``ring_start``: the ring steps of the tokens this CTA took before (a persistent CTA's
  ring runs on from one token into the next). ``q_gate``: None, or a function that
  waits until the query's SMEM is free; producer 0 then issues the query copies after
  its first step of the token (at once if it has none), so the token's first stage
  is on its way while the last token's consumers still hold the query.

  Args:
    t: the token.
    q_copies: ``(src, dst)`` pairs copied with TMA onto the query barrier (the query
      tiles and the sink) by producer 0.
    gathers: one :func:`gather_fn` per key set; ``idx_refs``, ``kv_refs``, ``len_ref``:
      the sets' indices ``[T, topk]``, cache rows and lengths ``[num_sets, T]``.
    kv_main, kv_rope: the SMEM ring ``[stages, 2, 64, 256]`` and ``[stages, 64, rope]``.
    valid: SMEM int32 ``[stages + 2 * producers, 64]``: each stage's key validity
      (written here), then two rows per producer where each of its steps stages the
      indices of its next.
    barriers: ``(q_bar, kv_bar, free_bar)``: query loaded; stage loaded (one per
      stage); stage free (one per stage).
    first: set ``k``'s steps are ``first[k] .. first[k + 1] - 1`` (traced).
    base: per set, the 64-index block its step ``first[k]`` reads (traced; None: 0): a
      CTA taking one split of a token's keys starts inside a set.
    request: the column of ``len_ref`` with the token's lengths (None: ``t``; a decode
      with lengths per request: ``t // query_len``).
    producer, producers: this producer's index and their number.
    rope_free: None, or one barrier per stage on which the consumer arrives once it is
      done with the slot's RoPE tile (its ``S^T``): each step waits for it after its
      early loads, and a gather with ``early_rope`` then issues its RoPE copies, which
      land while the consumer finishes the slot's last stage.
    pair: None, or the CTA is one of a 2-CTA cluster that shares each step (``gathers``
      made with ``pair=True``): the SMEM uint32 ``[stages, 4]`` of
      :func:`init_pair`, whose mbarriers count the bytes the peer stores into each
      stage; ``free_bar`` is a cluster barrier (both CTAs' consumers free a stage).
  """
  q_bar, kv_bar, free_bar = barriers
  request = t if request is None else request
  num_stages = kv_main.shape[0]
  staged = lambda j: valid.at[  # noqa: E731  this producer's steps alternate two rows
      num_stages + 2 * producer + lax.rem(lax.div(j, producers), 2)]

  def copy_query():
    if q_gate is not None:
      q_gate()
    for src, dst in q_copies:
      plgpu.copy_gmem_to_smem(src, dst, q_bar)

  late_query = q_gate is not None and producer == 0
  if producer == 0 and not late_query:
    copy_query()

  swizzled_ref = plgpu.RefType(_mosaic.swizzled(plgpu))
  arg_types = (plgpu.RefType(), plgpu.RefType(), swizzled_ref, swizzled_ref, plgpu.RefType(),
               plgpu.RefType(), plgpu.RefType()) + (plgpu.RefType(),) * (pair is not None)
  paired = pair is not None
  stage = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))(
      functools.partial(stage_fn, pair=paired))
  wait_copies = plgpu.inline_mgpu()(wait_copies_fn)
  wait_peer = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_wait_peer)

  def ring_slot(i):
    return lax.rem(ring_start + i, num_stages)

  def ready(i):
    # Each thread waits for its own copies (a pair: thread 0 also for the peer's
    # stores); the fence orders them before wgmma's (async-proxy) reads; the arrival
    # (all 128 threads count as one) publishes them.
    wait_copies()
    if paired:
      wait_peer(pair.at[ring_slot(i)])
    plgpu.commit_smem()
    plgpu.barrier_arrive(kv_bar.at[ring_slot(i)])

  # This producer's first step of the token (its steps are mine, mine + producers, ...).
  mine = lax.rem(producer - lax.rem(ring_start, producers) + producers, producers)

  for k, (gather_fn_k, idx_ref, kv_ref) in enumerate(zip(gathers, idx_refs, kv_refs,
                                                        strict=True)):
    masked, early = gather_fn_k.masked, gather_fn_k.early
    words = (_words_layout(gather_fn_k.words),) if early else ()
    gather = plgpu.inline_mgpu(arg_types=words + arg_types + (plgpu.RefType(),) * (3 * masked))(
        gather_fn_k)
    rope = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), swizzled_ref, plgpu.RefType())
                             + (plgpu.RefType(),) * (3 * masked))(
        gather_fn_k.rope) if gather_fn_k.early_rope else None
    stage_next = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))(
        gather_fn_k.stage_next) if early else None
    load = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),) * (2 + 3 * masked),
        return_type=plgpu.ShapeDtypeStruct((128 * gather_fn_k.words,), jnp.int32,
                                           layout=words[0]))(gather_fn_k.load) if early else None
    offset = (0 if base is None else base[k]) - first[k]  # step i reads block i + offset
    start = first[k] + lax.rem(mine - lax.rem(first[k], producers) + producers, producers)
    # The set's first step of this producer reads indices staged here (a producer with
    # no step in the set stages a block of it that exists); each step stages its next's.
    block = jnp.clip(jnp.minimum(start, first[k + 1] - 1) + offset, 0,
                     idx_ref.shape[1] // BLOCK_K - 1)
    stage(idx_ref.at[t, pl.ds(block * BLOCK_K, BLOCK_K)], staged(start))

    @pl.loop(start, first[k + 1], step=producers)
    def _(i, k=k, gather=gather, load=load, rope=rope, stage_next=stage_next, idx_ref=idx_ref,
          kv_ref=kv_ref, offset=offset, masked=masked):
      slot = ring_slot(i)

      # This producer's previous step landed while the consumers worked: publish it
      # before waiting for slot i's previous reader, so the consumers never wait on an
      # issue.
      @pl.when(i >= producers)
      def _():
        ready(i - producers)

      # A masked gather also gets its step's and its row's first index blocks (their
      # distance is the step's position in the row) and the token's length.
      where = ((idx_ref.at[t, pl.ds((i + offset) * BLOCK_K, BLOCK_K)],
                idx_ref.at[t, pl.ds(0, BLOCK_K)],
                len_ref.at[gathers[k].length_row, pl.ds(request, 1)])
               if masked else ())

      def next_indices():
        """The next step's indices in GMEM and the step whose row stages them: the set's
        last step has no next, and restages its own indices (same values)."""
        has_next = (i + producers < first[k + 1]).astype(jnp.int32)
        nxt = i + offset + producers * has_next
        return idx_ref.at[t, pl.ds(nxt * BLOCK_K, BLOCK_K)], has_next

      # With early loads the producer stages the next step's indices itself, right after
      # the step's loads, so the publish does not wait on them; else the gather does.
      if stage_next is not None:
        next_idx_ref, has_next = next_indices()
        next_staged_ref = staged(i + producers * has_next)
      # Early loads: the rows are on their way while the slot's reader finishes; so are
      # the next step's indices.
      words = () if load is None else (load(kv_ref, staged(i), *where),)
      if stage_next is not None:
        stage_next(next_idx_ref, next_staged_ref)
      if rope_free is not None:  # every step waits: the arrivals come every step

        @pl.when(ring_start + i >= num_stages)
        def _():
          plgpu.barrier_wait(rope_free.at[slot])

        if rope is not None:
          rope(kv_ref, kv_rope.at[slot], staged(i), *where)

      @pl.when(ring_start + i >= num_stages)
      def _():
        plgpu.barrier_wait(free_bar.at[slot])

      if stage_next is None:
        next_idx_ref, has_next = next_indices()
      gather(*words, next_idx_ref, kv_ref, kv_main.at[slot], kv_rope.at[slot], valid.at[slot],
             staged(i), next_staged_ref if stage_next is not None
             else staged(i + producers * has_next),
             *(() if pair is None else (pair.at[slot],)), *where)
      if late_query:
        pl.when(i == mine)(copy_query)

  steps = first[-1]
  last = steps - 1 - lax.rem(steps - 1 - mine + producers, producers)  # its last step

  @pl.when(steps > mine)
  def _():
    ready(last)

  if late_query:
    pl.when(steps <= mine)(copy_query)


def produce_halves(plgpu, *, t, q_copies, gather, idx_ref, kv_ref, len_ref, kv_main, kv_rope,
                   valid, barriers, first, request, uses, q_gate, base=None):
  """The producer for :func:`jax_mla._mosaic.consume_pairs` over one bf16 key set (call
  after ``set_max_registers``): stage ``i`` goes into slot ``i % 2`` in two halves, in
  the order the consumers free them (:data:`jax_mla._mosaic.PAIR_FILL_ORDER`),
  FlashMLA's sm90 sparse prefill producer. Each
  thread's copies of a half arrive on the half's mbarrier when they land
  (``cp.async.mbarrier.arrive.noinc``): the producer never waits for its own loads,
  only for a half to be free. At the top of each pair of stages it loads both stages'
  indices into registers (FlashMLA's producer does too), so the index loads' latency
  overlaps the wait for the first free half instead of following each wait (H100,
  same-process A/B, bit-equal: V3.2 h128 4605 -> 4196 us, V4 h128 topk 1024 2294 ->
  2236 us; benchmarks/RESULTS.md, session 37).

  ``gather``: the set's two :func:`gather_fn` halves; ``barriers``: ``(q_bar, loaded,
  free, valid_bar)``: the query; ``loaded(part)``, the SMEM ``[2]`` 32-bit row of a
  half's hand-rolled mbarrier (:func:`jax_mla._mosaic.init_mbarriers`, 128 arrivals);
  four per-half free barriers; one per slot for its validity row. ``valid``: SMEM
  int32, a row per slot. The CTA is persistent: ``uses``, how often each slot was
  filled for its earlier items; ``q_gate``, a function that waits until the query's
  SMEM is free (the consumers free the query after their last ``S``, and the last
  stage's slot once their output has left it, so the item's first stage is filled
  before its second). Other arguments as :func:`produce`'s for one set and one
  producer (``base``: that set's).
  """
  q_bar, loaded, free, valid_bar = barriers
  steps = first[-1]
  words = _words_layout(gather[0].index_words)
  load_indices = plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(),),
      return_type=plgpu.ShapeDtypeStruct((128 * gather[0].index_words,), jnp.int32,
                                         layout=words))(gather[0].load_indices)

  def step_indices(i):
    """Stage ``i``'s 64 indices in GMEM. A stage past the last (its loads are issued for
    a pair's both stages) reads a block of the row that exists: the last stage's, or
    for an empty share, whose base may be the row's end, the row's last."""
    block = jnp.maximum(jnp.minimum(i, steps - 1), 0) + (0 if base is None else base[0])
    block = jnp.minimum(block, idx_ref.shape[1] // BLOCK_K - 1)
    return idx_ref.at[t, pl.ds(block * BLOCK_K, BLOCK_K)]

  def pair_indices(k):
    """Both stages of pair ``k``: this thread's indices, loaded before any wait."""
    return [load_indices(step_indices(2 * k + slot)) for slot in range(2)]

  first_indices = pair_indices(jnp.int32(0))
  q_gate()
  for src, dst in q_copies:
    plgpu.copy_gmem_to_smem(src, dst, q_bar)
  swizzled_ref = plgpu.RefType(_mosaic.swizzled(plgpu))
  masked = gather[0].masked
  arg_types = ((words, plgpu.RefType(), plgpu.RefType(), swizzled_ref, swizzled_ref,
                plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), plgpu.RefType())
               + (plgpu.RefType(),) * (3 * masked))
  halves = [plgpu.inline_mgpu(arg_types=arg_types)(g) for g in gather]

  def unit(k, slot, h, indices):
    """Half ``h`` of stage ``2k + slot`` (``indices``: the pair's, loaded)."""
    i = 2 * k + slot
    part = _mosaic.half_part(slot, h)

    @pl.when(i < steps)
    def _():
      pl.when(uses[slot] + k >= 1)(lambda: plgpu.barrier_wait(free.at[part]))
      step_idx = step_indices(i)
      where = ((step_idx, idx_ref.at[t, pl.ds(0, BLOCK_K)],
                len_ref.at[gather[0].length_row, pl.ds(request, 1)]) if masked else ())
      halves[h](indices[slot], step_idx, kv_ref, kv_main.at[slot], kv_rope.at[slot],
                valid.at[slot], step_idx, step_idx, loaded(part), *where)
      if h == 0:  # the validity row, written by this half's gather
        plgpu.commit_smem()
        plgpu.barrier_arrive(valid_bar.at[slot])

  # The last item's last slot is freed last: stage 0 first.
  for slot, h in ((0, 0), (0, 1), (1, 1), (1, 0)):
    unit(jnp.int32(0), slot, h, first_indices)  # traced: stage 1 may be past the indices

  @pl.loop(1, lax.div(steps + 1, 2))
  def _(k):
    indices = pair_indices(k)
    for slot, h in _mosaic.PAIR_FILL_ORDER:
      unit(k, slot, h, indices)


# Items of fewer key steps keep their last round: the shares' combine and the updates
# of their rows cost about 8 us (H100), and at V4 h64 topk 512 (8 steps) the A/B ran
# slower (698 -> 721 us; benchmarks/RESULTS.md, session 36).
TAIL_MIN_STEPS = 16


def tail_parts(items: int, ctas: int, max_steps: int) -> tuple[int, int]:
  """``(r, parts)`` for a persistent grid of ``ctas`` CTAs over ``items`` items of at
  most ``max_steps`` key steps: its last ``r`` items, which alone would make a last
  round on ``r`` CTAs while the others wait, each split into ``parts`` shares that the
  CTAs take at once (their partial results combined after the kernel); ``(0, 1)``
  where that round is more than half full or the items are short
  (:data:`TAIL_MIN_STEPS`). (H100, 16-head prefill, topk 2048: 4092 tokens 1542-1582
  us, 4096 tokens, 4 more items than 31 rounds, 1596-1687 us.)"""
  r = items % ctas
  parts = min(ctas // r, max_steps) if r and max_steps >= TAIL_MIN_STEPS else 1
  return (r, parts) if parts > 1 else (0, 1)


def prefill_tail(items: int, ctas: int, indices, *, persistent: bool,
                 query_len: int | None) -> tuple[int, int]:
  """:func:`tail_parts` of a kernel's grid over its sets' ``indices``: a persistent
  prefill's; ``(0, 1)`` for a decode (FlashMLA's decode LSE layout has no place for the
  shares) and for a grid that is not persistent."""
  if not persistent or query_len is not None:
    return 0, 1
  return tail_parts(items, ctas, sum(cdiv(i.shape[1], BLOCK_K) for i in indices))


def ragged_block(h_q: int, heads: int, tokens: int, tail) -> bool:
  """Whether a kernel of ``heads`` query rows a CTA takes ``h_q`` heads (not a multiple
  of ``heads``) as they are, not padded to a multiple of ``heads`` by copies of the
  query and the output around it. The last head block's query copy (a TMA box of
  ``heads`` rows) then reads the next token's first heads, or zeros past the array's
  end, into rows whose results are never written; the block writes its own heads' rows
  alone, a whole number of 8-row tiles. That needs the query array to hold one box, and
  no tail shares (``tail``, :func:`prefill_tail`), whose results are kept in whole
  blocks."""
  return (h_q % heads) % 8 == 0 and tokens * h_q >= heads and tail[0] == 0


def block_rows(store, h, blocks: int, heads: int, last: int):
  """``store(count)`` for head block ``h`` (traced) of ``blocks``: the rows it writes,
  ``last`` for the last block (fewer than ``heads`` where it goes unpadded,
  :func:`ragged_block`), else ``heads``."""
  if last == heads or blocks == 1:
    store(last)
  else:
    pl.when(h == blocks - 1)(lambda: store(last))
    pl.when(h < blocks - 1)(lambda: store(heads))


def tail_row(tail, tokens: int, blocks: int, t, h, share):
  """Row of the tail outputs for share ``share`` of tail item (token ``t``, head block
  ``h``): share ``j`` of tail item ``i`` at ``j * r + i``."""
  r = tail[0]
  return share * r + t * blocks + h - (tokens * blocks - r)


def combine_tail(out, max_logits, lse, tail_out, tail, sink, *, heads: int):
  """The prefill's results with the tail items' shares (``tail_out``: ``O``, max logits
  and LSE as the kernel wrote them, share-major) combined into their last rows, in
  place: ``out`` ``[n, 512]``, ``max_logits`` and ``lse`` ``n`` per-head values in rows
  of their own (row ``k`` of ``out`` is head ``k % heads``)."""
  parts = tail[1]
  o, ml, l = tail_out
  rows = o.shape[0] // parts
  first = out.shape[0] - rows
  if sink is not None and first % heads:  # the combine's row k is head k % heads: the
    sink = jnp.roll(sink, -(first % heads))  # sinks turned to start at the tail's head
  by_share = lambda x: x.reshape(parts, x.shape[0] // parts, *x.shape[1:])  # noqa: E731
  combined = merge_mosaic.combine(by_share(o), by_share(l), by_share(ml), sink, heads=heads)

  def last_rows(x, update):  # (updates in place: the torch bridge's direct launch too)
    update = update.reshape(-1, *x.shape[1:])
    return lax.dynamic_update_slice(x, update, (x.shape[0] - update.shape[0],)
                                    + (0,) * (x.ndim - 1))

  return tuple(last_rows(x, u) for x, u in zip((out, max_logits, lse), combined, strict=True))


def run_items(body, *, persistent: bool, tokens: int, blocks: int, ring=0, tail=(0, 1)):
  """Runs ``body(k, t, h, ring)`` for this CTA's items: its ``k``-th (token ``t``, head
  block ``h``), ``ring`` the state of the stage ring after its earlier items (``ring``
  given here for the first; ``body`` returns it after its own, a pytree of int32: the
  ring steps so far, say). One item (grid axes ``"t"``, ``"h"``), or with ``persistent``
  items ``p, p + ctas, ...`` of the ``tokens * blocks`` (axis ``"p"``). With ``tail``
  ``(r, parts)`` (:func:`tail_parts`, ``r > 0``), the last ``r`` items are taken in
  ``parts`` shares by CTAs ``0 .. r * parts - 1`` after their whole items (CTA ``c``
  share ``c % parts`` of tail item ``c // parts``), and ``body`` takes a fifth
  argument: the share (traced; -1 for a whole item)."""
  if not persistent:
    body(0, lax.axis_index("t"), lax.axis_index("h"), ring)
    return
  ctas, me = lax.axis_size("p"), lax.axis_index("p")
  r, parts = tail
  whole = tokens * blocks - r
  whole_items = lax.div(whole - me + ctas - 1, ctas)

  def one(k, ring):
    if not r:
      w = me + k * ctas
      return body(k, lax.div(w, blocks), lax.rem(w, blocks), ring)
    share = k >= whole_items
    w = jnp.where(share, whole + lax.div(me, parts), me + k * ctas)
    part = jnp.where(share, lax.rem(me, parts), -1)
    return body(k, lax.div(w, blocks), lax.rem(w, blocks), ring, part)

  count = whole_items + (jnp.where(me < r * parts, 1, 0) if r else 0)
  lax.fori_loop(0, count, one, jax.tree.map(jnp.int32, ring))


def gather_fn(*, fmt: Format | None, num_slots: int, block_size: int, row_bytes: int,
              d_qk: int, pair: bool = False, masked: bool = False, early: bool = False,
              length_row: int | None = None, half: int | None = None,
              early_rope: bool = False):
  """Per-thread gather of 64 key rows into one swizzled bf16 stage (inline Mosaic GPU).

  ``fmt``: ``None`` or the ``"auto"`` format (rows of ``d_qk`` bf16, copied with
  ``cp.async``),
  :class:`~jax_mla.cache.ds_mla.DsMla` (656-byte rows) or
  :class:`~jax_mla.cache.model1.Model1` (rows spread over their cache block) or
  :class:`~jax_mla.cache.layout.TileScaled` (``fp8_v41`` / ``fp4_v41`` rows, RoPE
  quantized too), dequantized in registers. ``row_bytes`` is the cache's last axis in bytes (a block
  is ``block_size`` of them).

  ``pair`` (quantized formats): the CTA is one of a 2-CTA cluster whose CTAs attend the
  same rows (two head blocks of one token, FlashMLA's split): CTA ``r`` of the cluster
  gathers rows ``32 r .. 32 r + 31`` of each step and stores each piece into its own
  stage and, with ``st.async``, into the peer's, where the slot's pair mbarrier
  (:func:`init_pair`) counts the bytes; so each row is loaded and dequantized once per
  token instead of once per head block.

  ``masked``: positions at or past the token's length are refused too (read nothing,
  left zero, marked invalid): the gather then takes three more refs, its step's and its
  row's first 64 indices (in GMEM; only their addresses are used) and the token's
  length (``[1]`` int32, as given: a negative one refuses every row).

  ``early`` (quantized formats, no ``pair``): the step's row loads are a function of
  their own, ``gather.load(ctx, kv_ref, staged_ref, *masked_refs)``, which returns the
  loaded words (``gather.words`` int32 a thread, a ``WG_STRIDED`` array), so the
  producer issues them before it waits for the stage to be free; the gather then takes
  the words as its first argument and only dequantizes and stores.

  ``early_rope`` (``early``, ``d_qk`` 576): the RoPE columns' copies are a function of
  their own too, ``gather.rope(ctx, kv_ref, rope_ref, staged_ref, *masked_refs)``,
  which the producer issues once the consumer is done with the slot's RoPE tile (its
  ``S^T``), before the slot is free; the gather then leaves them out.

  ``half`` (bf16 rows, :func:`produce_halves`): only half ``half`` of the stage
  (:func:`jax_mla._mosaic.half_part`): 0, main columns 0-255 and the validity; 1, main
  columns 256-511 and the RoPE columns. The gather takes this thread's indices of the
  step as its first argument (``gather.load_indices(ctx, idx_ref)``, a ``WG_STRIDED``
  array of ``gather.index_words`` int32 a thread, loaded before the producer waits for
  the half; ``staged_ref`` is then the step's 64 indices in GMEM, whose address a
  masked gather uses; nothing is staged for the next step), and the call's copies
  arrive on the half's mbarrier (the first extra ref) instead of closing a
  ``cp.async`` group.
  """
  from jax._src.lib.mlir.dialects import arith, llvm, memref
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  rows_per_thread = _rows_per_thread(pair)
  if pair and not dequantized(fmt):
    raise ValueError("a CTA pair shares only dequantized rows (bf16 rows are cp.async copies)")
  if early and (pair or not dequantized(fmt)):
    raise ValueError("early loads are for quantized rows without a CTA pair")
  if half is not None and dequantized(fmt):
    raise ValueError("half stages are for bf16 rows")
  if early_rope and not (early and d_qk > D_MAIN):
    raise ValueError("early RoPE copies are for early loads of rows with RoPE columns")
  stage_half = half  # (gather's code has a local ``half``)
  # This call stages the next step's indices (with early loads the producer does, as
  # soon as this step's loads are out: the copy is not on the refill's path).
  stages_next = half is None and not early
  stores_valid = half in (None, 0)  # and the validity
  row_asm = functools.partial(_dequant_asm, fmt) if dequantized(fmt) else None

  # Bytes the peer of a pair stores into a stage: its 32 rows' columns and validity.
  peer_bytes = BLOCK_K // 2 * (2 * max(d_qk, D_MAIN) + 4)

  def place():
    """``(tid, lane, group, first_row)``: this thread's 16-byte piece of a 128-byte tile
    row, its row group and its first row (a pair's CTA ``r`` takes rows ``32 r + ...``)."""
    c32 = _inline.const
    tid = _inline.warpgroup_thread()
    group = _thread_group(tid)
    return tid, arith.andi(tid, c32(THREADS_PER_ROW - 1)), group, _first_row(group, pair)

  def locate(kv_ref, staged_ref, first_row, masked_refs, idxs=None):
    """This thread's rows of the step, whose indices ``staged_ref`` holds (or ``idxs``,
    loaded already): ``(rows, oks, row addresses, scale addresses (Model1) or None)``."""
    i32, i64, c32, at = _inline.int_type(), _inline.int_type(64), _inline.const, _inline.at
    c64 = functools.partial(_inline.const, bits=64)
    kv_base = _inline.global_ptr(kv_ref)
    thread_rows = _thread_rows(first_row, pair)
    if idxs is None:
      idxs = [memref.load(staged_ref, [arith.index_cast(_index(), row)]) for row in thread_rows]
    if masked:  # rows at or past this many are refused
      step_ref, row_ref, len_ref = masked_refs
      address = lambda ref: llvm.ptrtoint(i64, mgpu_utils.memref_ptr(ref))  # noqa: E731
      position = arith.trunci(i32, arith.divui(arith.subi(address(step_ref), address(row_ref)),
                                               c64(4)))
      length = llvm.inline_asm(i32, [_inline.global_ptr(len_ref)], "ld.global.b32 $0, [$1];",
                               "=r,l")
      left = arith.subi(length, position)  # may be negative: every row is refused
    rows, scales, oks = [], [], []
    for row, idx in zip(thread_rows, idxs, strict=True):
      ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, idx, c32(0)),
                      arith.cmpi(arith.CmpIPredicate.slt, idx, c32(num_slots)))
      if masked:
        ok = arith.andi(ok, arith.cmpi(arith.CmpIPredicate.slt, row, left))
      slot = arith.select(ok, idx, c32(0))
      if isinstance(fmt, Model1):  # data at j * 576 of the block, scales at bs*576 + j*8
        block = arith.extui(i64, arith.divui(slot, c32(block_size)))
        j = arith.extui(i64, arith.remui(slot, c32(block_size)))
        block_at = at(kv_base, arith.muli(block, c64(block_size * row_bytes)))
        rows.append(at(block_at, arith.muli(j, c64(fmt.data_bytes))))
        scales.append(at(block_at, arith.addi(arith.muli(j, c64(fmt.scale_bytes)),
                                              c64(fmt.scale_region(block_size)))))
      else:  # rows are contiguous across blocks
        rows.append(at(kv_base, arith.muli(arith.extui(i64, slot), c64(row_bytes))))
        scales.append(None)
      oks.append(ok)
    return thread_rows, oks, rows, scales

  def sources(rows, scales, lane):
    """Per row, the addresses of this thread's quantized bytes and of the row's scales:
    ``fp8_ds_mla``, bytes [lane*16, +16) of each 128-value tile; ``fp8_model1``, [lane*8,
    +8) of each 64-value tile; ``fp8_v41`` / ``fp4_v41``, chunk ``lane`` of each column
    tile (the dequantizing part of :func:`gather` says where each goes)."""
    at, c32, i64 = _inline.at, _inline.const, _inline.int_type(64)
    if isinstance(fmt, DsMla):
      lane16 = arith.extui(i64, arith.muli(lane, c32(16)))
      return [(at(row, lane16), at(row, c32(fmt.scale_offset, 64))) for row in rows]
    if isinstance(fmt, Model1):
      lane8 = arith.extui(i64, arith.muli(lane, c32(8)))
      return [(at(row, lane8), scale) for row, scale in zip(rows, scales, strict=True)]
    lane_bytes = arith.extui(i64, arith.muli(lane, c32(fmt.bits)))
    return [(at(row, lane_bytes), at(row, c32(fmt.data_bytes, 64))) for row in rows]

  def load_indices(ctx, idx_ref):
    """``half``: this thread's rows' indices of a step (``idx_ref``, its 64 in GMEM),
    loaded before the producer waits for the half to be free (the load's latency then
    leaves the refill's path); the half's gather takes them as its first argument."""
    del ctx
    i32, i64, c32, at = _inline.int_type(), _inline.int_type(64), _inline.const, _inline.at
    idx_base = _inline.global_ptr(idx_ref)
    _, _, _, first_row = place()
    return _words_array([
        llvm.inline_asm(i32, [at(idx_base, arith.extui(i64, arith.muli(row, c32(4))))],
                        "ld.global.nc.b32 $0, [$1];", "=r,l", has_side_effects=True)
        for row in _thread_rows(first_row, pair)])

  def load(ctx, kv_ref, staged_ref, *masked_refs):
    """``early``: issues this thread's loads of the step's rows; returns the words."""
    del ctx
    i32 = _inline.int_type()
    _, lane, _, first_row = place()
    _, oks, rows, scales = locate(kv_ref, staged_ref, first_row, masked_refs)
    parts = row_asm(0)
    n = len(parts.loaded)
    words = []
    for (data, scale), ok in zip(sources(rows, scales, lane), oks, strict=True):
      out = llvm.inline_asm(_inline.struct(*["i32"] * n), [data, scale, arith.extui(i32, ok)],
                            parts.load_only(), ",".join(["=r"] * n + ["l", "l", "r"]),
                            has_side_effects=True)  # issued here, not after the wait
      words += _inline.fields(out, i32, n)
    return _words_array(words)

  def tile_origin(group, first_row):
    """``(r8, first_tile_row)`` for :func:`tile_at`. A thread's rows differ by 16 = two
    8-row tiles, so they share the swizzle (row % 8 == group % 8) and sit a fixed stride
    apart in the stage. A pair's CTA r takes rows 32 r + (group, group + 16)."""
    return (arith.andi(group, _inline.const(7)), arith.shrui(first_row, _inline.const(3)))

  def tile_at(buf, tiles_per_row, col_tile, chunk, r8, first_tile_row):
    """Byte address of 16-byte ``chunk`` (0..7, unswizzled) of column tile ``col_tile``
    in this thread's first row; a tile is 8 rows x 128 bytes, swizzled by row % 8."""
    c32 = _inline.const
    tile = arith.addi(arith.muli(first_tile_row, c32(tiles_per_row)), col_tile)
    off = arith.addi(arith.muli(tile, c32(8 * 128)),
                     arith.addi(arith.muli(r8, c32(128)),
                                arith.muli(arith.xori(chunk, r8), c32(16))))
    return _inline.at(buf, off)

  def rope_copy(rope_base, lane, r8, first_tile_row):
    """The RoPE columns' piece of :func:`gather`'s copies: (this thread's first
    destination, source byte offset, bytes between its rows in the stage)."""
    rope_at = fmt.rope_offset if isinstance(fmt, DsMla) else 2 * D_MAIN
    return (tile_at(rope_base, 1, _inline.const(0), lane, r8, first_tile_row), rope_at,
            (_ROW_GROUPS // 8) * 8 * 128)

  def issue_copies(copies, rows, oks, lane, peer_bar=None):
    """``cp.async`` of this thread's 16-byte pieces of its ``rows``, ``copies`` as
    (first destination, source byte offset, destination stride between its rows)
    triples (:func:`rope_copy`); refused rows are zero-filled, nothing read. A pair's
    CTA (``peer_bar``) stores through registers into both CTAs' stages instead."""
    i32, i64, void, c32, at = (_inline.int_type(), _inline.int_type(64), _inline.void(),
                               _inline.const, _inline.at)
    lane16 = arith.extui(i64, arith.muli(lane, c32(16)))
    # bf16 rows are copied whole: the L2 fetches 256 bytes at once. A quantized row's
    # RoPE piece is 128 bytes: a wider fetch reads the next row (H100, interleaved
    # medians: fp8_ds_mla b128 h16 196.7 vs 203.8 us, fp8_model1 h16 152.2 vs 157.4 us
    # without it; h128 451.4 vs 450.6 us).
    hint = "" if dequantized(fmt) else ".L2::256B"
    for d, src_at, stride in copies:
      for r, (src, ok) in enumerate(zip(rows, oks, strict=True)):
        piece = at(src, arith.addi(lane16, _inline.const(src_at, 64)))
        if peer_bar is not None:  # through registers: cp.async cannot write the peer's SMEM
          llvm.inline_asm(void, [at(d, c32(r * stride)), _peer(at(d, c32(r * stride))), piece,
                                 arith.extui(i32, ok), peer_bar],
                          _COPY_BOTH_ASM, "r,r,l,r,r", has_side_effects=True)
          continue
        nbytes = arith.select(ok, c32(16), c32(0))  # 0: zero-fill, nothing read
        llvm.inline_asm(void, [at(d, c32(r * stride)), piece, nbytes],
                        f"cp.async.cg.shared.global{hint} [$0], [$1], 16, $2;", "r,l,r",
                        has_side_effects=True)

  def rope(ctx, kv_ref, rope_ref, staged_ref, *masked_refs):
    """``early_rope``: issues this thread's RoPE copies of the step's rows (whose
    indices ``staged_ref`` holds) into the slot's RoPE tile ``rope_ref``."""
    del ctx
    _, lane, group, first_row = place()
    _, oks, rows, _ = locate(kv_ref, staged_ref, first_row, masked_refs)
    origin = tile_origin(group, first_row)
    issue_copies([rope_copy(mgpu_utils.memref_ptr(rope_ref), lane, *origin)], rows, oks, lane)

  def stage_copies(idx_ref, staged_ref, thread_rows):
    """``cp.async`` of this thread's rows' indices of a step (``idx_ref``, its 64 in
    GMEM) into ``staged_ref``, waited for with the step's copies."""
    i64, c32, at = _inline.int_type(64), _inline.const, _inline.at
    src, dst = _inline.global_ptr(idx_ref), mgpu_utils.memref_ptr(staged_ref)
    for row in thread_rows:
      off = arith.muli(row, c32(4))
      llvm.inline_asm(_inline.void(), [at(dst, off), at(src, arith.extui(i64, off))],
                      "cp.async.ca.shared.global [$0], [$1], 4;", "r,l", has_side_effects=True)

  def stage_next(ctx, idx_ref, staged_ref):
    """``early``: the next step's indices (:func:`stage_copies`), issued by the producer
    after this step's loads; the gather then leaves them out."""
    del ctx
    _, _, _, first_row = place()
    stage_copies(idx_ref, staged_ref, _thread_rows(first_row, pair))

  def gather(ctx, *args):
    """``staged_ref``: this step's indices, staged in SMEM by the previous step (or the
    set's prologue, :func:`stage_fn`); ``next_idx_ref`` / ``next_staged_ref``: the next
    step's indices in GMEM and where to stage them (``cp.async``, waited for with the
    step's copies): the index loads leave the steps' critical path. ``extra_refs``: the
    slot's pair mbarrier (pair only), then the ``masked`` refs. ``early``: the words of
    ``gather.load`` come first."""
    del ctx
    words, args = (_words_of(args[0]), args[1:]) if early or stage_half is not None else (
        None, args)
    (next_idx_ref, kv_ref, main_ref, rope_ref, valid_ref, staged_ref, next_staged_ref,
     *extra_refs) = args
    pair_ref = extra_refs[0] if pair else None
    half_bar = extra_refs[0] if stage_half is not None else None
    i32, index, void = _inline.int_type(), _index(), _inline.void()
    c32, at = _inline.const, _inline.at
    tid, lane, group, first_row = place()
    main_base = mgpu_utils.memref_ptr(main_ref)
    rope_base = mgpu_utils.memref_ptr(rope_ref)
    if pair:  # this stage's phase of the pair mbarrier: the peer's bytes, one arrival
      bar = mgpu_utils.memref_ptr(pair_ref)
      llvm.inline_asm(void, [bar, tid],
                      "{.reg .pred p; setp.eq.u32 p, $1, 0; "
                      f"@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], {peer_bytes};}}",
                      "r,r", has_side_effects=True)
      peer_bar = _peer(bar)

    r8, first_tile_row = tile_origin(group, first_row)

    def dst(buf, tiles_per_row, col_tile, chunk):
      return tile_at(buf, tiles_per_row, col_tile, chunk, r8, first_tile_row)

    row_stride = (_ROW_GROUPS // 8) * (HALF // TILE) * 8 * 128  # bytes between a thread's rows

    def main_dst(col_tile: int, chunk):  # main_ref: [2 halves][8 row tiles][4 col tiles][8][64]
      half, col_tile = divmod(col_tile, HALF // TILE)
      return at(dst(main_base, HALF // TILE, c32(col_tile), chunk), c32(half * BLOCK_K * HALF * 2))

    thread_rows, oks, rows, scales = locate(kv_ref, staged_ref, first_row,
                                            extra_refs[-3:] if masked else (),
                                            words if stage_half is not None else None)
    if stages_next:
      stage_copies(next_idx_ref, next_staged_ref, thread_rows)
    for row, ok in zip(thread_rows, oks, strict=True) if stores_valid else ():
      memref.store(arith.extui(i32, ok), valid_ref, [arith.index_cast(index, row)])
      if pair:  # lane 0's copy alone is counted
        valid_at = at(mgpu_utils.memref_ptr(valid_ref), arith.muli(row, c32(4)))
        llvm.inline_asm(void, [_peer(valid_at), arith.extui(i32, ok), peer_bar, lane],
                        "{.reg .pred p; setp.eq.u32 p, $3, 0; @p st.async.shared::cluster."
                        "mbarrier::complete_tx::bytes.b32 [$0], $1, [$2];}", "r,r,r,r",
                        has_side_effects=True)

    # bf16 pieces, copied as they are: (this thread's first destination, source byte
    # offset of tile piece 0, bytes between the thread's rows in the stage).
    copies = []
    if not dequantized(fmt):
      tiles = D_MAIN // TILE
      halves = (range(tiles) if stage_half is None
                else range(stage_half * tiles // 2, (stage_half + 1) * tiles // 2))
      copies += [(main_dst(tile, lane), tile * 128, row_stride) for tile in halves]
    if d_qk > D_MAIN and stage_half != 0 and not early_rope:
      copies.append(rope_copy(rope_base, lane, r8, first_tile_row))
    if isinstance(fmt, Model1):  # the RoPE part is column tile 7 of the 512
      copies.append((main_dst(fmt.num_tiles, lane), fmt.nope, row_stride))
    issue_copies(copies, rows, oks, lane, peer_bar if pair else None)

    if isinstance(fmt, DsMla):
      # Thread `lane` holds bytes [lane*16, +16) of each 128-value scale tile k, i.e.
      # bf16 columns k*128 + lane*16 .. +16: column tile 2k + lane // 4, 16-byte chunks
      # 2 * (lane % 4) and the next.
      chunk = arith.muli(arith.andi(lane, c32(3)), c32(2))
      col_tile = arith.shrui(lane, c32(2))
      dsts = []
      for k in range(fmt.num_tiles):
        half = 2 * k // (HALF // TILE)  # lane // 4 < 2 keeps the half fixed per k
        ct = arith.addi(col_tile, c32(2 * k - half * (HALF // TILE)))
        for c in (chunk, arith.addi(chunk, c32(1))):
          dsts.append(at(dst(main_base, HALF // TILE, ct, c), c32(half * BLOCK_K * HALF * 2)))
    elif isinstance(fmt, Model1):
      # Thread `lane` holds bytes [lane*8, +8) of each 64-value scale tile k: bf16
      # column tile k, 16-byte chunk `lane`.
      dsts = [main_dst(k, lane) for k in range(fmt.num_tiles)]
    elif isinstance(fmt, TileScaled):
      # Thread `lane` holds the 16-byte chunk `lane` (8 values) of every bf16 column
      # tile k, as with Model1: ``fmt.bits`` value bytes at k * 64 * bits / 8 + lane *
      # bits, scaled by scale byte (k * 64 + lane * 8) // fmt.tile. The asm takes the
      # lane's part of that byte's bit offset in the row's scale words.
      dsts = [main_dst(k, lane) for k in range(D_MAIN // TILE)]
      lane_shift = [arith.muli(arith.divui(arith.muli(lane, c32(8)), c32(fmt.tile)), c32(8))]
    if dequantized(fmt):
      extra = lane_shift if isinstance(fmt, TileScaled) else []
      peer_dsts = [_peer(d) for d in dsts] if pair else []
      for r, ((data, scale), ok) in enumerate(zip(sources(rows, scales, lane), oks,
                                                  strict=True)):
        operands = [data, scale, arith.extui(i32, ok), *extra, *dsts, *peer_dsts,
                    *([peer_bar] if pair else [])]
        parts = row_asm(r * row_stride, pair)
        if early:  # the row's words, loaded by ``load``, follow the operands
          n = len(parts.loaded)
          text = parts.compute_only(len(operands))
          operands += words[r * n:(r + 1) * n]
        else:
          text = parts.fused()
        llvm.inline_asm(void, operands, text, ",".join(["l", "l"] + ["r"] * (len(operands) - 2)),
                        has_side_effects=True)
    if half_bar is None:
      llvm.inline_asm(void, [], "cp.async.commit_group;", "", has_side_effects=True)
    else:  # the half's barrier counts this thread once its copies have landed
      llvm.inline_asm(void, [mgpu_utils.memref_ptr(half_bar)],
                      "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", "r",
                      has_side_effects=True)

  gather.masked = masked
  gather.early = early
  gather.early_rope = early_rope
  gather.rope = rope
  gather.stage_next = stage_next
  gather.length_row = length_row
  gather.load = load
  gather.words = rows_per_thread * len(row_asm(0).loaded) if early else 0
  gather.load_indices = load_indices
  gather.index_words = rows_per_thread
  return gather


def _index():
  """MLIR's index type (call inside an inline body: it needs its context)."""
  from jax._src.lib.mlir import ir
  return ir.IndexType.get()


def _words_layout(count: int):
  """The Pallas layout of ``count`` int32 words per thread of a warpgroup."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.Layout.WG_STRIDED((128 * count,), vec_size=1)


def _words_array(words):
  """i32 values -> a ``WG_STRIDED`` int32 array holding them, one register each (how
  ``gather.load`` hands its words to the gather through Pallas)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import vector
  from jax.experimental.mosaic import gpu as mgpu
  vec = ir.VectorType.get((1,), ir.IntegerType.get_signless(32))
  regs = np.empty((len(words),), dtype=object)
  for k, w in enumerate(words):
    regs[k] = vector.broadcast(vec, w)
  return mgpu.FragmentedArray(_registers=regs, _layout=_words_layout(len(words)).to_mgpu(),
                              _is_signed=True)


def _words_of(array):
  """The i32 values of a :func:`_words_array` array, in order."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import vector
  return [vector.extract(r, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
          for r in array.registers.flat]


def stage_fn(ctx, idx_ref, staged_ref, *, pair: bool = False):
  """Copies this thread's rows of a set's first 64 indices (GMEM) into SMEM, where the
  first step of the set reads them (inline Mosaic GPU)."""
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, memref

  index = ir.IndexType.get()
  for row in _thread_rows(_first_row(_thread_group(_inline.warpgroup_thread()), pair), pair):
    row = arith.index_cast(index, row)
    memref.store(memref.load(idx_ref, [row]), staged_ref, [row])


def _thread_group(tid):
  """The 8-thread group (0-15) of warpgroup thread ``tid``: ``THREADS_PER_ROW`` threads
  share a row (i32, inside an inline body)."""
  from jax._src.lib.mlir.dialects import arith
  return arith.shrui(tid, _inline.const(THREADS_PER_ROW.bit_length() - 1))


def _first_row(group, pair: bool):
  """The first of a thread's rows of a step, from its 8-thread ``group`` (0-15): the
  group itself, or in a pair's CTA ``r``, which takes rows ``32 r ..``, ``32 r +
  group`` (i32, inside an inline body)."""
  from jax._src.lib.mlir.dialects import arith
  return arith.addi(group, arith.muli(_cluster_rank(), _inline.const(32))) if pair else group


def _rows_per_thread(pair: bool) -> int:
  """How many rows of a 64-row step a thread takes: 4, or 2 in a pair's CTA."""
  return BLOCK_K // _ROW_GROUPS // (1 + pair)


def _thread_rows(first_row, pair: bool):
  """A thread's rows of a 64-row step: ``first_row`` (:func:`_first_row`), then every
  16th (8 threads a row), :func:`_rows_per_thread` of them (i32, inside an inline
  body)."""
  from jax._src.lib.mlir.dialects import arith
  return [arith.addi(first_row, _inline.const(r * _ROW_GROUPS))
          for r in range(_rows_per_thread(pair))]


def _cluster_rank():
  """This CTA's rank in its cluster (PTX ``%cluster_ctarank``)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  return llvm.inline_asm(ir.IntegerType.get_signless(32), [], "mov.u32 $0, %cluster_ctarank;",
                         "=r")


def _peer(shared_ptr):
  """The address of ``shared_ptr`` in the other CTA of a 2-CTA cluster (``mapa``)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  return llvm.inline_asm(
      ir.IntegerType.get_signless(32), [shared_ptr],
      "{.reg .b32 r; mov.u32 r, %cluster_ctarank; xor.b32 r, r, 1; "
      "mapa.shared::cluster.u32 $0, $1, r;}", "=r,r")


# One 16-byte piece, zero when the row is invalid, into this CTA's and the peer's SMEM.
# Operands: local address, peer address, source, valid, the peer's pair mbarrier.
_COPY_BOTH_ASM = (
    "{.reg .pred p; .reg .b32 a, b, c, d; setp.ne.b32 p, $3, 0; "
    "mov.b32 a, 0; mov.b32 b, 0; mov.b32 c, 0; mov.b32 d, 0; "
    "@p ld.global.nc.v4.b32 {a, b, c, d}, [$2]; st.shared.v4.b32 [$0], {a, b, c, d}; "
    "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$1], {a, b, c, d}, [$4];}")


def init_pair(plgpu, pair_ref):
  """Initialises a pair's mbarriers (SMEM uint32 ``[stages, 4]``: each slot's mbarrier,
  one arrival plus the bytes the peer stores, and the phase its waiter expects next),
  then waits for the whole cluster (call in every thread, before the producer): the
  peer's first stores need them initialised."""
  plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_init_pair)(pair_ref)
  _mosaic.cluster_sync(plgpu)


def _init_pair(ctx, pair_ref):
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  stages = ir.MemRefType(pair_ref.type).shape[0]
  inits = " ".join(f"@p mbarrier.init.shared::cta.b64 [$0+{16 * k}], 1; "
                   f"@p st.shared.u32 [$0+{16 * k + 8}], 0;" for k in range(stages))
  llvm.inline_asm(
      ir.Type.parse("!llvm.void"), [mgpu_utils.memref_ptr(pair_ref), mgpu.thread_idx()],
      "{.reg .pred p; setp.eq.u32 p, $1, 0; " + inits + " fence.mbarrier_init.release.cluster;}",
      "r,r", has_side_effects=True)


def _wait_peer(ctx, pair_ref):
  """Thread 0 waits for the slot's pair mbarrier phase (the peer's stores landed) and
  flips the phase it expects next; ``commit_smem`` then holds the other threads."""
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  llvm.inline_asm(
      ir.Type.parse("!llvm.void"), [mgpu_utils.memref_ptr(pair_ref), mgpu.thread_idx()],
      "{.reg .pred p, done; .reg .b32 ph; and.b32 ph, $1, 127; setp.eq.u32 p, ph, 0; "
      "@!p bra SKIP; ld.shared.u32 ph, [$0+8]; "
      "WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [$0], ph; @!done bra WAIT; "
      "xor.b32 ph, ph, 1; st.shared.u32 [$0+8], ph; SKIP: }", "r,r", has_side_effects=True)


def _stores(operand: int, row_offset: int, regs: str, pair: bool, num_dsts: int,
            first_dst: int) -> list[str]:
  """PTX storing ``regs`` (a ``{...}`` v4) at destination ``operand`` + ``row_offset``
  and, for a pair, at its peer address (``num_dsts`` operands later) with ``st.async``
  onto the peer's pair mbarrier (the operand after the peer addresses, which start at
  ``first_dst + num_dsts``)."""
  lines = [f"st.shared.v4.b32 [${operand}+{row_offset}], {regs};"]
  if pair:
    lines.append("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 "
                 f"[${operand + num_dsts}+{row_offset}], {regs}, [${first_dst + 2 * num_dsts}];")
  return lines


@dataclasses.dataclass(frozen=True)
class _RowAsm:
  """One row's dequantizing PTX (:func:`_dequant_asm`) in parts: register ``decls``;
  ``loads`` of the row's bytes into the registers ``loaded``, predicated on ``p0`` and
  addressed at ``%DATA`` / ``%SCALE``; ``compute``, the rest, which reads the fused
  operands from ``$3`` on. Joined whole (:meth:`fused`) or split at the loads
  (:meth:`load_only`, :meth:`compute_only`: ``gather_fn(early=True)``)."""
  decls: tuple[str, ...]
  loaded: tuple[str, ...]
  loads: tuple[str, ...]
  compute: tuple[str, ...]

  def fused(self) -> str:
    """Operands: data address, scale address, valid, then the compute's."""
    return _braced(self.decls + ("setp.ne.b32 p0, $2, 0;",) + self._fill("$0", "$1")
                   + self.compute)

  def load_only(self) -> str:
    """Outputs ``$0 .. $n-1``: the loaded words (zero for an invalid row); inputs
    ``$n`` data address, ``$n+1`` scale address, ``$n+2`` valid."""
    n = len(self.loaded)
    return _braced((".reg .pred p0;", f".reg .b32 {', '.join(self.loaded)};",
                    f"setp.ne.b32 p0, ${n + 2}, 0;") + self._fill(f"${n}", f"${n + 1}")
                   + tuple(f"mov.b32 ${k}, {r};" for k, r in enumerate(self.loaded)))

  def compute_only(self, first_word: int) -> str:
    """The fused operands (data, scale and valid unused), then the loaded words from
    operand ``first_word`` on."""
    return _braced(self.decls + tuple(f"mov.b32 {r}, ${first_word + k};"
                                      for k, r in enumerate(self.loaded)) + self.compute)

  def _fill(self, data: str, scale: str) -> tuple[str, ...]:
    return tuple(f"mov.b32 {r}, 0;" for r in self.loaded) + tuple(
        line.replace("%DATA", data).replace("%SCALE", scale) for line in self.loads)


def _braced(lines) -> str:
  return "\n".join(("{",) + tuple(lines) + ("}",))


def _dequant_asm(fmt: DsMla | Model1 | TileScaled, row_offset: int, pair: bool = False) -> _RowAsm:
  """PTX that dequantizes one row's share of one thread and stores it as bf16.

  Operands (:meth:`_RowAsm.fused`): data address, scale address, valid, then the
  shared addresses of the thread's 16-byte bf16 pieces in its first row (``row_offset``
  bytes are added), then (``pair``) the same addresses in the peer CTA, stored to as
  well. An invalid row loads nothing: zeros.

  - ``"fp8_ds_mla"``: 4 x 16 fp8 bytes (one piece of each 128-value tile, 128 bytes
    apart) and the row's 4 float32 scales; 8 stores (lo/hi half of each piece).
  - ``"fp8_model1"``: 7 x 8 fp8 bytes (one piece of each 64-value tile, 64 bytes
    apart) and the row's 8 UE8M0 scale bytes (``2**(e - 127)`` is the float32 with
    exponent field ``e``); 7 stores.
  - ``"fp8_v41"`` / ``"fp4_v41"``: see :func:`_tile_scaled_asm`.
  """
  if isinstance(fmt, TileScaled):
    return _tile_scaled_asm(fmt, row_offset, pair)
  ds_mla = isinstance(fmt, DsMla)
  # A thread holds 1/8 of each tile (8 threads per 128-byte row): tile / 32 words.
  words, tiles, tile_bytes = fmt.tile // (4 * THREADS_PER_ROW), fmt.num_tiles, fmt.tile
  decls = (".reg .pred p0;", f".reg .b32 x<{words * tiles}>, o<8>, c<2>, t<2>;",
           ".reg .b16 lo16, hi16, e<4>;", ".reg .f32 f<4>, s<4>;")
  # The row's scales as loaded: 4 float32 (ds_mla), or 8 UE8M0 bytes in two words.
  scale_regs = ([f"s{i}" for i in range(fmt.num_tiles)] if ds_mla
                else [f"t{i}" for i in range(fmt.scale_bytes // 4)])
  loads = []
  for k in range(tiles):
    xs = ", ".join(f"x{words * k + i}" for i in range(words))
    loads.append(f"@p0 ld.global.nc.v{words}.b32 {{{xs}}}, [%DATA+{tile_bytes * k}];")
  loads.append(f"@p0 ld.global.nc.v{len(scale_regs)}.b32 {{{', '.join(scale_regs)}}}, [%SCALE];")
  lines = []
  for k in range(tiles):
    scale = f"s{k}"
    if not ds_mla:  # UE8M0: the code is the float32 exponent field of the scale
      scale = "s0"
      lines += [f"bfe.u32 c0, t{k // 4}, {8 * (k % 4)}, 8;", "shl.b32 c0, c0, 23;",
                "mov.b32 s0, c0;"]
    for i in range(words):
      lines += _fp8_to_bf16x2(f"x{words * k + i}", scale, (f"o{2 * i}", f"o{2 * i + 1}"))
    for piece in range(words // 2):
      operand = 3 + (words // 2) * k + piece
      o = ", ".join(f"o{4 * piece + i}" for i in range(4))
      lines += _stores(operand, row_offset, f"{{{o}}}", pair, (words // 2) * tiles, 3)
  return _RowAsm(decls, tuple(f"x{i}" for i in range(words * tiles)) + tuple(scale_regs),
                 tuple(loads), tuple(lines))


def _fp8_to_bf16x2(word: str, scale: str, outs: tuple[str, str]) -> list[str]:
  """PTX: 4 e4m3 bytes of ``word`` times float32 ``scale`` -> two bf16x2 registers
  ``outs`` (the odd column in the high half). Uses registers lo16, hi16, c0, c1,
  e0-e3, f0-f3."""
  lines = [f"mov.b32 {{lo16, hi16}}, {word};",
           "cvt.rn.f16x2.e4m3x2 c0, lo16;", "cvt.rn.f16x2.e4m3x2 c1, hi16;",
           "mov.b32 {e0, e1}, c0;", "mov.b32 {e2, e3}, c1;"]
  lines += [f"cvt.f32.f16 f{j}, e{j};" for j in range(4)]
  lines += [f"mul.f32 f{j}, f{j}, {scale};" for j in range(4)]
  return lines + [f"cvt.rn.bf16x2.f32 {outs[0]}, f1, f0;", f"cvt.rn.bf16x2.f32 {outs[1]}, f3, f2;"]


def _e2m1_tables() -> tuple[int, int, int, int]:
  """``prmt`` tables of the bf16 bits of e2m1 magnitudes 0..7: (low bytes of codes 0-3,
  of codes 4-7, high bytes of codes 0-3, of codes 4-7) as little-endian words."""
  with jax.ensure_compile_time_eval():
    mags = np.asarray(e2m1.values(jnp.arange(8, dtype=jnp.int32)))
  bits = mags.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
  word = lambda b: int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24)  # noqa: E731
  lo, hi = bits & 0xFF, bits >> 8
  return word(lo[:4]), word(lo[4:]), word(hi[:4]), word(hi[4:])


def _tile_scaled_asm(fmt: TileScaled, row_offset: int, pair: bool = False) -> _RowAsm:
  """PTX for one row of an ``fp8_v41`` / ``fp4_v41`` cache (see :func:`_dequant_asm`).

  Operands: data address (lane's bytes of column tile 0), scale address, valid, the
  lane's bit offset in the scale words, then the 8 shared addresses of chunk ``lane``
  of column tiles 0..7. The row's value bytes of each tile (8 fp8 or 4 e2m1 bytes, 8
  values) and all its scale bytes are loaded; each 8-value chunk is one 16-byte store.

  - fp8 (UE8M0 scale per 32 values): as ``"fp8_model1"``.
  - fp4 (e4m3 scale per 16 values): ``prmt`` looks the low and high byte of each
    magnitude's bf16 up in two 8-byte tables (the 3 magnitude bits of a code are the
    byte index), a second ``prmt`` interleaves them into bf16 pairs, the sign bit is
    moved into bit 15 of each half, and one ``mul.rn.bf16x2`` by the scale finishes
    (exact: 2 and 4 significant bits).
  """
  fp4 = fmt.bits == 4
  tiles = D_MAIN // TILE
  words = fmt.bits * 8 // 32  # data words of one chunk: 2 (fp8) or 1 (fp4)
  scale_words = fmt.num_tiles // 4
  per_tile = TILE // fmt.tile  # scale bytes of one column tile: 2 or 4
  xs = [f"x{i}" for i in range(words * tiles)]
  ts = [f"t{i}" for i in range(scale_words)]
  decls = [".reg .pred p0;", f".reg .b32 {', '.join(xs + ts)}, o<4>, c<2>, sc;",
           ".reg .b16 lo16, hi16, e<4>;", ".reg .f32 f<4>, s0;"]
  lines = []
  if fp4:
    decls += [".reg .b32 tab<4>, tl, th, sg, sa, sb, m16, m15;"]
    lines += [f"mov.b32 tab{i}, {w:#x};" for i, w in enumerate(_e2m1_tables())]
    lines += ["mov.b32 m16, 0xffff;", "mov.b32 m15, 0x80008000;"]
  load = "ld.global.nc.b32" if words == 1 else f"ld.global.nc.v{words}.b32"
  loads = []
  for k in range(tiles):
    regs = ", ".join(xs[words * k:words * (k + 1)])
    loads.append(f"@p0 {load} {{{regs}}}, [%DATA+{k * TILE * fmt.bits // 8}];"
                 if words > 1 else f"@p0 {load} {regs}, [%DATA+{k * TILE * fmt.bits // 8}];")
  for w in range(0, scale_words, 4):
    loads.append(f"@p0 ld.global.nc.v4.b32 {{{', '.join(ts[w:w + 4])}}}, [%SCALE+{4 * w}];")
  for k in range(tiles):
    byte = k * per_tile  # the tile's first scale byte; the lane adds $3 bits
    lines += [f"shr.b32 c0, t{byte // 4}, $3;", f"bfe.u32 c0, c0, {8 * (byte % 4)}, 8;"]
    if fp4:  # e4m3 scale -> bf16 in both halves
      lines += ["mov.b32 {lo16, hi16}, c0;", "cvt.rn.f16x2.e4m3x2 c1, lo16;",
                "mov.b32 {e0, e1}, c1;", "cvt.f32.f16 s0, e0;", "cvt.rn.bf16x2.f32 sc, s0, s0;"]
      x = xs[k]
      for half in range(2):  # values 4 * half .. + 3
        sel = x if half == 0 else "c0"
        if half:
          lines.append(f"shr.b32 c0, {x}, 16;")
        lines += [f"and.b32 c0, {sel}, 0x7777;",  # the magnitude bits of 4 codes
                  "prmt.b32 tl, tab0, tab1, c0;", "prmt.b32 th, tab2, tab3, c0;",
                  f"prmt.b32 o{2 * half}, tl, th, 0x5140;",  # values 0, 1 of the four
                  f"prmt.b32 o{2 * half + 1}, tl, th, 0x7362;"]  # values 2, 3
      for p in range(4):  # value 2p's sign (bit 8p + 3) -> 15, 2p + 1's (8p + 7) -> 31
        lo_shift, hi_shift = 12 - 8 * p, 24 - 8 * p
        lines.append(f"shl.b32 sa, {x}, {lo_shift};" if lo_shift >= 0
                     else f"shr.b32 sa, {x}, {-lo_shift};")
        lines.append(f"shl.b32 sb, {x}, {hi_shift};")
        lines += ["lop3.b32 sg, sa, sb, m16, 0xE4;",  # (sa & m16) | (sb & ~m16)
                  f"lop3.b32 o{p}, o{p}, sg, m15, 0xF8;",  # o | (sg & 0x80008000)
                  f"mul.rn.bf16x2 o{p}, o{p}, sc;"]
    else:  # UE8M0: the code is the float32 exponent field of the scale
      lines += ["shl.b32 c0, c0, 23;", "mov.b32 s0, c0;"]
      for i in range(words):
        lines += _fp8_to_bf16x2(xs[words * k + i], "s0", (f"o{2 * i}", f"o{2 * i + 1}"))
    lines += _stores(4 + k, row_offset, "{o0, o1, o2, o3}", pair, tiles, 4)
  return _RowAsm(tuple(decls), tuple(xs + ts), tuple(loads), tuple(lines))


def wait_copies_fn(ctx):
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm
  llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "cp.async.wait_all;", "",
                  has_side_effects=True)
