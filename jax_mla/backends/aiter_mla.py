"""AiterMLA: a functional JAX version of vLLM's ROCm AITER MLA backend.

Mirrors ``vllm/v1/attention/backends/mla/rocm_aiter_mla.py`` on top of the
common MLA flow (``vllm/v1/attention/backends/mla/common.py``):

* decode (``forward_mqa``): absorbed queries ``[ql_nope(512) | q_pe(64)]`` against
  the latent cache through ``jax_mla.dense_decode`` on the page-size-1 flat view of
  the cache (``paged_kv_indices`` from ``expand_page_indices``), with query heads
  padded to 16 by AITER's rule and unpadded after;
* prefill (``forward_mha``): ``kv_b_proj`` decompresses the new latents into
  ``k_nope``/``v``, ``k = [k_nope | k_pe]`` (192), ``jax_mla.dense_prefill`` runs
  causal attention over the new tokens, and the cached context is processed in
  chunks gathered from the cache (``causal=False``, with LSE) and merged by
  ``jax_mla.merge.merge_attn_states``;
* ``aiter_mla_forward``: the whole layer (cache write, prefill, absorbed decode,
  ``W_UV`` up-projection), tokens ordered decodes first as vLLM orders them.

:class:`AiterMLA` gathers the entry points and shows a whole step.

Metadata are pytree dataclasses whose host-derived counts are static fields
(changing them retraces, like a new CUDA-graph capture size in vLLM).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla._common import Implementation, cdiv
from jax_mla._pytree import pytree_dataclass, static_field
from jax_mla.backends._batch import split_decodes_and_prefills
from jax_mla.cache import concat_and_cache_mla, gather_dequantize
from jax_mla.cache.e4m3 import cast_fp8
from jax_mla.dense_decode import mla_decode
from jax_mla.dense_prefill import mla_prefill, mla_prefill_token_major
from jax_mla.indexing import expand_page_indices
from jax_mla.merge import merge_attn_states
from jax_mla.sharding import OpSharding, config_heads, set_config_heads

AITER_MIN_MLA_HEADS = 16
KV_CACHE_DTYPES = ("auto", "fp8")


# --- head padding (AiterMLAHelper) -----------------------------------------------------------


def is_valid_num_heads(num_heads: int) -> bool:
  """AITER needs a multiple of 16 heads, or a divisor of 16 (then padded to 16)."""
  if num_heads < 1:
    return False
  if num_heads >= AITER_MIN_MLA_HEADS:
    return num_heads % AITER_MIN_MLA_HEADS == 0
  return AITER_MIN_MLA_HEADS % num_heads == 0


def check_num_heads_validity(num_heads: int) -> None:
  """Raises ValueError with vLLM's message for a head count AITER cannot run."""
  if not is_valid_num_heads(num_heads):
    raise ValueError(
        f"Aiter MLA requires that num_heads be multiples or divisors of 16, "
        f"but provided {num_heads} number of heads.\n"
        f"Try adjusting tensor_parallel_size value.")


def padded_num_heads(num_heads: int) -> int:
  """Smallest head count ``>= num_heads`` that AITER runs (a divisor or a multiple of 16):
  the per-device count when heads are split over devices (:mod:`jax_mla.sharding`)."""
  while not is_valid_num_heads(num_heads):
    num_heads += 1
  return num_heads


