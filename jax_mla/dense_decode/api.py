"""Dense MLA decode: AITER, FlashMLA and tpu-inference conventions over one kernel.

Each public function validates its inputs (errors name the argument), then calls a
private jitted function that runs the jax.numpy reference (``implementation="xla"``)
or lowers its metadata to query groups (:mod:`jax_mla.dense_decode.metadata`) and
runs the split-KV Triton kernel (:mod:`jax_mla.dense_decode.triton`).
``mla_decode_paged`` also has a Mosaic GPU kernel for Hopper
(:mod:`jax_mla.dense_decode.mosaic`). Internally LSE is token-major; FlashMLA's
``[b, h_q, s_q]`` is made here, at the boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import _mosaic
from jax_mla._common import (
  D_NOPE,
  D_QK,
  D_ROPE,
  Implementation,
  as_int32,
  backend_config,
  check_dtype,
  check_num_splits,
  check_rank,
  check_shape,
  check_static,
  check_values,
  resolve_implementation,
)
from jax_mla.dense_decode import metadata as md
from jax_mla.dense_decode import mosaic, triton
from jax_mla.dense_decode import reference as ref
from jax_mla.indexing.metadata import block_table_checks
from jax_mla.sharding import OpSharding, shape_of

_Q_DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn)
_KV_DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn)
# The kernel addresses the cache with int32 element offsets.
_MAX_CACHE_ELEMS = 2**31 - 1


def _check_cache(name, kv_cache):
  check_rank(name, kv_cache, 3)
  check_dtype(name, kv_cache, _KV_DTYPES)
  check_shape(name, kv_cache, [None, None, D_QK])
  if kv_cache.size > _MAX_CACHE_ELEMS:
    raise ValueError(
        f"{name} has {kv_cache.size} elements; the Triton kernel addresses at most 2**31-1 "
        "(int32 offsets): split the cache or use implementation='xla'")


def _check_positive_int(name, value, optional=True):
  if value is None and optional:
    return
  if not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be {'None or ' if optional else ''}a positive int "
                     f"(static); got {value!r}")


def _check_sm_scale(sm_scale, optional=True):
  if sm_scale is not None or not optional:
    check_static("sm_scale", sm_scale, (int, float))


def _int_metadata(rank, **arrays):
  out = []
  for name, x in arrays.items():
    x = as_int32(name, x)
    check_rank(name, x, rank)
    out.append(x)
  return out


def _triton(num_kv_splits, **shape):
  """``backend_config``'s entry for the Triton kernel: its config completed for the call."""
  return triton.Config, functools.partial(triton.with_defaults, num_kv_splits=num_kv_splits,
                                          **shape)


def _run_triton(q2d, kv_cache, meta, page_ids, scales, *, h_q, rows_per_group, causal,
                config, out_dtype, interpret):
  return triton.paged_mla_decode(
      q2d, kv_cache.reshape(-1, D_QK), meta, page_ids, scales, h_q=h_q,
      rows_per_group=rows_per_group, page_size=kv_cache.shape[1], causal=causal,
      config=config, out_dtype=out_dtype, interpret=interpret)


