"""Pallas Mosaic GPU paged decode attention (Hopper), written lane by lane.

The Mosaic GPU backend of :func:`jax_mla.paged.paged_attention` (``implementation=
"mosaic"``, and the default on Hopper for what it takes). Memory-bound: a query head
group of a KV head does about 8 flops per cache byte, so the kernel is built around
the loads, not the tensor-core tiles:

- One warp per (sequence, KV head, block of 16 of its query heads, KV split); four
  warps per CTA, independent. The head blocks of a group are adjacent warps, so L2
  serves their shared reads once.
- vLLM's key block ``[D / x][bs][x]`` (16-byte runs) is read as it lies: a 16-token
  step is two ``mma.sync.m16n8k16`` B operands whose lanes load 16-byte runs (a run
  feeds 2 k-steps of the mma, 4 for fp8; the query's A operand is loaded in the same
  order, so the dot products are unchanged), and the value block ``[D][bs]`` gives
  each lane 4 consecutive tokens of one head dim (8 bytes, 4 for fp8). Every
  32-byte sector a warp touches is read whole, with no shared-memory staging.
- fp8 caches (e4m3, e5m2; vLLM's key runs of 16) are widened exactly to fp16 in
  registers (``cvt.rn.f16x2``) and the mma runs in fp16; the query is rounded to fp16
  once (bf16 and float32 queries; magnitudes past 65504 saturate there), ``k_scale``
  is folded into the score scale and ``v_scale`` into the epilogue.
- ``S = Q K^T`` has the warp's heads on the mma's 16 rows (padding rows are zero) and
  8 tokens on its columns; the tokens are placed so that
  each lane's four scores are the four tokens its value load holds, and ``P`` goes
  from the accumulator to the ``P V`` A operand in registers.
- The online softmax in base 2, as :mod:`jax_mla._softmax` describes it: row maxima
  over the 4 lanes of a row by shuffles, row sums per lane until the end. Scores of slots past
  ``seq_len``, outside the window or in a block with an out-of-range id are ``-inf``
  and their value words are zeroed before the mma (they may hold NaN), and an
  out-of-range block id is never dereferenced.
- Each warp loads the next step's block id while it works on this one.

Outputs: without ``query_start_loc`` and ``out_scale`` the op stays Mosaic GPU kernels
alone (the torch bridge launches them directly: ``torch_bridge._direct``). One split
writes the output itself, sinks applied. bf16 splits at head sizes 128 / 256 write bf16
parts for :func:`jax_mla.merge_mosaic.combine`. Otherwise each split writes its float32
part and natural-log LSE, and the parts and the sink are combined in XLA
(:func:`jax_mla.paged.layout.finish_parts`), as the Triton kernel's are.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jax_mla import _inline, _mosaic, merge_mosaic
from jax_mla._common import LN2, LOG2E, cdiv, check_num_splits, num_sms, with_num_splits
from jax_mla._inline import at, const, fconst, pack, wide
from jax_mla.paged.layout import CacheView, decode_rows, finish_parts

WARPS = 4  # work items per CTA, one warp each
STEP = 16  # tokens per step: the k side of the P V mma
HEAD_BLOCK = 16  # query heads a warp takes: the mma's 16 rows
# CTAs resident per SM by cache element size (H100, D 128, 8 query heads a KV head,
# unroll 2: 180 registers a thread for bf16 and 154 for fp8), for the default splits.
_CTAS_PER_SM = {2: 2, 1: 3}
_MIN_SPLIT_STEPS = 8  # 16-token steps a split keeps at least


@dataclasses.dataclass(frozen=True)
class Config:
  """Tuning of the Mosaic GPU paged-attention kernel (changes no result beyond rounding).

  Attributes:
    num_splits: KV splits per (sequence, KV head): warps that each take an equal share
      of the sequence's 16-token steps; ``None`` picks :func:`default_num_kv_splits`.
    unroll: 16-token steps per loop iteration, whose loads are all issued before the
      first step's math (more bytes in flight per warp, more registers). H200, 128
      sequences x 4096, Hq 64, Hkv 8, D 128: fp8 348.7 / 329.9 / 332.6 us at 1 / 2 / 4,
      bf16 572.6 / 566.9 / 564.7 us.
    ahead: also load the next iteration's steps before this one's math (their words
      are carried in registers), so a warp always has loads in flight.

  ``paged_attention`` with ``config=None`` takes :func:`default_config`.
  """
  num_splits: int | None = None
  unroll: int = 2
  ahead: bool = False

  def __post_init__(self):
    check_num_splits("Config.num_splits", self.num_splits)
    if self.unroll not in (1, 2, 4):
      raise ValueError(f"Config.unroll must be 1, 2 or 4; got {self.unroll}")


def check_supported(query, key_cache, value_cache) -> None:
  """Raises ``ValueError`` for what the kernel does not take (the Triton kernel does).

  It takes caches in vLLM's layout (key ``[nb, Hkv, D // x, bs, x]`` with 16-byte runs
  ``x``, value ``[nb, Hkv, D, bs]``): bf16 or fp16 caches with queries of the same
  dtype and head sizes a multiple of 32, or fp8 (e4m3 / e5m2) caches with bf16, fp16
  or float32 queries and head sizes a multiple of 64; head sizes up to 256 and blocks
  of a multiple of 16 tokens. Any number of query heads per KV head.
  """
  q_dtype, kv_dtype = jnp.dtype(query.dtype), jnp.dtype(key_cache.dtype)
  fp8 = kv_dtype in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
  if not (fp8 and q_dtype.name in ("bfloat16", "float16", "float32")
          or kv_dtype == q_dtype and q_dtype.name in ("bfloat16", "float16")):
    raise ValueError(f"the Mosaic GPU paged-attention kernel takes bf16 or fp16 caches with "
                     f"queries of the same dtype, or fp8 caches; got {q_dtype} queries and "
                     f"{kv_dtype} caches (use implementation='triton')")
  if key_cache.ndim != 5 or key_cache.shape[4] * kv_dtype.itemsize != 16:
    raise ValueError(f"the Mosaic GPU paged-attention kernel reads vLLM's key layout [nb, Hkv, "
                     f"D // x, bs, x] (x = {16 // kv_dtype.itemsize}); got "
                     f"{list(key_cache.shape)} (use implementation='triton')")
  _, hkv, _, block_size, _ = key_cache.shape
  head_dim = query.shape[2]
  if tuple(value_cache.shape[2:]) != (head_dim, block_size):
    raise ValueError(f"the Mosaic GPU paged-attention kernel reads vLLM's value layout [nb, "
                     f"Hkv, {head_dim}, {block_size}]; got {list(value_cache.shape)} (use "
                     "implementation='triton')")
  multiple = 64 if fp8 else 32
  if head_dim % multiple or head_dim > 256 or block_size % STEP:
    raise ValueError(f"the Mosaic GPU paged-attention kernel takes head sizes that are a "
                     f"multiple of {multiple} up to 256 ({kv_dtype} caches) and blocks of a "
                     f"multiple of {STEP} tokens; got {head_dim} and {block_size} (use "
                     "implementation='triton')")


def default_num_kv_splits(num_seqs: int, num_kv_heads: int, max_steps: int, num_cores: int,
                          cache_itemsize: int) -> int:
  """The fewest splits whose CTAs fill the resident CTA slots (``_CTAS_PER_SM`` a core)
  to within 5% of a whole number of waves, each split keeping at least
  ``_MIN_SPLIT_STEPS`` steps; failing that, the count that fills them best.

  The warps are independent and equally long, so a partial last wave leaves slots idle
  while the memory system waits for more requests. H100, 128 sequences x 4096 (256 CTAs
  unsplit): bf16 1 / 2 / 4 splits 736.3 / 747.1 / 750.6 us (1: 0.97 waves); fp8 1 / 3 /
  4 / 6 splits 426.3 / 401.9 / 415.7 / 412.5 us (3: 1.94 waves); 4 sequences x 65536 bf16
  16 / 32 / 64 / 128 splits 428.5 / 391.5 / 402.9 / 431.0 us (32: 0.97 waves), fp8 32 /
  48 / 64 / 128 226.1 / 226.7 / 250.5 / 236.9 us (48: 0.97 waves).
  """
  slots = num_cores * _CTAS_PER_SM[cache_itemsize]
  items = num_seqs * num_kv_heads
  best, best_fill = 1, 0.0
  for splits in range(1, max(1, max_steps // _MIN_SPLIT_STEPS) + 1):
    waves = items * splits / (WARPS * slots)
    fill = waves / math.ceil(waves)
    if fill >= 0.95:
      return splits
    if fill > best_fill:
      best, best_fill = splits, fill
  return best


def default_config(cache_itemsize: int, head_dim: int) -> Config:
  """Up to 128 head dims: 2 steps an iteration for 16-bit caches, 1 loaded an iteration
  ahead for fp8; more head dims: 1 step (registers). H100, 128 sequences x 4096, D 128,
  two rounds: fp8 410.7 / 413.0 us as 2 steps, 398.2 / 402.0 us as 1 ahead, 401.2 / 401.4
  us as 2 ahead; bf16 753.1 / 756.2, 751.6 / 763.2, 806.6 / 816.3 us. 64 sequences x 4096,
  D 256, group 16: bf16 252.0 us as 2 steps, 229.5 us as 1; fp8 186.3 us as 1 ahead,
  172.3 us as 1."""
  if head_dim > 128:
    return Config(unroll=1)
  return Config(unroll=2) if cache_itemsize == 2 else Config(unroll=1, ahead=True)


def with_defaults(config: Config | None, *, num_kv_splits: int | None, num_seqs: int,
                  num_kv_heads: int, group: int, max_tokens: int, cache_itemsize: int,
                  head_dim: int) -> Config:
  """``config`` (``None``: :func:`default_config`) with ``num_splits`` set (as the Triton
  kernel's); each KV head counts once per block of ``HEAD_BLOCK`` of its ``group`` query
  heads."""
  config = config or default_config(cache_itemsize, head_dim)
  return with_num_splits(config, num_kv_splits, lambda: default_num_kv_splits(
      num_seqs, num_kv_heads * cdiv(group, HEAD_BLOCK), cdiv(max_tokens, STEP), num_sms(),
      cache_itemsize))


def paged_attention_mosaic(query, key_view_: CacheView, value_view_: CacheView, block_table,
                           seq_lens, *, sm_scale, k_scale, v_scale, attn_sink, alibi_slopes,
                           sliding_window, query_start_loc, out_scale, config: Config):
  """Kernel path of ``paged_attention`` (arguments validated, :func:`check_supported`
  passed, ``config.num_splits`` set); call under jit."""
  plgpu = _mosaic.plgpu()
  t, hq, head_dim = query.shape
  num_blocks, hkv, _, block_size, _ = key_view_.data.shape
  num_seqs, max_blocks = block_table.shape
  splits = config.num_splits
  group = hq // hkv
  head_blocks = cdiv(group, HEAD_BLOCK)

  identity = query_start_loc is None  # row s is sequence s; the kernel clamps the lengths
  query_row, lens = (None, seq_lens) if identity else decode_rows(seq_lens, query_start_loc, t)
  if num_blocks == 0 or max_blocks == 0:  # nothing to read: every sequence is empty
    lens = jnp.zeros_like(lens)
    block_table = jnp.zeros((num_seqs, 1), jnp.int32)
    max_blocks = 1
  if all(isinstance(x, float) for x in (sm_scale, k_scale, v_scale)):  # a constant
    scalars = jnp.asarray(np.array([sm_scale * k_scale * LOG2E, v_scale], np.float32))
  else:
    scalars = jnp.stack([jnp.asarray(sm_scale, jnp.float32) * jnp.asarray(k_scale, jnp.float32)
                         * LOG2E, jnp.asarray(v_scale, jnp.float32)])
  inputs = [scalars, lens, block_table, query, key_view_.data,
            value_view_.data.reshape(num_blocks, hkv, head_dim, block_size)]
  if not identity:
    inputs.append(query_row)
  if alibi_slopes is not None:
    inputs.append(alibi_slopes.astype(jnp.float32))
  # Where it can, the op stays Mosaic GPU kernels alone (the torch bridge then launches
  # them directly): one split writes the output itself, sinks applied; bf16 splits are
  # combined by jax_mla.merge_mosaic. Otherwise float32 parts are combined in XLA.
  direct = identity and out_scale is None
  combinable = (query.dtype == jnp.bfloat16 and head_dim in (128, 256)
                and num_seqs * hq % merge_mosaic.ROWS == 0)
  mode = ("final" if direct and splits == 1 else "parts_bf16" if direct and combinable
          else "parts_f32")
  out_dtype = (_DTYPE_NAMES[jnp.dtype(query.dtype)] if mode == "final"
               else "bf16" if mode == "parts_bf16" else "f32")
  if mode == "final":
    inputs.append(jnp.full((hq,), -jnp.inf, jnp.float32) if attn_sink is None
                  else attn_sink.astype(jnp.float32))
    out_type = (jax.ShapeDtypeStruct((num_seqs, hq, head_dim), query.dtype),)
  else:
    out_type = (jax.ShapeDtypeStruct((splits, num_seqs, hq, head_dim), jnp.dtype(
        jnp.bfloat16 if out_dtype == "bf16" else jnp.float32)),
                jax.ShapeDtypeStruct((splits, num_seqs, hq), jnp.float32))
  items = num_seqs * hkv * head_blocks * splits
  body = plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * (len(inputs) + len(out_type)))(
      functools.partial(
          _attend, group=group, head_blocks=head_blocks, head_dim=head_dim,
          block_size=block_size, num_kv_heads=hkv, num_seqs=num_seqs, splits=splits,
          max_blocks=max_blocks, num_blocks=num_blocks, sliding_window=sliding_window,
          has_alibi=alibi_slopes is not None, q_dtype=_DTYPE_NAMES[jnp.dtype(query.dtype)],
          cache_dtype=_DTYPE_NAMES[jnp.dtype(key_view_.data.dtype)], unroll=config.unroll,
          ahead=config.ahead, mode=mode, out_dtype=out_dtype, identity=identity))
  outs = pl.kernel(body, name="paged_attention", out_type=out_type,
                   mesh=plgpu.Mesh(grid=(cdiv(items, WARPS),), grid_names=("w",)))(*inputs)
  if mode == "final":
    return outs[0]
  out_part, lse_part = outs
  if mode == "parts_bf16":
    rows = num_seqs * hq
    out, _, _ = merge_mosaic.combine(out_part.reshape(splits, rows, head_dim),
                                     lse_part.reshape(splits, rows),
                                     lse_part.reshape(splits, rows), attn_sink, heads=hq)
    return out.reshape(num_seqs, hq, head_dim)
  return finish_parts(out_part, lse_part, attn_sink, query_row, t, identity=identity,
                      dtype=query.dtype, out_scale=out_scale)


def _attend(ctx, scal_ref, len_ref, bt_ref, q_ref, k_ref, v_ref, *refs, group,
            head_blocks, head_dim, block_size, num_kv_heads, num_seqs, splits, max_blocks,
            num_blocks, sliding_window, has_alibi, q_dtype, cache_dtype, unroll, ahead, mode,
            out_dtype, identity):
  """One warp's (sequence, KV head, head block, split): see the module. Lane ``(r, c) = (lane // 4,
  lane % 4)`` holds the scores of heads ``r`` and ``r + 8`` for the step's tokens ``4c ..
  4c + 3`` and the outputs of those heads at head dims ``8n + 2c, 8n + 2c + 1``."""
  del ctx
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, scf

  refs = list(refs)
  row_ref = None if identity else refs.pop(0)
  alibi_ref = refs.pop(0) if has_alibi else None
  sink_ref = refs.pop(0) if mode == "final" else None
  o_ref, lse_ref = refs if mode != "final" else (refs[0], None)
  i32, f32 = _inline.int_type(), _inline.f32_type()
  c64 = functools.partial(const, bits=64)
  lt = functools.partial(arith.cmpi, arith.CmpIPredicate.slt)
  two_halves = group > 8  # heads r + 8 exist: the mma's rows 8..15 carry data
  fp8 = cache_dtype in _FP8
  dtype = "f16" if fp8 else cache_dtype  # of the mma's operands
  size = 1 if fp8 else 2  # bytes of a cache element
  run = 16 // size  # head dims of a 16-byte key run
  d_chunks = head_dim // 8  # 8-dim column tiles of the P V mma
  head_bytes = head_dim * block_size * size  # one block of one KV head, for K and for V
  neg_inf = fconst(float("-inf"))

  lane, warp = _inline.lane_and_warp()
  r, c = arith.divui(lane, const(4)), arith.remui(lane, const(4))
  item = arith.addi(arith.muli(_inline.block_x(), const(WARPS)), warp)
  items = num_seqs * num_kv_heads * head_blocks * splits
  live = lt(item, const(items))
  item = arith.minui(item, const(items - 1))
  # The head blocks of one (sequence, KV head, split) are adjacent warps: they read the
  # same blocks at about the same time, which L2 then serves once.
  head_block = arith.remui(item, const(head_blocks))
  item = arith.divui(item, const(head_blocks))
  split = arith.remui(item, const(splits))
  h = arith.remui(arith.divui(item, const(splits)), const(num_kv_heads))
  seq = arith.divui(item, const(splits * num_kv_heads))

  def element(ref, index):  # the address of 4-byte element ``index`` of ``ref``
    return at(_inline.global_ptr(ref), arith.muli(wide(index), c64(4)))

  def load_i32(ref, index):
    return _inline.load_words(element(ref, index), 1)[0]

  def load_f32(ref, index):
    return _inline.load_f32(element(ref, index))

  length = arith.maxsi(load_i32(len_ref, seq), const(0))  # negative lengths count as 0
  row = seq if identity else arith.maxsi(load_i32(row_ref, seq), const(0))
  num_steps = arith.divui(arith.addi(length, const(STEP - 1)), const(STEP))
  first = const(0)
  if sliding_window:
    first = arith.divui(arith.maxsi(arith.subi(length, const(sliding_window)), const(0)),
                        const(STEP))
  per_split = arith.divui(arith.addi(arith.subi(num_steps, first), const(splits - 1)),
                          const(splits))
  lo = arith.addi(first, arith.muli(split, per_split))
  hi = arith.select(live, arith.minsi(arith.addi(lo, per_split), num_steps), lo)
  hi = arith.maxsi(hi, lo)
  qk_scale, v_scale = load_f32(scal_ref, const(0)), load_f32(scal_ref, const(1))

  # The heads r and r + 8 of the warp's block of the group (clamped inside the group;
  # padding rows are zero).
  heads = [arith.addi(arith.muli(head_block, const(HEAD_BLOCK)), arith.addi(r, const(8 * x)))
           for x in range(2)]
  head_ok = [lt(x, const(group)) for x in heads]
  heads = [arith.minui(x, const(group - 1)) for x in heads]
  q_base = _inline.global_ptr(q_ref)
  zero = const(0)

  def pairs_of(words):  # cache words -> b32 pairs of the mma dtype, in order
    return [p for w in words for p in _inline.fp8_pairs(w, cache_dtype)] if fp8 else list(words)

  q_size = _ITEMSIZE[q_dtype]

  def query_words(x):
    """Head x's pairs in the key runs' order: lane c's runs 4j + c, head dims run (4j
    + c) .. + run - 1."""
    rows = arith.addi(arith.muli(arith.addi(arith.muli(row, const(num_kv_heads)), h),
                                 const(group)), heads[x])
    words = []
    for j in range(head_dim // (4 * run)):
      d = arith.muli(arith.addi(const(4 * j), c), const(run))
      ptr = at(q_base, arith.muli(wide(arith.addi(arith.muli(rows, const(head_dim)), d)),
                                  c64(q_size)))
      raw = [w for k in range(run * q_size // 16)
             for w in _inline.load_words(at(ptr, c64(16 * k)), 4)]
      if q_dtype != dtype:  # to fp16 for the fp8 caches' mma, saturated at +-65504
        values = (_inline.bf16_floats(raw) if q_dtype == "bf16"
                  else [arith.bitcast(f32, w) for w in raw])
        raw = [pack(*(_inline.clamp(v, 65504.0) for v in values[k:k + 2]), "f16")
               for k in range(0, len(values), 2)]
      words += [arith.select(head_ok[x], w, zero) for w in raw]
    return words

  qa = query_words(0)
  qb = query_words(1) if two_halves else [zero] * len(qa)
  slopes = [fconst(0.0)] * 2
  if has_alibi:
    slopes = [arith.select(head_ok[x], arith.mulf(load_f32(alibi_ref, arith.addi(
        arith.muli(h, const(group)), heads[x])), fconst(LOG2E)), fconst(0.0))
              for x in range(2)]

  mma = functools.partial(_inline.mma_16816, dtype=dtype)

  def block_id(step):
    logical = arith.divui(arith.muli(step, const(STEP)), const(block_size))
    return load_i32(bt_ref, arith.addi(arith.muli(seq, const(max_blocks)),
                                       arith.minui(logical, const(max_blocks - 1))))

  k_base, v_base = _inline.global_ptr(k_ref), _inline.global_ptr(v_ref)
  # Lane (r, c)'s key token of column r of the step's two 8-token mma tiles: tile j holds
  # tokens 4 (r // 2) + r % 2 + 2 j, so the accumulator gives lane c tokens 4c .. 4c + 3.
  k_token = arith.addi(arith.muli(arith.divui(r, const(2)), const(4)), arith.remui(r, const(2)))
  k_lane = wide(arith.addi(arith.muli(arith.muli(c, const(block_size)), const(16)),
                           arith.muli(k_token, const(16))))
  # Lane (r, c)'s value words: head dim 8n + r, tokens 4c .. 4c + 3.
  v_lane = wide(arith.addi(arith.muli(arith.muli(r, const(block_size)), const(size)),
                           arith.muli(c, const(4 * size))))
  tokens = [arith.addi(arith.muli(c, const(4)), const(i)) for i in range(4)]

  per = 4 if two_halves else 2  # accumulator fields a lane keeps per 8 head dims

  def load(step, blk, in_range):
    """Step ``step``'s key and value pairs from block ``blk`` (loads only) and whether
    its block is readable; ``in_range``: the step is this split's (else all masked)."""
    pos0 = arith.muli(step, const(STEP))
    logical = arith.divui(pos0, const(block_size))
    blk_ok = arith.andi(in_range, arith.andi(lt(logical, const(max_blocks)), arith.andi(
        arith.cmpi(arith.CmpIPredicate.sge, blk, const(0)), lt(blk, const(num_blocks)))))
    blk = arith.select(blk_ok, blk, const(0))
    block = arith.addi(arith.muli(wide(blk), c64(num_kv_heads)), wide(h))
    offset = wide(arith.remui(pos0, const(block_size)))
    key_at = at(k_base, arith.addi(arith.muli(block, c64(head_bytes)),
                                   arith.addi(arith.muli(offset, c64(16)), k_lane)))
    value_at = at(v_base, arith.addi(arith.muli(block, c64(head_bytes)),
                                     arith.addi(arith.muli(offset, c64(size)), v_lane)))
    # Plain read-only loads: L1 no_allocate and L2 prefetch-size hints were no faster
    # (H100, 128 sequences x 4096: bf16 762.7 / 766.7 us plain, 786.9 / 776.5 us with
    # no_allocate; fp8 within 2% either way).
    keys = [[w for j in range(head_dim // (4 * run))
             for w in _inline.load_words(at(key_at, c64(j * 4 * block_size * 16 + t * 32)), 4)]
            for t in range(2)]
    # 4 tokens of one head dim: 2 words of a 16-bit cache, 1 of fp8.
    values = [_inline.load_words(at(value_at, c64(n * 8 * block_size * size)), size)
              for n in range(d_chunks)]
    return pos0, blk_ok, keys, values

  def attend(state, loaded):
    """The online softmax and ``P V`` of one loaded step."""
    m_a, m_b, l_a, l_b, *acc = state
    pos0, blk_ok, keys, values = loaded
    keys = [pairs_of(words) for words in keys]
    values = [pairs_of(words) for words in values]
    scores = []
    for t in range(2):
      s = [fconst(0.0)] * 4
      for k in range(d_chunks // 2):  # k-step k: pairs 2k, 2k + 1 of the runs
        s = mma(s, (qa[2 * k], qb[2 * k], qa[2 * k + 1], qb[2 * k + 1]),
                (keys[t][2 * k], keys[t][2 * k + 1]))
      scores.append(s)
    # Lane c's tokens 4c + i: tile i // 2, column 2c + i % 2; head r in fields 0, 1,
    # head r + 8 in fields 2, 3.
    pos = [arith.addi(pos0, x) for x in tokens]
    valid = [arith.andi(blk_ok, lt(p, length)) for p in pos]
    if sliding_window:
      valid = [arith.andi(v, lt(arith.subi(arith.subi(length, const(1)), p),
                                const(sliding_window))) for v, p in zip(valid, pos, strict=True)]
    rel = [arith.sitofp(f32, arith.subi(p, arith.subi(length, const(1)))) for p in pos]

    def row_scores(x):
      out = []
      for i in range(4):
        v = arith.mulf(scores[i // 2][2 * x + i % 2], qk_scale)
        if has_alibi:
          v = arith.addf(v, arith.mulf(slopes[x], rel[i]))
        out.append(arith.select(valid[i], v, neg_inf))
      return out

    m_a, l_a, alpha_a, p_a = _inline.softmax_step(row_scores(0), m_a, l_a)
    if two_halves:
      m_b, l_b, alpha_b, p_b = _inline.softmax_step(row_scores(1), m_b, l_b)
      pb = [pack(p_b[0], p_b[1], dtype), pack(p_b[2], p_b[3], dtype)]
    else:
      alpha_b, pb = None, [zero, zero]
    p_words = (pack(p_a[0], p_a[1], dtype), pb[0], pack(p_a[2], p_a[3], dtype), pb[1])
    # Value words of invalid tokens are zeroed (they may hold NaN; 0 * NaN is NaN).
    masks = [arith.ori(arith.select(valid[2 * w], const(0xFFFF), zero),
                       arith.select(valid[2 * w + 1], const(-65536), zero)) for w in range(2)]
    new_acc = []
    for n in range(d_chunks):
      part = [arith.mulf(acc[per * n + f], alpha_a if f < 2 else alpha_b) for f in range(per)]
      part += [fconst(0.0)] * (4 - per)
      new_acc += mma(part, p_words, [arith.andi(values[n][w], masks[w]) for w in range(2)])[:per]
    return [m_a, m_b, l_a, l_b] + new_acc

  # Each iteration issues the loads of `unroll` steps before any math, and the block
  # ids of the next iteration's steps; `ahead`: the loads of the next iteration's steps
  # (carried as words), and the ids of the one after.
  state = [neg_inf, neg_inf, fconst(0.0), fconst(0.0)] + [fconst(0.0)] * (d_chunks * per)
  key_words = head_dim // (4 * run) * 4

  def flat(one):
    pos0, blk_ok, keys, values = one
    return [pos0, blk_ok, *keys[0], *keys[1], *(w for v in values for w in v)]

  def unflat(words):
    keys = [words[2:2 + key_words], words[2 + key_words:2 + 2 * key_words]]
    rest = words[2 + 2 * key_words:]
    return words[0], words[1], keys, [rest[size * n:size * (n + 1)] for n in range(d_chunks)]

  def loads(first, ids):
    steps = [arith.addi(first, const(u)) for u in range(unroll)]
    return [load(x, blk, lt(x, hi)) for x, blk in zip(steps, ids, strict=True)]

  def ids_from(first):
    return [block_id(arith.addi(first, const(u))) for u in range(unroll)]

  carry = ids_from(lo)
  if ahead:
    carry = ids_from(arith.addi(lo, const(unroll))) + [
        w for one in loads(lo, carry) for w in flat(one)]
  words = len(carry) - unroll
  loop = scf.ForOp(lo, hi, const(unroll), carry + state)
  with ir.InsertionPoint(loop.body):
    step = loop.induction_variable
    args = list(loop.inner_iter_args)
    ids, state = args[:unroll], args[unroll + words:]
    after = arith.addi(step, const(unroll))
    if ahead:
      width = words // unroll
      loaded = [unflat(args[unroll + width * u:unroll + width * (u + 1)]) for u in range(unroll)]
      carry = ids_from(arith.addi(after, const(unroll))) + [
          w for one in loads(after, ids) for w in flat(one)]
    else:
      loaded = loads(step, ids)
      carry = ids_from(after)
    for one in loaded:
      state = attend(state, one)
    scf.YieldOp(carry + state)

  m_a, m_b, l_a, l_b, *acc = loop.results[unroll + words:]
  out_rows = arith.addi(arith.muli(arith.addi(arith.muli(split, const(num_seqs)), seq),
                                   const(num_kv_heads * group)), arith.muli(h, const(group)))
  o_base = _inline.global_ptr(o_ref)
  out_size = _ITEMSIZE[out_dtype]
  for x, (m, l) in enumerate(((m_a, l_a), (m_b, l_b))):
    if x and not two_halves:
      break
    l = _inline.across_row(l, arith.addf)  # the row sum over its four lanes
    empty = arith.cmpf(arith.CmpFPredicate.OEQ, l, fconst(0.0))
    l_safe = arith.select(empty, fconst(1.0), l)
    lse2 = arith.addf(m, _inline.log2(l_safe))
    denominator = l_safe
    if sink_ref is not None:  # out *= exp(lse) / (exp(lse) + exp(sink)): +inf gives 0
      sink = load_f32(sink_ref, arith.addi(arith.muli(h, const(group)), heads[x]))
      denominator = arith.mulf(l_safe, arith.addf(fconst(1.0), _inline.exp2(
          arith.subf(arith.mulf(sink, fconst(LOG2E)), lse2))))
    inv = arith.select(empty, fconst(0.0), arith.divf(v_scale, denominator))
    out_row = arith.addi(out_rows, heads[x])
    ok = arith.extui(i32, arith.andi(live, head_ok[x]))
    row_at = at(o_base, arith.muli(wide(out_row), c64(head_dim * out_size)))
    for n in range(d_chunks):
      values = [arith.mulf(acc[per * n + 2 * x + f], inv) for f in range(2)]
      words = ([arith.bitcast(i32, v) for v in values] if out_dtype == "f32"
               else [pack(*values, out_dtype)])
      _inline.store_words(at(row_at, wide(arith.muli(arith.addi(const(8 * n), arith.muli(
          c, const(2))), const(out_size)))), words, ok)
    if lse_ref is not None:
      lse = arith.select(empty, fconst(float("inf")), arith.mulf(lse2, fconst(LN2)))
      first_lane = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, c, zero))
      _inline.store_words(at(_inline.global_ptr(lse_ref), arith.muli(wide(out_row), c64(4))),
                          [arith.bitcast(i32, lse)], arith.andi(ok, first_lane))


_FP8 = ("e4m3", "e5m2")
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4}
# The kernel's names of the dtypes it reads (PTX's).
_DTYPE_NAMES = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16",
                jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.float8_e4m3fn): "e4m3",
                jnp.dtype(jnp.float8_e5m2): "e5m2"}