def get_mla_padded_q(num_heads: int, q: jax.Array) -> jax.Array:
  """Pads ``q[T, num_heads, D]`` to 16 heads by repeating each head ``16 // num_heads`` times."""
  check_num_heads_validity(num_heads)
  if num_heads >= AITER_MIN_MLA_HEADS:
    return q
  return jnp.repeat(q, AITER_MIN_MLA_HEADS // num_heads, axis=1)


def get_mla_unpadded_o(num_heads: int, o: jax.Array) -> jax.Array:
  """Inverse of ``get_mla_padded_q`` on ``o[T, 16, D]``: keeps one copy of each head."""
  check_num_heads_validity(num_heads)
  if num_heads >= AITER_MIN_MLA_HEADS:
    return o
  return o[:, ::AITER_MIN_MLA_HEADS // num_heads]


# --- metadata ---------------------------------------------------------------------------------


@pytree_dataclass
class AiterMLADecodeMetadata:
  """Decode requests (the first ``num_decodes``) in AITER's page-size-1 layout."""
  block_table: jax.Array             # i32[num_decodes, max_blocks]
  seq_lens: jax.Array                # i32[num_decodes]
  paged_kv_indptr: jax.Array         # i32[num_decodes + 1], cumsum of seq_lens
  paged_kv_indices: jax.Array        # i32[capacity]: flat slot block*K + offset, tail -1
  paged_kv_last_page_len: jax.Array  # i32[num_decodes], all ones (page size 1)
  qo_indptr: jax.Array               # i32[num_decodes + 1], query offsets
  max_qo_len: int = static_field(1)


@pytree_dataclass
class ChunkedContextMetadata:
  """Cached context of prefill requests, processed ``num_chunks`` chunks at a time.

  Chunk ``i`` covers context tokens ``[i * chunk, (i + 1) * chunk)`` of every prefill
  request; ``slots[i]`` lists their flat cache slots, packed by ``cu_seq_lens[i]``
  (vLLM's ``gather_and_maybe_dequant_cache`` inputs, expanded on the host side).
  """
  cu_seq_lens: jax.Array           # i32[num_chunks, num_prefills + 1]
  starts: jax.Array                # i32[num_chunks, num_prefills]
  seq_lens: jax.Array              # i32[num_chunks, num_prefills]
  slots: tuple[jax.Array, ...]     # num_chunks x i32[seq_tot[i]]
  seq_tot: tuple[int, ...] = static_field(())
  max_seq_lens: tuple[int, ...] = static_field(())


@pytree_dataclass
class MLACommonPrefillMetadata:
  """Prefill requests (after the decodes); ``query_start_loc`` rebased to 0."""
  block_table: jax.Array           # i32[num_prefills, max_blocks]
  query_start_loc: jax.Array       # i32[num_prefills + 1]
  chunked_context: ChunkedContextMetadata | None = None
  max_query_len: int = static_field(0)


@pytree_dataclass
class AiterMLAMetadata:
  """Per-step metadata shared by every MLA layer (vLLM ``AiterMLAMetadata``)."""
  query_start_loc: jax.Array       # i32[num_reqs + 1]
  slot_mapping: jax.Array          # i32[num_tokens], < 0: not written
  decode: AiterMLADecodeMetadata | None = None
  prefill: MLACommonPrefillMetadata | None = None
  num_reqs: int = static_field(0)
  max_query_len: int = static_field(0)
  max_seq_len: int = static_field(0)
  num_actual_tokens: int = static_field(0)
  num_decodes: int = static_field(0)
  num_decode_tokens: int = static_field(0)
  num_prefills: int = static_field(0)


def determine_chunked_prefill_workspace_size(max_model_len: int, max_num_seqs: int,
                                             block_size: int) -> int:
  """vLLM's rule: room for 8 full requests or 4 pages each, capped at 64k tokens."""
  size = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)
  return max(size, max_num_seqs * block_size)


@dataclasses.dataclass(frozen=True)
class AiterMLAMetadataBuilder:
  """Builds ``AiterMLAMetadata`` on the host (vLLM ``AiterMLAMetadataBuilder.build``).

  Configured once (block size, buffer sizes); :meth:`build` runs each step and its
  result is shared by every layer. :class:`AiterMLA` shows a whole step.

  Attributes:
    block_size: cache block size, the kernel block size ``K`` of the flat view.
    max_model_len, max_num_seqs: size the decode page-index buffer
      (``max_num_seqs * max_model_len`` slots, as vLLM) and the context workspace.
    chunked_prefill_workspace_size: context tokens per chunk over all prefills
      (``None``: vLLM's default rule).
    decode_threshold: requests with at most this many new tokens, at the front of
      the batch and all of one length (``QueryLenSupport.UNIFORM``), are decodes
      (:func:`~jax_mla.backends.split_decodes_and_prefills`).
    implementation, interpret: for the page-index expansion (``expand_page_indices``).
  """
  block_size: int
  max_model_len: int
  max_num_seqs: int
  chunked_prefill_workspace_size: int | None = None
  decode_threshold: int = 1
  implementation: Implementation = None
  interpret: bool = False

  @property
  def workspace_size(self) -> int:
    if self.chunked_prefill_workspace_size is not None:
      return self.chunked_prefill_workspace_size
    return determine_chunked_prefill_workspace_size(
        self.max_model_len, self.max_num_seqs, self.block_size)

  def build(self, query_start_loc, seq_lens, block_table, slot_mapping) -> AiterMLAMetadata:
    """Builds the step's metadata.

    Args:
      query_start_loc: host int ``[R + 1]`` new-token offsets per request.
      seq_lens: host int ``[R]`` context + new tokens per request.
      block_table: int32 ``[R, max_blocks]`` cache blocks of each request.
      slot_mapping: int32 ``[T]`` cache slot of each new token (``< 0``: padding).
    """
    qsl = np.asarray(query_start_loc, np.int64)
    seq_lens_np = np.asarray(seq_lens, np.int64)
    query_lens = qsl[1:] - qsl[:-1]
    num_reqs = len(query_lens)
    num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
        qsl, decode_threshold=self.decode_threshold, require_uniform=True)
    block_table = jnp.asarray(block_table, jnp.int32)
    kw = dict(implementation=self.implementation, interpret=self.interpret)

    decode = None
    if num_decodes:
      capacity = self.max_num_seqs * self.max_model_len
      dec_lens = jnp.asarray(seq_lens_np[:num_decodes], jnp.int32)
      indices, indptr = expand_page_indices(block_table[:num_decodes], dec_lens,
                                            kernel_block_size=self.block_size,
                                            capacity=capacity, **kw)
      decode = AiterMLADecodeMetadata(
          block_table=block_table[:num_decodes], seq_lens=dec_lens, paged_kv_indptr=indptr,
          paged_kv_indices=indices,
          paged_kv_last_page_len=jnp.ones((num_decodes,), jnp.int32),
          qo_indptr=jnp.asarray(qsl[:num_decodes + 1], jnp.int32),
          max_qo_len=int(query_lens[:num_decodes].max()))

    prefill = None
    num_prefills = num_reqs - num_decodes
    if num_prefills:
      context_lens = (seq_lens_np - query_lens)[num_decodes:]
      prefill = MLACommonPrefillMetadata(
          block_table=block_table[num_decodes:],
          query_start_loc=jnp.asarray(qsl[num_decodes:] - qsl[num_decodes], jnp.int32),
          chunked_context=self._build_chunked_context(block_table[num_decodes:], context_lens,
                                                      **kw),
          max_query_len=int(query_lens[num_decodes:].max()))

    return AiterMLAMetadata(
        query_start_loc=jnp.asarray(qsl, jnp.int32),
        slot_mapping=jnp.asarray(slot_mapping, jnp.int32), decode=decode, prefill=prefill,
        num_reqs=num_reqs, max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens_np.max()), num_actual_tokens=int(qsl[-1]),
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, num_prefills=num_prefills)

  def _build_chunked_context(self, block_table, context_lens, **kw):
    if context_lens.max() <= 0:
      return None
    # Equal workspace share per prefill with context, rounded down to whole blocks so
    # every chunk starts on a block boundary (the slot expansion works per block).
    share = self.workspace_size // int((context_lens > 0).sum())
    max_context_chunk = share // self.block_size * self.block_size
    if max_context_chunk <= 0:
      raise ValueError(
          f"chunked_prefill_workspace_size {self.workspace_size} leaves less than one block "
          f"({self.block_size} tokens) per prefill with context")
    num_chunks = cdiv(int(context_lens.max()), max_context_chunk)
    starts = np.repeat(np.arange(num_chunks)[:, None] * max_context_chunk, len(context_lens), 1)
    chunk_lens = np.clip(np.minimum(context_lens[None, :], starts + max_context_chunk) - starts,
                         0, None)
    cu = np.zeros((num_chunks, len(context_lens) + 1), np.int64)
    cu[:, 1:] = np.cumsum(chunk_lens, axis=1)
    slots = []
    for i in range(num_chunks):
      first_block = i * max_context_chunk // self.block_size
      chunk_slots, _ = expand_page_indices(
          block_table[:, first_block:], jnp.asarray(chunk_lens[i], jnp.int32),
          kernel_block_size=self.block_size, capacity=int(cu[i, -1]), **kw)
      slots.append(chunk_slots)
    return ChunkedContextMetadata(
        cu_seq_lens=jnp.asarray(cu, jnp.int32), starts=jnp.asarray(starts, jnp.int32),
        seq_lens=jnp.asarray(chunk_lens, jnp.int32), slots=tuple(slots),
        seq_tot=tuple(int(t) for t in cu[:, -1]),
        max_seq_lens=tuple(int(m) for m in chunk_lens.max(axis=1)))