def mla_decode(q, kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, *,
               max_seqlen_q: int, sm_scale: float | None = None, causal: bool = True,
               q_scale=None, kv_scale=None, num_kv_splits: int | None = None,
               config: triton.Config | None = None, checks: bool = False,
               implementation: Implementation = None, interpret: bool = False):
  """Dense MLA decode over a paged latent cache, AITER ``mla_decode_fwd`` convention.

  Request ``b`` owns query tokens ``qo_indptr[b] .. qo_indptr[b+1]-1`` and pages
  ``kv_indices[kv_indptr[b] .. kv_indptr[b+1]-1]``; its length is
  ``(num_pages - 1) * page_size + kv_last_page_lens[b]`` (with ``page_size == 1``
  the page count, as AITER). With ``causal`` and ``q_len > 1`` (speculative
  decoding), query ``i`` sees keys ``< seq_len - (q_len - 1 - i)`` (bottom-right).

  Args:
    q: ``[T, h_q, 576]`` bf16 or float8_e4m3fn (absorbed queries: 512 NoPE + 64 RoPE).
    kv_cache: ``[num_pages, page_size, 576]`` bf16 or float8_e4m3fn latent cache
      (AITER's ``[num_pages, page_size, 1, 576]`` without the KV-head axis).
    qo_indptr: ``[B+1]`` query offsets (integer metadata: any integer dtype, cast to int32).
    kv_indptr: ``[B+1]`` offsets into ``kv_indices`` (pages per request).
    kv_indices: ``[N]`` page ids; invalid ids (``< 0`` or ``>= num_pages``) are masked.
    kv_last_page_lens: ``[B]`` tokens in each request's last page.
    max_seqlen_q: static bound on queries per request (1..8 typical); query rows
      past it, and tokens outside every request, return 0 with ``lse = +inf``.
    sm_scale: static softmax scale (a Python number); default ``576 ** -0.5`` (AITER
      and FlashMLA default ``1/sqrt(qk_head_dim)``; DeepSeek models pass their own).
    causal: bottom-right causal mask for multi-token queries.
    q_scale, kv_scale: per-tensor dequantisation scales (float or one-element
      array) of fp8 ``q`` / ``kv_cache``: scores use ``q_scale * kv_scale``, V ``kv_scale``.
    num_kv_splits: static split-KV count (replaces ``config.num_splits`` when given);
      ``None`` picks one from the batch size, the average pages per request
      (``N / B``) and the SM count.
    config: ``None`` (the heuristic) or a :class:`jax_mla.dense_decode.triton.Config`.
    checks: also check values (eager raise; under ``jax.jit`` wrap the call in
      ``checkify.checkify``): indptrs non-decreasing, within ``[0, T]`` / ``[0, N]``,
      ``1 <= kv_last_page_lens <= page_size`` for requests with pages
      (``page_size > 1``).
    implementation: ``None``, ``"triton"`` (old name ``"pallas"``) or ``"xla"``.
    interpret: run the Triton kernel in the Pallas interpreter.

  Returns:
    ``(out [T, h_q, 512] bf16, lse f32[T, h_q])``, natural-log LSE of the scaled
    scores; rows without keys get ``out = 0``, ``lse = +inf``.
  """
  check_rank("q", q, 3)
  check_dtype("q", q, _Q_DTYPES)
  check_shape("q", q, [None, None, D_QK])
  _check_cache("kv_cache", kv_cache)
  qo_indptr, kv_indptr, kv_indices, kv_last_page_lens = _int_metadata(
      1, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
      kv_last_page_lens=kv_last_page_lens)
  num_req = qo_indptr.shape[0] - 1
  if num_req < 1:
    raise ValueError(f"qo_indptr must have at least 2 entries; got shape {qo_indptr.shape}")
  check_shape("kv_indptr", kv_indptr, [num_req + 1])
  check_shape("kv_last_page_lens", kv_last_page_lens, [num_req])
  _check_positive_int("max_seqlen_q", max_seqlen_q, optional=False)
  check_num_splits("num_kv_splits", num_kv_splits)
  _check_sm_scale(sm_scale)
  num_tokens, h_q, _ = q.shape
  page_size = kv_cache.shape[1]
  if checks:
    num_pages = kv_indptr[1:] - kv_indptr[:-1]
    lens_ok = (kv_last_page_lens >= 1) & (kv_last_page_lens <= page_size)
    check_values(
        True,
        (qo_indptr[1:] >= qo_indptr[:-1], "qo_indptr must be non-decreasing"),
        ((qo_indptr[0] >= 0) & (qo_indptr[-1] <= num_tokens),
         f"qo_indptr must lie in [0, T={num_tokens}]"),
        (num_pages >= 0, "kv_indptr must be non-decreasing"),
        ((kv_indptr[0] >= 0) & (kv_indptr[-1] <= kv_indices.shape[0]),
         f"kv_indptr must lie in [0, len(kv_indices)={kv_indices.shape[0]}]"),
        # AITER ignores the last-page lengths of a flat (page size 1) cache.
        ((num_pages <= 0) | lens_ok | (page_size == 1),
         f"kv_last_page_lens must lie in [1, page_size={page_size}]"))
  sm_scale = D_QK**-0.5 if sm_scale is None else float(sm_scale)
  config = backend_config(
      resolve_implementation(implementation, interpret, like=q), config,
      triton=_triton(num_kv_splits, rows_per_group=max_seqlen_q * h_q, num_groups=num_req,
                     avg_kv_len=kv_indices.shape[0] * page_size / num_req))
  return _mla_decode(q, kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, q_scale,
                     kv_scale, max_seqlen_q=max_seqlen_q, sm_scale=sm_scale, causal=bool(causal),
                     config=config, interpret=interpret)


