"""Dense MLA decode: AITER, FlashMLA and tpu-inference conventions over one kernel.

Each public function validates its inputs, then either runs the jax.numpy
reference (``implementation="xla"``) or lowers its metadata to query groups
(see :mod:`jax_mla.dense_decode.pallas`) and runs the shared split-KV kernel.
``mla_decode_paged`` also has a Mosaic GPU kernel for Hopper
(:mod:`jax_mla.dense_decode.mosaic`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla._common import (
  cdiv,
  check_dtype,
  check_int32,
  check_rank,
  check_shape,
  resolve_implementation,
)
from jax_mla.dense_decode import mosaic
from jax_mla.dense_decode import pallas as kern
from jax_mla.dense_decode import reference as ref

D_QK = kern.D_QK
D_NOPE = kern.D_NOPE
D_ROPE = kern.D_ROPE
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
        f"{name} has {kv_cache.size} elements; the Pallas kernel addresses at most 2**31-1 "
        "(int32 offsets): split the cache or use implementation='xla'")


def _check_num_splits(num_kv_splits):
  if num_kv_splits is not None and (not isinstance(num_kv_splits, int) or num_kv_splits < 1):
    raise ValueError(f"num_kv_splits must be None or a positive int; got {num_kv_splits!r}")


def _run_kernel(q2d, kv_cache, meta, page_ids, scales, *, h_q, rows_per_group, causal,
                num_kv_splits, avg_kv_len, out_dtype, interpret):
  block_m = kern.default_block_m(rows_per_group)
  block_n, num_warps, num_stages = kern.default_config(block_m)
  num_mtiles = cdiv(rows_per_group, block_m)
  if num_kv_splits is None:
    num_kv_splits = kern.default_num_splits(meta.shape[1] * num_mtiles, avg_kv_len,
                                            block_m=block_m, block_n=block_n)
  page_size = kv_cache.shape[1]
  return kern.paged_mla_decode(
      q2d, kv_cache.reshape(-1, D_QK), meta, page_ids, scales, h_q=h_q,
      rows_per_group=rows_per_group, page_size=page_size, causal=causal,
      num_splits=num_kv_splits, block_m=block_m, block_n=block_n, num_warps=num_warps,
      num_stages=num_stages, out_dtype=out_dtype, interpret=interpret)


@functools.partial(
    jax.jit, static_argnames=("max_seqlen_q", "sm_scale", "causal", "num_kv_splits",
                              "implementation", "interpret"))
def mla_decode(q, kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, *,
               max_seqlen_q, sm_scale=None, causal=True, q_scale=None, kv_scale=None,
               num_kv_splits=None, implementation=None, interpret=False):
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
    qo_indptr: ``i32[B+1]`` query offsets.
    kv_indptr: ``i32[B+1]`` offsets into ``kv_indices`` (pages per request).
    kv_indices: ``i32[N]`` page ids; invalid ids (``< 0`` or ``>= num_pages``) are masked.
    kv_last_page_lens: ``i32[B]`` tokens in each request's last page.
    max_seqlen_q: static bound on queries per request (1..8 typical); query rows
      past it, and tokens outside every request, return 0 with ``lse = +inf``.
    sm_scale: softmax scale; default ``576 ** -0.5`` (AITER and FlashMLA default
      ``1/sqrt(qk_head_dim)``; DeepSeek models pass their own).
    causal: bottom-right causal mask for multi-token queries.
    q_scale, kv_scale: per-tensor dequantisation scales (float or one-element
      array) of fp8 ``q`` / ``kv_cache``: scores use ``q_scale * kv_scale``, V ``kv_scale``.
    num_kv_splits: static split-KV count; ``None`` picks one from the batch size,
      the average pages per request (``N / B``) and the SM count.
    implementation: ``None``, ``"pallas"`` or ``"xla"`` (reference).
    interpret: run the Pallas kernel in the interpreter.

  Returns:
    ``(out [T, h_q, 512] bf16, lse f32[T, h_q])``, natural-log LSE of the scaled
    scores; rows without keys get ``out = 0``, ``lse = +inf``.
  """
  check_rank("q", q, 3)
  check_dtype("q", q, _Q_DTYPES)
  check_shape("q", q, [None, None, D_QK])
  _check_cache("kv_cache", kv_cache)
  for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                  ("kv_indices", kv_indices), ("kv_last_page_lens", kv_last_page_lens)):
    check_rank(name, x, 1)
    check_int32(name, x)
  num_req = qo_indptr.shape[0] - 1
  if num_req < 1:
    raise ValueError(f"qo_indptr must have at least 2 entries; got shape {qo_indptr.shape}")
  check_shape("kv_indptr", kv_indptr, [num_req + 1])
  check_shape("kv_last_page_lens", kv_last_page_lens, [num_req])
  if not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
    raise ValueError(f"max_seqlen_q must be a positive int; got {max_seqlen_q!r}")
  _check_num_splits(num_kv_splits)
  sm_scale = D_QK**-0.5 if sm_scale is None else float(sm_scale)
  impl = resolve_implementation(implementation, interpret)
  if impl == "xla":
    return ref.mla_decode_reference(q, kv_cache, qo_indptr, kv_indptr, kv_indices,
                                    kv_last_page_lens, sm_scale=sm_scale, causal=causal,
                                    q_scale=q_scale, kv_scale=kv_scale)

  num_tokens, h_q, _ = q.shape
  page_size = kv_cache.shape[1]
  seq_lens = ref.aiter_seq_lens(kv_indptr, kv_last_page_lens, page_size)
  q_len = qo_indptr[1:] - qo_indptr[:-1]
  meta = jnp.stack([qo_indptr[:-1], q_len, seq_lens, seq_lens - q_len, kv_indptr[:-1]])
  avg_kv_len = kv_indices.shape[0] * page_size / num_req
  out, lse = _run_kernel(
      q.reshape(num_tokens * h_q, D_QK), kv_cache, meta, kv_indices,
      kern.kernel_scales(sm_scale, q_scale, kv_scale, kv_scale), h_q=h_q,
      rows_per_group=max_seqlen_q * h_q, causal=causal, num_kv_splits=num_kv_splits,
      avg_kv_len=avg_kv_len, out_dtype=jnp.bfloat16, interpret=interpret)
  # Tokens outside every request (or past max_seqlen_q) were not computed.
  req, tok_ok = ref.token_requests(qo_indptr, num_tokens)
  tok_ok &= jnp.arange(num_tokens) - qo_indptr[:-1][req] < max_seqlen_q
  out = jnp.where(tok_ok[:, None, None], out.reshape(num_tokens, h_q, D_NOPE), 0)
  lse = jnp.where(tok_ok[:, None], lse.reshape(num_tokens, h_q), jnp.inf)
  return out, lse


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "causal", "num_kv_splits", "implementation", "interpret"))
def mla_decode_paged(q, kv_cache, block_table, cache_seqlens, *, sm_scale=None, causal=False,
                     num_kv_splits=None, implementation=None, interpret=False):
  """Dense MLA decode with a block table, FlashMLA ``flash_mla_with_kvcache`` convention.

  Args:
    q: ``[b, s_q, h_q, 576]`` bf16 queries.
    kv_cache: ``[num_blocks, block_size, 576]`` bf16 latent cache (FlashMLA's
      ``[num_blocks, block_size, 1, 576]`` without the KV-head axis).
    block_table: ``i32[b, max_blocks]``; request ``i``'s key ``t`` lives in block
      ``block_table[i, t // block_size]``. Entries past the sequence are never read.
    cache_seqlens: ``i32[b]`` keys per request (0 allowed; clipped to
      ``max_blocks * block_size``).
    sm_scale: softmax scale; default ``576 ** -0.5`` (FlashMLA's ``d_qk ** -0.5``).
    causal: for ``s_q > 1``, query ``i`` sees keys ``<= seq_len - s_q + i``.
    num_kv_splits: static split-KV count; ``None`` picks one that fills the GPU.
    implementation: ``"pallas"`` (Triton), ``"mosaic"`` (Pallas Mosaic GPU,
      Hopper: block size 64, ``s_q * h_q`` a multiple of 64, and ``h_q`` a
      multiple of 64 when causal with ``s_q > 1``), ``"xla"`` (the reference),
      or ``None``: Mosaic GPU on a Hopper GPU for the shapes it takes, else
      Triton on GPU, else the reference.

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
  check_rank("block_table", block_table, 2)
  check_int32("block_table", block_table)
  check_shape("block_table", block_table, [b, None])
  check_rank("cache_seqlens", cache_seqlens, 1)
  check_int32("cache_seqlens", cache_seqlens)
  check_shape("cache_seqlens", cache_seqlens, [b])
  _check_num_splits(num_kv_splits)
  sm_scale = D_QK**-0.5 if sm_scale is None else float(sm_scale)
  if implementation == "mosaic":
    mosaic.check_supported(q, kv_cache, causal=causal)
  impl = resolve_implementation(implementation, interpret, has_mosaic=True)
  if impl == "xla":
    return ref.mla_decode_paged_reference(q, kv_cache, block_table, cache_seqlens,
                                          sm_scale=sm_scale, causal=causal)
  max_blocks = block_table.shape[1]
  if impl == "mosaic" or (implementation is None and not interpret
                          and mosaic.default_for(q, kv_cache, causal=causal)):
    splits = num_kv_splits or mosaic.default_num_splits(
        b * s_q * h_q // mosaic.BLOCK_M, max_blocks)
    return mosaic.paged_decode(q, kv_cache, block_table, cache_seqlens, sm_scale=sm_scale,
                               causal=causal, num_splits=splits)

  page_size = kv_cache.shape[1]
  meta = paged_groups(block_table, cache_seqlens, s_q=s_q, page_size=page_size)
  out, lse = _run_kernel(
      q.reshape(b * s_q * h_q, D_QK), kv_cache, meta, block_table.reshape(-1),
      kern.kernel_scales(sm_scale), h_q=h_q, rows_per_group=s_q * h_q, causal=causal,
      num_kv_splits=num_kv_splits, avg_kv_len=max_blocks * page_size, out_dtype=q.dtype,
      interpret=interpret)
  return (out.reshape(b, s_q, h_q, D_NOPE),
          lse.reshape(b, s_q, h_q).transpose(0, 2, 1))


def paged_groups(block_table, cache_seqlens, *, s_q, page_size):
  """Query-group metadata (``i32[5, b]``) for the FlashMLA block-table convention."""
  b, max_blocks = block_table.shape
  seq = jnp.clip(cache_seqlens, 0, max_blocks * page_size)
  req = jnp.arange(b, dtype=jnp.int32)
  return jnp.stack([req * s_q, jnp.full((b,), s_q, jnp.int32), seq, seq - s_q,
                    req * max_blocks])


def _ragged_groups(cu_q_lens, kv_lens, distribution, *, tokens_per_group, num_tokens,
                   pages_per_seq, page_size):
  """Splits each live sequence's queries into groups of ``tokens_per_group`` tokens.

  Returns ``meta i32[5, G]`` with ``G = max_num_seqs + ceil(T / tokens_per_group)``
  (a static bound); unused groups have ``q_len = 0``.
  """
  num_seqs_max = kv_lens.shape[0]
  num_groups = num_seqs_max + cdiv(num_tokens, tokens_per_group)
  idx = jnp.arange(num_seqs_max + 1, dtype=jnp.int32)
  cu = jnp.where(idx <= distribution[2], cu_q_lens, cu_q_lens[distribution[2]])
  q_lens = cu[1:] - cu[:-1]
  chunks = (q_lens + tokens_per_group - 1) // tokens_per_group
  chunk_end = jnp.cumsum(chunks)
  g = jnp.arange(num_groups, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(chunk_end, g, side="right"), num_seqs_max - 1)
  c = g - (chunk_end - chunks)[seq]
  live = g < chunk_end[-1]
  first = c * tokens_per_group
  q_len = jnp.where(live, jnp.minimum(tokens_per_group, q_lens[seq] - first), 0)
  kv_len = jnp.minimum(kv_lens, pages_per_seq * page_size)[seq]
  causal_base = kv_len - q_lens[seq] + first
  return jnp.stack([cu[seq] + first, q_len, kv_len, causal_base, seq * pages_per_seq])


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "num_queries_per_block", "num_kv_splits", "implementation",
                     "interpret"),
    donate_argnames=("cache_kv",))
def mla_ragged_paged_attention(ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens,
                               page_indices, cu_q_lens, distribution, *, sm_scale,
                               q_scale=None, k_scale=None, v_scale=None,
                               num_queries_per_block=None, num_kv_splits=None,
                               implementation=None, interpret=False):
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

  Args:
    ql_nope: ``[T, N, 512]`` absorbed NoPE queries (bf16).
    q_pe: ``[T, N, 64]`` RoPE queries.
    new_kv_c: ``[T, 512]`` new latents, dtype of ``cache_kv``.
    new_k_pe: ``[T, 64]`` new RoPE keys, dtype of ``cache_kv``.
    cache_kv: ``[num_pages, page_size, 576]`` bf16 or float8_e4m3fn; donated.
    kv_lens: ``i32[S]`` keys per sequence (after the write).
    page_indices: ``i32[S * pages_per_seq]``; sequence ``i``'s pages start at
      ``i * pages_per_seq``.
    cu_q_lens: ``i32[S+1]`` query offsets.
    distribution: ``i32[3]`` ``(decode_end, prefill_end, mixed_end)``; only
      ``mixed_end`` (the number of live sequences) changes the result.
    sm_scale: softmax scale (required, as in tpu-inference).
    q_scale, k_scale, v_scale: per-tensor scales: scores are multiplied by
      ``q_scale * k_scale``, the output by ``v_scale``.
    num_queries_per_block: static query tokens per program group (default:
      enough for 16 rows of query heads).
    num_kv_splits: static split-KV count (default: heuristic).

  Returns:
    ``(o_latent [T, N, 512] ql_nope.dtype, updated cache_kv)``. Padding tokens
    (past ``cu_q_lens[distribution[2]]``) get zeros. Sliding window and soft cap
    are not supported.
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
  for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices),
                  ("cu_q_lens", cu_q_lens), ("distribution", distribution)):
    check_rank(name, x, 1)
    check_int32(name, x)
  num_seqs_max = kv_lens.shape[0]
  check_shape("cu_q_lens", cu_q_lens, [num_seqs_max + 1])
  check_shape("distribution", distribution, [3])
  if page_indices.shape[0] % num_seqs_max:
    raise ValueError(f"page_indices length must be a multiple of kv_lens length "
                     f"{num_seqs_max}; got {page_indices.shape[0]}")
  if num_queries_per_block is not None and (not isinstance(num_queries_per_block, int)
                                            or num_queries_per_block < 1):
    raise ValueError(f"num_queries_per_block must be None or a positive int; "
                     f"got {num_queries_per_block!r}")
  _check_num_splits(num_kv_splits)
  sm_scale = float(sm_scale)
  impl = resolve_implementation(implementation, interpret)
  if impl == "xla":
    return ref.mla_ragged_paged_attention_reference(
        ql_nope, q_pe, new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices, cu_q_lens,
        distribution, sm_scale=sm_scale, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

  cache_kv = ref.update_kv_cache(new_kv_c, new_k_pe, cache_kv, kv_lens, page_indices,
                                 cu_q_lens, distribution)
  page_size = cache_kv.shape[1]
  pages_per_seq = page_indices.shape[0] // num_seqs_max
  tokens_per_group = num_queries_per_block or max(1, 16 // n_heads)
  meta = _ragged_groups(cu_q_lens, kv_lens, distribution, tokens_per_group=tokens_per_group,
                        num_tokens=num_tokens, pages_per_seq=pages_per_seq,
                        page_size=page_size)
  q = jnp.concatenate([ql_nope, q_pe], axis=-1).reshape(num_tokens * n_heads, D_QK)
  out, _ = _run_kernel(
      q, cache_kv, meta, page_indices, kern.kernel_scales(sm_scale, q_scale, k_scale, v_scale),
      h_q=n_heads, rows_per_group=tokens_per_group * n_heads, causal=True,
      num_kv_splits=num_kv_splits, avg_kv_len=pages_per_seq * page_size,
      out_dtype=ql_nope.dtype, interpret=interpret)
  _, tok_ok, _, _ = ref.ragged_token_layout(cu_q_lens, distribution, num_tokens)
  out = jnp.where(tok_ok[:, None, None], out.reshape(num_tokens, n_heads, D_NOPE), 0)
  return out, cache_kv