# --- layer config and forwards ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AiterMLAConfig:
  """Static layer configuration (``AiterMLAImpl.__init__`` arguments)."""
  num_heads: int
  scale: float
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  kv_cache_dtype: str = "auto"

  def __post_init__(self):
    check_num_heads_validity(self.num_heads)
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ValueError(
          f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} for AiterMLA; got "
          f"{self.kv_cache_dtype!r}")


def _split_kv_b_proj(kv_b_proj, config: AiterMLAConfig):
  """``kv_b_proj[L, N * (P + V)]`` (``x @ kv_b_proj``) -> ``W_UK[L, N, P]``, ``W_UV[L, N, V]``."""
  w = kv_b_proj.reshape(config.kv_lora_rank, config.num_heads,
                        config.qk_nope_head_dim + config.v_head_dim)
  return w[..., :config.qk_nope_head_dim], w[..., config.qk_nope_head_dim:]


def _decompress(kv_c, k_pe, kv_b_proj, config: AiterMLAConfig):
  """Latents ``kv_c[S, L]``, ``k_pe[S, R]`` -> ``k[S, N, P + R]``, ``v[S, N, V]``."""
  kv_nope = jnp.dot(kv_c, kv_b_proj.astype(kv_c.dtype), preferred_element_type=jnp.float32)
  kv_nope = kv_nope.astype(kv_c.dtype).reshape(
      kv_c.shape[0], config.num_heads, config.qk_nope_head_dim + config.v_head_dim)
  k_nope, v = kv_nope[..., :config.qk_nope_head_dim], kv_nope[..., config.qk_nope_head_dim:]
  k_pe = jnp.broadcast_to(k_pe.astype(k_nope.dtype)[:, None, :],
                          (*k_nope.shape[:2], k_pe.shape[-1]))
  return jnp.concatenate([k_nope, k_pe], axis=-1), v