@functools.partial(jax.jit,
                   static_argnames=("max_seqlen_q", "sm_scale", "causal", "config", "interpret"))
def _mla_decode(q, kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, q_scale,
                kv_scale, *, max_seqlen_q, sm_scale, causal, config, interpret):
  if config is None:
    return ref.mla_decode_reference(q, kv_cache, qo_indptr, kv_indptr, kv_indices,
                                    kv_last_page_lens, sm_scale=sm_scale, causal=causal,
                                    q_scale=q_scale, kv_scale=kv_scale)
  num_tokens, h_q, _ = q.shape
  meta = md.aiter_groups(qo_indptr, kv_indptr, kv_last_page_lens, page_size=kv_cache.shape[1])
  out, lse = _run_triton(
      q.reshape(num_tokens * h_q, D_QK), kv_cache, meta, kv_indices,
      triton.kernel_scales(sm_scale, q_scale, kv_scale, kv_scale), h_q=h_q,
      rows_per_group=max_seqlen_q * h_q, causal=causal, config=config,
      out_dtype=jnp.bfloat16, interpret=interpret)
  # Tokens outside every request (or past max_seqlen_q) were not computed.
  tok_ok = md.aiter_computed_tokens(qo_indptr, num_tokens, max_seqlen_q)
  out = jnp.where(tok_ok[:, None, None], out.reshape(num_tokens, h_q, D_NOPE), 0)
  lse = jnp.where(tok_ok[:, None], lse.reshape(num_tokens, h_q), jnp.inf)
  return out, lse