def _gather_context(kv_cache, slots, k_scale, dtype, kv_cache_dtype):
  """``gather_and_maybe_dequant_cache``: cache rows at flat ``slots`` (invalid -> 0)."""
  ok = (slots >= 0) & (slots < kv_cache.shape[0] * kv_cache.shape[1])
  rows = gather_dequantize(kv_cache, slots, kv_cache_dtype=kv_cache_dtype, scale=k_scale)
  return jnp.where(ok[:, None], rows, 0).astype(dtype)


def _compute_prefill_context(q, kv_cache, prefill: MLACommonPrefillMetadata, kv_b_proj, k_scale,
                             *, config, implementation, interpret):
  """Attention of prefill queries over their cached context, chunk by chunk, merged."""
  ctx = prefill.chunked_context
  output = output_lse = None
  for i in range(len(ctx.seq_tot)):
    workspace = _gather_context(kv_cache, ctx.slots[i], k_scale, q.dtype, config.kv_cache_dtype)
    k, v = _decompress(workspace[:, :config.kv_lora_rank], workspace[:, config.kv_lora_rank:],
                       kv_b_proj, config)
    attn_output, attn_lse = mla_prefill_token_major(
        q, k, v, prefill.query_start_loc, ctx.cu_seq_lens[i],
        max_seqlen_q=prefill.max_query_len, max_seqlen_k=ctx.max_seq_lens[i],
        sm_scale=config.scale, causal=False, implementation=implementation,
        interpret=interpret)
    if output is None:
      output, output_lse = attn_output, attn_lse
    else:
      output, output_lse = merge_attn_states(output, output_lse, attn_output, attn_lse)
  return output, output_lse