def mla_decode_paged(q, kv_cache, block_table, cache_seqlens, *, sm_scale: float | None = None,
                     causal: bool = False, num_kv_splits: int | None = None,
                     config: triton.Config | mosaic.Config | None = None, checks: bool = False,
                     implementation: Implementation = None, interpret: bool = False):
  """Dense MLA decode with a block table, FlashMLA ``flash_mla_with_kvcache`` convention.

  Args:
    q: ``[b, s_q, h_q, 576]`` bf16 queries.
    kv_cache: ``[num_blocks, block_size, 576]`` bf16 latent cache (FlashMLA's
      ``[num_blocks, block_size, 1, 576]`` without the KV-head axis).
    block_table: ``[b, max_blocks]`` integer; request ``i``'s key ``t`` lives in block
      ``block_table[i, t // block_size]``. Entries past the sequence are never read;
      invalid ids inside it are masked.
    cache_seqlens: ``[b]`` integer keys per request (0 allowed; clipped to
      ``[0, max_blocks * block_size]``).
    sm_scale: static softmax scale; default ``576 ** -0.5`` (FlashMLA's ``d_qk ** -0.5``).
    causal: for ``s_q > 1``, query ``i`` sees keys ``<= seq_len - s_q + i``.
    num_kv_splits: static split-KV count (replaces ``config.num_splits`` when given);
      ``None`` picks one that fills the GPU.
    config: ``None`` (the heuristic), a :class:`jax_mla.dense_decode.triton.Config`
      (Triton) or a :class:`jax_mla.dense_decode.mosaic.Config` (Mosaic GPU), matching
      the implementation that runs.
    checks: also check values (eager raise; under ``jax.jit`` wrap the call in
      ``checkify.checkify``): ``0 <= cache_seqlens <= max_blocks * block_size`` and
      the block ids each sequence uses inside ``[0, num_blocks)``.
    implementation: ``"triton"`` (old name ``"pallas"``), ``"mosaic"`` (Pallas Mosaic
      GPU, Hopper: block size 64; a request's ``s_q * h_q`` query rows in one
      transposed tile when at most 32, else in 64-row tiles), ``"xla"`` (the
      reference), or
      ``None``: Mosaic GPU on a Hopper GPU for the shapes it takes, else Triton on
      GPU, else the reference.

  Returns:
    ``(out [b, s_q, h_q, 512] q.dtype, lse f32[b, h_q, s_q])``; rows without keys
    get ``out = 0`` and ``lse = +inf``.
  """
  check_rank("q", q, 4)
  check_dtype("q", q, jnp.bfloat16)
  check_shape("q", q, [None, None, None, D_QK])
  _check_cache("kv_cache", kv_cache)
  check_dtype("kv_cache", kv_cache, jnp.bfloat16)
  b, s_q, h_q, _ = q.shape
  (block_table,) = _int_metadata(2, block_table=block_table)
  check_shape("block_table", block_table, [b, None])
  (cache_seqlens,) = _int_metadata(1, cache_seqlens=cache_seqlens)
  check_shape("cache_seqlens", cache_seqlens, [b])
  check_num_splits("num_kv_splits", num_kv_splits)
  _check_sm_scale(sm_scale)
  num_blocks, block_size, _ = kv_cache.shape
  if checks:
    check_values(True, *block_table_checks(block_table, cache_seqlens, block_size=block_size,
                                           num_blocks=num_blocks, lens_name="cache_seqlens"))
  sm_scale = D_QK**-0.5 if sm_scale is None else float(sm_scale)
  if implementation == "mosaic":
    mosaic.check_supported(q, kv_cache, causal=causal)
  impl = resolve_implementation(implementation, interpret, has_mosaic=True, like=q)
  if b * s_q * h_q == 0:  # no query row: nothing to run (a kernel's grid would be empty)
    return jnp.zeros((b, s_q, h_q, D_NOPE), q.dtype), jnp.zeros((b, h_q, s_q), jnp.float32)
  if implementation is None and impl == "triton" and not interpret and _mosaic.default_for(
      mosaic.check_supported, q, kv_cache, causal=causal):
    impl = "mosaic"
  max_blocks = block_table.shape[1]
  config = backend_config(
      impl, config,
      triton=_triton(num_kv_splits, rows_per_group=s_q * h_q, num_groups=b,
                     avg_kv_len=max_blocks * block_size),
      mosaic=(mosaic.Config, functools.partial(mosaic.with_defaults, num_kv_splits=num_kv_splits,
                                               batch=b, s_q=s_q, h_q=h_q,
                                               max_blocks=max_blocks)))
  out, lse = _mla_decode_paged(q, kv_cache, block_table, cache_seqlens, sm_scale=sm_scale,
                               causal=bool(causal), config=config, interpret=interpret)
  return out, lse


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "config", "interpret"))
def _mla_decode_paged(q, kv_cache, block_table, cache_seqlens, *, sm_scale, causal, config,
                      interpret):
  """``(out [b, s_q, h_q, 512], lse [b, h_q, s_q])`` (FlashMLA's LSE layout: the
  Mosaic GPU kernel writes it so)."""
  if config is None:
    out, lse = ref.mla_decode_paged_reference(q, kv_cache, block_table, cache_seqlens,
                                              sm_scale=sm_scale, causal=causal)
    return out, lse.transpose(0, 2, 1)
  if isinstance(config, mosaic.Config):
    return mosaic.paged_decode(q, kv_cache, block_table, cache_seqlens, sm_scale=sm_scale,
                               causal=causal, config=config)
  b, s_q, h_q, _ = q.shape
  meta = md.paged_groups(block_table, cache_seqlens, s_q=s_q, page_size=kv_cache.shape[1])
  out, lse = _run_triton(
      q.reshape(b * s_q * h_q, D_QK), kv_cache, meta, block_table.reshape(-1),
      triton.kernel_scales(sm_scale), h_q=h_q, rows_per_group=s_q * h_q, causal=causal,
      config=config, out_dtype=q.dtype, interpret=interpret)
  return out.reshape(b, s_q, h_q, D_NOPE), lse.reshape(b, s_q, h_q).transpose(0, 2, 1)


def mla_ragged_paged_attention(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens,
                               page_indices, cu_q_lens, distribution, *,
                               sm_scale: float = 1.0, sliding_window: int | None = None,
                               soft_cap: float | None = None, mask_value: float | None = None,
                               q_scale=None, k_scale=None, v_scale=None,
                               chunk_prefill_size: int | None = None,
                               num_kv_pages_per_block: int | None = None,
                               num_queries_per_block: int | None = None,
                               vmem_limit_bytes: int | None = None, debug_mode: bool = False,
                               num_kv_splits: int | None = None,
                               config: triton.Config | None = None, donate: bool = False,
                               implementation: Implementation = None, interpret: bool = False):
  """MLA ragged paged attention with the cache write, tpu-inference MLA v1 convention.

  One call writes the new tokens' latents into the paged cache, then attends
  every live query token causally over its sequence (decode, chunked prefill
  and mixed batches alike). Sequence ``i < distribution[2]`` owns query tokens
  ``cu_q_lens[i] .. cu_q_lens[i+1]-1``; ``kv_lens[i]`` counts its keys
  *including* the new tokens, so new token ``j`` is key position
  ``kv_lens[i] - q_len + j`` and sees keys ``0 .. kv_lens[i] - q_len + j``.

  GPU layout: ``cache_kv`` is ``[num_pages, page_size, 576]`` = ``[kv_c(512) |
  k_pe(64)]`` (tpu-inference packs ``[num_pages, page_size/packing, packing,
  640]`` with 128-lane padding for the TPU; the GPU needs neither).

  The keyword arguments are tpu-inference's (``tpu_inference/kernels/mla/v1/kernel.py``),
  so calls port unchanged; its TPU tuning knobs are accepted and have no effect here.

  Args:
    ql_nope: ``[T, N, 512]`` absorbed NoPE queries (bf16).
    q_pe: ``[T, N, 64]`` RoPE queries.
    new_kv_c: ``[T, 512]`` new latents, dtype of ``cache_kv``.
    new_k_pe: ``[T, 64]`` new RoPE keys, dtype of ``cache_kv``.
    cache_kv: ``[num_pages, page_size, 576]`` bf16 or float8_e4m3fn (updated in place
      under ``jax.jit`` when the jitted function donates it; see ``donate``).
    kv_lens: ``[S]`` integer keys per sequence (after the write).
    page_indices: ``[S * pages_per_seq]`` integer; sequence ``i``'s pages start at
      ``i * pages_per_seq``.
    cu_q_lens: ``[S+1]`` integer query offsets.
    distribution: ``[3]`` integer ``(decode_end, prefill_end, mixed_end)``; only
      ``mixed_end`` (the number of live sequences) changes the result.
    sm_scale: static softmax scale (default 1.0, as tpu-inference).
    sliding_window, soft_cap: must be ``None`` (not supported; ``ValueError`` otherwise).
    mask_value: accepted; masked keys are excluded from the softmax, which equals any
      mask value far below the scores. A row with no key returns 0.
    q_scale, k_scale, v_scale: per-tensor scales: scores are multiplied by
      ``q_scale * k_scale``, the output by ``v_scale``.
    chunk_prefill_size, num_kv_pages_per_block, vmem_limit_bytes: tpu-inference's TPU
      tuning; accepted (static ints or None) and unused on GPU.
    num_queries_per_block: static query tokens per program group (default: enough
      for 16 rows of query heads).
    debug_mode: must be False (tpu-inference's TPU log recorder).
    num_kv_splits: static split-KV count (replaces ``config.num_splits`` when given).
    config: ``None`` (the heuristic) or a :class:`jax_mla.dense_decode.triton.Config`.
    donate: give ``cache_kv``'s buffer to the call in an eager call (in place; the
      caller's array is deleted), as :func:`jax_mla.cache.concat_and_cache_mla` does.
      Without it an eager call leaves the caller's cache intact. Inside ``jax.jit`` it
      changes nothing.

  Returns:
    ``(o_latent [T, N, 512] ql_nope.dtype, updated cache_kv)``. Padding tokens
    (past ``cu_q_lens[distribution[2]]``) get zeros.
  """
  check_rank("ql_nope", ql_nope, 3)
  check_dtype("ql_nope", ql_nope, jnp.bfloat16)
  check_shape("ql_nope", ql_nope, [None, None, D_NOPE])
  num_tokens, n_heads, _ = ql_nope.shape
  check_rank("q_pe", q_pe, 3)
  check_dtype("q_pe", q_pe, jnp.bfloat16)
  check_shape("q_pe", q_pe, [num_tokens, n_heads, D_ROPE])
  _check_cache("cache_kv", cache_kv)
  check_rank("new_kv_c", new_kv_c, 2)
  check_shape("new_kv_c", new_kv_c, [num_tokens, D_NOPE])
  check_dtype("new_kv_c", new_kv_c, cache_kv.dtype)
  check_rank("new_k_pe", new_k_pe, 2)
  check_shape("new_k_pe", new_k_pe, [num_tokens, D_ROPE])
  check_dtype("new_k_pe", new_k_pe, cache_kv.dtype)
  kv_lens, page_indices, cu_q_lens, distribution = _int_metadata(
      1, kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
      distribution=distribution)
  num_seqs_max = kv_lens.shape[0]
  check_shape("cu_q_lens", cu_q_lens, [num_seqs_max + 1])
  check_shape("distribution", distribution, [3])
  if page_indices.shape[0] % num_seqs_max:
    raise ValueError(f"page_indices length must be a multiple of kv_lens length "
                     f"{num_seqs_max}; got {page_indices.shape[0]}")
  _check_sm_scale(sm_scale, optional=False)
  for name, value in (("sliding_window", sliding_window), ("soft_cap", soft_cap)):
    if value is not None:
      raise ValueError(f"{name} is not supported on GPU (only None); got {value!r}")
  if debug_mode:
    raise ValueError("debug_mode=True (tpu-inference's TPU log recorder) is not supported")
  if mask_value is not None:
    check_static("mask_value", mask_value, (int, float))
  for name, value in (("chunk_prefill_size", chunk_prefill_size),
                      ("num_kv_pages_per_block", num_kv_pages_per_block),
                      ("vmem_limit_bytes", vmem_limit_bytes),
                      ("num_queries_per_block", num_queries_per_block)):
    _check_positive_int(name, value)
  check_num_splits("num_kv_splits", num_kv_splits)
  sm_scale = float(sm_scale)
  page_size = cache_kv.shape[1]
  pages_per_seq = page_indices.shape[0] // num_seqs_max
  tokens_per_group = num_queries_per_block or max(1, 16 // n_heads)
  config = backend_config(
      resolve_implementation(implementation, interpret, like=ql_nope), config,
      triton=_triton(num_kv_splits, rows_per_group=tokens_per_group * n_heads,
                     num_groups=num_seqs_max + -(-num_tokens // tokens_per_group),
                     avg_kv_len=pages_per_seq * page_size))
  run = _mla_ragged_paged_attention_donated if donate else _mla_ragged_paged_attention
  return run(
      ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens,
      distribution, q_scale, k_scale, v_scale, sm_scale=sm_scale,
      tokens_per_group=tokens_per_group, config=config, interpret=interpret)


def _mla_ragged_paged_attention(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens,
                                page_indices, cu_q_lens, distribution, q_scale, k_scale,
                                v_scale, *, sm_scale, tokens_per_group, config, interpret):
  if config is None:
    return ref.mla_ragged_paged_attention_reference(
        ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens,
        distribution, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
  num_tokens, n_heads, _ = ql_nope.shape
  cache_kv = md.update_kv_cache(new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices,
                                cu_q_lens, distribution)
  page_size = cache_kv.shape[1]
  meta = md.ragged_groups(cu_q_lens, kv_lens, distribution, tokens_per_group=tokens_per_group,
                          num_tokens=num_tokens,
                          pages_per_seq=page_indices.shape[0] // kv_lens.shape[0],
                          page_size=page_size)
  q = jnp.concatenate([ql_nope, q_pe], axis=-1).reshape(num_tokens * n_heads, D_QK)
  out, _ = _run_triton(
      q, cache_kv, meta, page_indices,
      triton.kernel_scales(sm_scale, q_scale, k_scale, v_scale), h_q=n_heads,
      rows_per_group=tokens_per_group * n_heads, causal=True, config=config,
      out_dtype=ql_nope.dtype, interpret=interpret)
  _, tok_ok, _, _ = md.ragged_token_layout(cu_q_lens, distribution, num_tokens)
  out = jnp.where(tok_ok[:, None, None], out.reshape(num_tokens, n_heads, D_NOPE), 0)
  return out, cache_kv


_RAGGED_STATIC = ("sm_scale", "tokens_per_group", "config", "interpret")
_mla_ragged_paged_attention_donated = jax.jit(
    _mla_ragged_paged_attention, static_argnames=_RAGGED_STATIC, donate_argnames=("cache_kv",))
_mla_ragged_paged_attention = jax.jit(_mla_ragged_paged_attention,
                                      static_argnames=_RAGGED_STATIC)


# --- sharding: how jax_mla.sharding splits these ops over devices (see OpSharding) ---------

# mla_decode and mla_ragged_paged_attention have ragged metadata: requests only stacked.
mla_decode.sharding = OpSharding(heads=dict(q=1), head_outs=(1, 1), num_heads=shape_of("q", 1),
                                 shared=("q_scale", "kv_scale"))
mla_decode_paged.sharding = OpSharding(
    heads=dict(q=2), head_outs=(2, 1), num_heads=shape_of("q", 2),
    requests=dict(q=0, kv_cache=0, block_table=0, cache_seqlens=0), request_outs=(0, 0),
    rebase=dict(block_table=("kv_cache", "rows")))
mla_ragged_paged_attention.sharding = OpSharding(
    heads=dict(ql_nope=1, q_pe=1), head_outs=(1, None), num_heads=shape_of("ql_nope", 1),
    shared=("q_scale", "k_scale", "v_scale"))