def forward_mha(q, kv_c_normed, k_pe, kv_cache, prefill: MLACommonPrefillMetadata, kv_b_proj, *,
                config: AiterMLAConfig, k_scale=None, implementation: Implementation = None,
                interpret: bool = False) -> jax.Array:
  """Prefill attention (vLLM ``_forward_prefill``), returns ``[Tp, N, v_head_dim]``.

  Args:
    q: ``[Tp, N, qk_nope + qk_rope]`` prefill queries (192 for DeepSeek).
    kv_c_normed: ``[Tp, kv_lora_rank]`` new latents; ``k_pe``: ``[Tp, qk_rope]`` (or
      ``[Tp, 1, qk_rope]``) new RoPE keys.
    kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope]`` latent cache.
    prefill: ``AiterMLAMetadata.prefill``.
    kv_b_proj: ``[kv_lora_rank, N * (qk_nope + v_head_dim)]`` (``x @ kv_b_proj``).
    k_scale: per-tensor dequant scale of an fp8 cache.
  """
  k_pe = k_pe.reshape(k_pe.shape[0], -1)
  k, v = _decompress(kv_c_normed, k_pe, kv_b_proj, config)
  kw = dict(implementation=implementation, interpret=interpret)
  qsl = prefill.query_start_loc
  new_tokens = dict(max_seqlen_q=prefill.max_query_len, max_seqlen_k=prefill.max_query_len,
                    sm_scale=config.scale, causal=True, **kw)
  if prefill.chunked_context is None:
    return mla_prefill(q, k, v, qsl, qsl, **new_tokens)
  suffix_output, suffix_lse = mla_prefill_token_major(q, k, v, qsl, qsl, **new_tokens)
  context_output, context_lse = _compute_prefill_context(q, kv_cache, prefill, kv_b_proj,
                                                         k_scale, config=config, **kw)
  output, _ = merge_attn_states(suffix_output, suffix_lse, context_output, context_lse)
  return output


def forward_mqa(q, kv_cache, decode: AiterMLADecodeMetadata, *, config: AiterMLAConfig,
                q_scale=None, kv_scale=None, implementation: Implementation = None,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Decode attention (``AiterMLAImpl.forward_mqa``) on absorbed queries.

  Args:
    q: ``[Td, N, kv_lora_rank + qk_rope]`` (576), or the tuple ``(ql_nope, q_pe)``.
    kv_cache: ``[num_blocks, block_size, 576]`` latent cache (bf16 or fp8).
    decode: ``AiterMLAMetadata.decode``.
    q_scale, kv_scale: per-tensor scales of fp8 ``q`` / cache, as ``mla_decode``.

  Returns:
    ``(out[Td, N, kv_lora_rank], lse f32[Td, N])``.
  """
  if isinstance(q, tuple):
    q = jnp.concatenate(q, axis=-1)
  padded_q = get_mla_padded_q(config.num_heads, q)
  # AITER sees the cache as pages of one token: flat slot = block * block_size + offset.
  kv_buffer = kv_cache.reshape(-1, 1, kv_cache.shape[-1])
  o, lse = mla_decode(padded_q, kv_buffer, decode.qo_indptr, decode.paged_kv_indptr,
                      decode.paged_kv_indices, decode.paged_kv_last_page_len,
                      max_seqlen_q=decode.max_qo_len, sm_scale=config.scale, causal=True,
                      q_scale=q_scale, kv_scale=kv_scale, implementation=implementation,
                      interpret=interpret)
  return get_mla_unpadded_o(config.num_heads, o), get_mla_unpadded_o(config.num_heads,
                                                                      lse[..., None])[..., 0]


@functools.partial(jax.jit, static_argnames=("config", "implementation", "interpret"))
def aiter_mla_forward(q, k_c_normed, k_pe, kv_cache, attn_metadata: AiterMLAMetadata, kv_b_proj, *,
                      config: AiterMLAConfig, k_scale=None, q_scale=None,
                      implementation: Implementation = None,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """One MLA attention layer (vLLM ``MLACommonImpl.forward`` with the AITER backend).

  Args:
    q: ``[T, N, qk_nope + qk_rope]`` queries, decode tokens first.
    k_c_normed: ``[T, kv_lora_rank]`` new latents; ``k_pe``: ``[T, qk_rope]`` (or
      ``[T, 1, qk_rope]``) new RoPE keys.
    kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope]`` (bf16 for
      ``"auto"``, float8_e4m3fn for ``"fp8"``).
    attn_metadata: from ``AiterMLAMetadataBuilder.build``.
    kv_b_proj: ``[kv_lora_rank, N * (qk_nope + v_head_dim)]`` (``x @ kv_b_proj``).
    config: static layer configuration.
    k_scale: per-tensor cache scale (fp8 cache), ``q_scale``: per-tensor scale for
      quantizing decode queries to fp8 (fp8 cache; 1.0 when ``None``).

  Returns:
    ``(output[T, N * v_head_dim], kv_cache)``: rows past ``num_actual_tokens`` are 0;
    the cache holds the new tokens.
  """
  md = attn_metadata
  num_tokens = q.shape[0]
  k_pe = k_pe.reshape(k_pe.shape[0], -1)
  fp8 = config.kv_cache_dtype == "fp8"
  kv_cache = concat_and_cache_mla(k_c_normed, k_pe, kv_cache, md.slot_mapping,
                                  kv_cache_dtype=config.kv_cache_dtype, scale=k_scale)
  kw = dict(implementation=implementation, interpret=interpret)
  output = jnp.zeros((num_tokens, config.num_heads, config.v_head_dim), q.dtype)
  nd, na = md.num_decode_tokens, md.num_actual_tokens

  if md.prefill is not None:
    out_p = forward_mha(q[nd:na], k_c_normed[nd:na], k_pe[nd:na], kv_cache, md.prefill,
                        kv_b_proj, config=config, k_scale=k_scale, **kw)
    output = output.at[nd:na].set(out_p.astype(q.dtype))

  if md.decode is not None:
    w_uk, w_uv = _split_kv_b_proj(kv_b_proj, config)
    q_nope, q_pe = q[:nd, :, :config.qk_nope_head_dim], q[:nd, :, config.qk_nope_head_dim:]
    ql_nope = jnp.einsum("bnp,lnp->bnl", q_nope, w_uk.astype(q.dtype),
                         preferred_element_type=jnp.float32).astype(q.dtype)
    decode_q = jnp.concatenate([ql_nope, q_pe], axis=-1)
    if fp8:
      q_scale = 1.0 if q_scale is None else q_scale
      decode_q = cast_fp8(decode_q, q_scale)
    attn_out, _ = forward_mqa(decode_q, kv_cache, md.decode, config=config,
                              q_scale=q_scale if fp8 else None, kv_scale=k_scale if fp8 else None,
                              **kw)
    out_d = jnp.einsum("bnl,lnv->bnv", attn_out.astype(q.dtype), w_uv.astype(q.dtype),
                       preferred_element_type=jnp.float32)
    output = output.at[:nd].set(out_d.astype(q.dtype))

  return output.reshape(num_tokens, config.num_heads * config.v_head_dim), kv_cache


class AiterMLA:
  """Dense MLA layer (vLLM's ``ROCM_AITER_MLA`` backend), functional, for any GPU.

  Per step, a :attr:`MetadataBuilder` (configured once) builds an
  :class:`AiterMLAMetadata` from host-side request offsets, sequence lengths, block
  table and slot mapping; per layer, :attr:`forward` writes the new latents into the
  cache, runs prefill (decompressed MHA over new tokens + chunked cached context)
  and decode (absorbed MQA over the latent cache, heads padded to 16) and returns
  ``(output, kv_cache)``. Tokens are ordered decodes first, as vLLM orders them.
  Shapes (``T`` tokens, ``N`` heads, DeepSeek dims): ``q [T, N, 128 + 64]``,
  ``k_c_normed [T, 512]``, ``k_pe [T, 64]``, ``kv_cache [blocks, block_size, 576]``
  (bf16 ``"auto"`` or float8_e4m3fn ``"fp8"`` with ``k_scale``),
  ``kv_b_proj [512, N * (128 + 128)]``; output ``[T, N * 128]``. ``N`` must divide
  16 or be a multiple of it.

  Example (request 0 decodes 1 token after 9 cached ones, request 1 prefills 3
  tokens; the reference runs anywhere, drop ``implementation`` for the GPU kernels):

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from jax_mla.backends import AiterMLA

    >>> N, block_size = 16, 16
    >>> config = AiterMLA.Config(num_heads=N, scale=192 ** -0.5)
    >>> builder = AiterMLA.MetadataBuilder(block_size=block_size, max_model_len=64,
    ...                                    max_num_seqs=2, implementation="xla")
    >>> metadata = builder.build(
    ...     query_start_loc=np.array([0, 1, 4]), seq_lens=np.array([10, 3]),
    ...     block_table=np.array([[0, 1], [2, 3]], np.int32),
    ...     slot_mapping=np.array([9, 32, 33, 34], np.int32))  # block * 16 + offset
    >>> x = lambda seed, shape: jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    >>> out, kv_cache = AiterMLA.forward(
    ...     x(0, (4, N, 192)), x(1, (4, 512)), x(2, (4, 64)),  # q, k_c_normed, k_pe
    ...     jnp.zeros((4, block_size, 576), jnp.bfloat16),    # kv_cache
    ...     metadata, x(3, (512, N * 256)) * 0.05,             # kv_b_proj
    ...     config=config, implementation="xla")
    >>> assert out.shape == (4, N * 128) and kv_cache.shape == (4, block_size, 576)
  """
  Config = AiterMLAConfig
  Metadata = AiterMLAMetadata
  MetadataBuilder = AiterMLAMetadataBuilder
  forward = staticmethod(aiter_mla_forward)


# Heads split over devices with kv_b_proj's columns (N * (qk_nope + v_head_dim), heads
# outermost); each device's count rounded up to one AITER runs.
_HEADS = dict(num_heads=config_heads, local_heads=padded_num_heads, set_heads=set_config_heads)
aiter_mla_forward.sharding = OpSharding(
    heads=dict(q=1, kv_b_proj=1), head_outs=(1, None),
    shared=("kv_b_proj", "k_scale", "q_scale"), **_HEADS)
forward_mqa.sharding = OpSharding(heads=dict(q=1), head_outs=(1, 1),
                                  shared=("q_scale", "kv_scale"), **_HEADS)
forward_mha.sharding = OpSharding(heads=dict(q=1, kv_b_proj=1), head_outs=1,
                                  shared=("kv_b_proj", "k_scale"), **_HEADS)
