"""DeepSeek V4 sparse attention backend (vLLM ``DeepseekV4...MLASparse``), functional JAX.

A DeepSeek V4 attention layer keeps two caches in the ``fp8_model1`` format
(512-wide latent: 448 NoPE fp8 + 64 RoPE bf16, UE8M0 scales); DeepSeek V4.1 keeps
them in ``fp8_v41`` (528 bytes a token) or ``fp4_v41`` (288 bytes), or an ``fp8_v41``
window cache with an ``fp4_v41`` compressed cache
(``DeepseekV4Config.compressed_kv_cache_dtype``):

* a sliding-window (SWA) cache of raw tokens, paged by absolute position;
* for ``compress_ratio`` 4 or 128, a compressed cache of one entry per
  ``compress_ratio`` tokens (written by the model's compressor), paged with
  ``block_size // compress_ratio`` entries per block.

The latent is both K and V (``d_v = 512``), the softmax scale is
``head_dim ** -0.5`` and every head has an attention sink. A token at position
``pos`` attends to the last ``min(pos + 1, window_size)`` raw tokens and to
``min((pos + 1) // compress_ratio, topk)`` compressed entries, in one softmax with
the sink: for ratio 4 the entries are the indexer's top-k, for ratio 128 all of
them, for ratio 1 none.

Decode tokens go through :func:`jax_mla.sparse_mla.sparse_mla_decode` with the SWA
cache as the main set and the compressed cache as the extra set. Prefill requests
go in chunks of ``prefill_chunk_size``: each chunk dequantizes its compressed
entries and SWA tokens into a bf16 workspace and runs
:func:`jax_mla.sparse_mla.sparse_mla_prefill` over it with per-token lengths.

:class:`DeepseekV4Sparse` gathers the entry points and shows a whole step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import _common as c
from jax_mla._pytree import pytree_dataclass, static_field
from jax_mla.backends import deepseek_v4_indices as idx
from jax_mla.cache import concat_and_cache_mla
from jax_mla.indexing import req_id_per_token
from jax_mla.sharding import OpSharding, config_heads, set_config_heads
from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill
from jax_mla.sparse_mla.api import EXTRA_FORMAT_PAIRS

COMPRESS_RATIOS = (1, 4, 128)
KV_CACHE_DTYPES = ("fp8_model1", "fp8_v41", "fp4_v41")


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
  """Static configuration of one DeepSeek V4 attention layer (hashable: a jit static arg).

  Attributes:
    num_heads: query heads of this rank.
    window_size: sliding-window length in tokens.
    compress_ratio: 1 (window only), 4 (indexer top-k) or 128 (all compressed entries).
    max_model_len: longest sequence; sizes the compressed part of the prefill
      workspace (``cdiv(max_model_len, compress_ratio)`` rows per request) and the
      ratio-128 top-k width.
    index_topk: width of the ratio-4 indexer output.
    block_size: tokens per block of the compressed layer's block table; the
      compressed cache holds ``block_size // compress_ratio`` entries per block.
    swa_block_size: tokens per SWA cache block.
    kv_cache_dtype: format of the SWA cache, and of the compressed cache unless
      ``compressed_kv_cache_dtype`` says otherwise: ``"fp8_model1"`` (V4),
      ``"fp8_v41"`` or ``"fp4_v41"`` (V4.1).
    compressed_kv_cache_dtype: format of the compressed cache; ``None`` means
      ``kv_cache_dtype``. The one other choice: ``"fp4_v41"`` with an ``"fp8_v41"``
      SWA cache (FlashMLA's V4.1 pair).
    prefill_chunk_size: prefill requests per workspace chunk.
    scale: softmax scale; ``None`` means ``head_dim ** -0.5``.
  """
  num_heads: int
  window_size: int
  compress_ratio: int = 1
  max_model_len: int = 65536
  index_topk: int = 512
  block_size: int = 256
  swa_block_size: int = 64
  head_dim: int = 512
  rope_head_dim: int = 64
  kv_cache_dtype: str = "fp8_model1"
  prefill_chunk_size: int = 4
  scale: float | None = None
  compressed_kv_cache_dtype: str | None = None

  def __post_init__(self):
    c.check_one_of("compress_ratio", self.compress_ratio, COMPRESS_RATIOS)
    c.check_one_of("head_dim", self.head_dim, (512,))
    c.check_one_of("rope_head_dim", self.rope_head_dim, (64,))
    c.check_one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
    pair = (self.kv_cache_dtype, self.compressed_cache_dtype)
    if pair[1] != pair[0] and pair not in EXTRA_FORMAT_PAIRS:
      allowed = ", ".join(f"{b!r} with kv_cache_dtype={a!r}" for a, b in EXTRA_FORMAT_PAIRS)
      raise ValueError(f"compressed_kv_cache_dtype must be None (= kv_cache_dtype) or {allowed}; "
                       f"got {self.compressed_kv_cache_dtype!r} with kv_cache_dtype="
                       f"{self.kv_cache_dtype!r}")
    for name in ("num_heads", "window_size", "max_model_len", "index_topk", "block_size",
                 "swa_block_size", "prefill_chunk_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
    if self.block_size % self.compress_ratio:
      raise ValueError(f"block_size ({self.block_size}) must be a multiple of compress_ratio "
                       f"({self.compress_ratio})")

  @property
  def compressed_cache_dtype(self) -> str:
    """Format of the compressed cache."""
    return self.compressed_kv_cache_dtype or self.kv_cache_dtype

  @property
  def nope_head_dim(self) -> int:
    return self.head_dim - self.rope_head_dim

  @property
  def sm_scale(self) -> float:
    return self.head_dim ** -0.5 if self.scale is None else float(self.scale)

  @property
  def compressed_block_size(self) -> int:
    """Entries per block of the compressed cache."""
    return self.block_size // self.compress_ratio

  @property
  def max_compressed(self) -> int:
    """``N``: compressed entries of the longest sequence (0 for ratio 1)."""
    return 0 if self.compress_ratio == 1 else c.cdiv(self.max_model_len, self.compress_ratio)

  @property
  def topk(self) -> int:
    """Compressed entries a token may attend to: 0, ``index_topk`` or ``max_compressed``."""
    return {1: 0, 4: self.index_topk, 128: self.max_compressed}[self.compress_ratio]


@pytree_dataclass
class DeepseekV4Metadata:
  """Per-step metadata of the DeepSeek V4 path (a pytree; counts are static fields).

  Tokens are ordered decodes first. ``T = num_decode_tokens + num_prefill_tokens``,
  ``Td = num_decode_tokens``, ``P = num_prefills``.

  Attributes:
    query_start_loc: int32 ``[R + 1]``; seq_lens: int32 ``[R]`` (including new tokens).
    positions, token_to_req_indices: int32 ``[T]``; is_valid_token: bool ``[T]``.
    slot_mapping: int32 ``[T]`` SWA cache slot of each new token (``-1`` = padding).
    swa_block_table: int32 ``[R, Bs]``; block_table: int32 ``[R, Bc]`` of the
      compressed layer (None for ratio 1).
    decode_swa_indices: int32 ``[Td, window_size]`` SWA slots; decode_swa_lens ``[Td]``.
    prefill_seq_lens, prefill_gather_lens: int32 ``[P]``.
    c128a_*: ratio-128 top-k lists (None otherwise): global decode slots
      ``[Td, topk]`` with lengths ``[Td]``, and request-local prefill ids ``[T - Td, topk]``.
    prefill_chunk_capacity: static bound on the query tokens of one prefill chunk.
  """
  query_start_loc: jax.Array
  seq_lens: jax.Array
  positions: jax.Array
  token_to_req_indices: jax.Array
  is_valid_token: jax.Array
  slot_mapping: jax.Array
  swa_block_table: jax.Array
  block_table: jax.Array | None
  decode_swa_indices: jax.Array
  decode_swa_lens: jax.Array
  prefill_seq_lens: jax.Array
  prefill_gather_lens: jax.Array
  c128a_global_decode_topk_indices: jax.Array | None
  c128a_decode_topk_lens: jax.Array | None
  c128a_prefill_topk_indices: jax.Array | None
  num_decodes: int = static_field()
  num_prefills: int = static_field()
  num_decode_tokens: int = static_field()
  num_prefill_tokens: int = static_field()
  prefill_chunk_capacity: int = static_field()


def _chunk_capacity(query_start_loc, config, num_decodes, num_prefills, num_prefill_tokens):
  """Static query-token bound of one prefill chunk: exact (power-of-two bucket) when
  ``query_start_loc`` is concrete, else every prefill token."""
  if num_prefills == 0:
    return 0
  try:
    qsl = np.asarray(query_start_loc)[num_decodes:]
  except jax.errors.TracerArrayConversionError:
    return num_prefill_tokens
  starts = qsl[0:num_prefills:config.prefill_chunk_size]
  ends = qsl[np.minimum(np.arange(len(starts)) * config.prefill_chunk_size
                        + config.prefill_chunk_size, num_prefills)]
  return max(1, min(num_prefill_tokens, c.next_pow2(int(np.max(ends - starts)))))


def build_deepseek_v4_metadata(
    config: DeepseekV4Config, query_start_loc: jax.Array, seq_lens: jax.Array,
    slot_mapping: jax.Array, swa_block_table: jax.Array, block_table: jax.Array | None = None,
    *, num_decodes: int, num_decode_tokens: int) -> DeepseekV4Metadata:
  """Builds :class:`DeepseekV4Metadata` (vLLM's SWA + FlashMLASparse V4 builders in one).

  Args:
    config: the layer configuration.
    query_start_loc: int32 ``[R + 1]`` (decodes first). When concrete, the prefill
      chunk capacity is sized exactly; under tracing it is every prefill token.
    seq_lens: int32 ``[R]``, context length of each request including new tokens.
    slot_mapping: int32 ``[T]`` SWA cache slot of every token (``-1`` = padding);
      ``T`` is the padded token count.
    swa_block_table: int32 ``[R, Bs]``.
    block_table: int32 ``[R, Bc]`` of the compressed layer (required for ratio 4/128).
    num_decodes, num_decode_tokens: static, e.g. from
      :func:`~jax_mla.backends.split_decodes_and_prefills`.

  :class:`DeepseekV4Sparse` shows a whole step.
  """
  for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                  ("slot_mapping", slot_mapping), ("swa_block_table", swa_block_table)):
    c.check_int32(name, x)
  c.check_rank("seq_lens", seq_lens, 1)
  c.check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,))
  c.check_rank("slot_mapping", slot_mapping, 1)
  c.check_shape("swa_block_table", swa_block_table, (seq_lens.shape[0], None))
  if config.compress_ratio > 1:
    if block_table is None:
      raise ValueError(f"block_table is required for compress_ratio={config.compress_ratio}")
    c.check_int32("block_table", block_table)
    c.check_shape("block_table", block_table, (seq_lens.shape[0], None))
  num_reqs, num_tokens = seq_lens.shape[0], slot_mapping.shape[0]
  if not 0 <= num_decodes <= num_reqs or not 0 <= num_decode_tokens <= num_tokens:
    raise ValueError(f"need 0 <= num_decodes <= {num_reqs} and 0 <= num_decode_tokens <= "
                     f"{num_tokens}; got {num_decodes}, {num_decode_tokens}")
  num_prefills, num_prefill_tokens = num_reqs - num_decodes, num_tokens - num_decode_tokens
  arrays = _build_metadata_arrays(
      jnp.asarray(query_start_loc), seq_lens, slot_mapping, swa_block_table,
      block_table if config.compress_ratio > 1 else None, config=config,
      num_decodes=num_decodes, num_decode_tokens=num_decode_tokens)
  return DeepseekV4Metadata(
      **arrays, num_decodes=num_decodes, num_prefills=num_prefills,
      num_decode_tokens=num_decode_tokens, num_prefill_tokens=num_prefill_tokens,
      prefill_chunk_capacity=_chunk_capacity(query_start_loc, config, num_decodes,
                                             num_prefills, num_prefill_tokens))


@functools.partial(jax.jit, static_argnames=("config", "num_decodes", "num_decode_tokens"))
def _build_metadata_arrays(query_start_loc, seq_lens, slot_mapping, swa_block_table, block_table,
                           *, config, num_decodes, num_decode_tokens):
  num_tokens, td = slot_mapping.shape[0], num_decode_tokens
  token_to_req = req_id_per_token(query_start_loc, num_tokens=num_tokens)
  token = jnp.arange(num_tokens, dtype=jnp.int32)
  positions = idx.token_positions(query_start_loc, seq_lens, token_to_req, token)
  is_valid = slot_mapping >= 0
  swa_indices, swa_lens = idx.compute_swa_indices_and_lens(
      query_start_loc, seq_lens, token_to_req[:td], is_valid[:td], swa_block_table,
      window_size=config.window_size, block_size=config.swa_block_size)
  prefill_seq_lens = seq_lens[num_decodes:]
  gather_lens = idx.compute_prefill_gather_lens(
      query_start_loc[num_decodes:], prefill_seq_lens, window_size=config.window_size)
  c128a = (None, None, None)
  if config.compress_ratio == 128:
    c128a = idx.build_c128a_topk_metadata(
        positions, token_to_req, block_table, slot_mapping, compress_ratio=128,
        topk=config.topk, num_decode_tokens=td, block_size=config.compressed_block_size)
  return dict(
      query_start_loc=query_start_loc, seq_lens=seq_lens, positions=positions,
      token_to_req_indices=token_to_req, is_valid_token=is_valid, slot_mapping=slot_mapping,
      swa_block_table=swa_block_table, block_table=block_table,
      decode_swa_indices=swa_indices, decode_swa_lens=swa_lens,
      prefill_seq_lens=prefill_seq_lens, prefill_gather_lens=gather_lens,
      c128a_global_decode_topk_indices=c128a[0], c128a_decode_topk_lens=c128a[1],
      c128a_prefill_topk_indices=c128a[2])


def _check_layer_args(config, q, swa_cache, compressed_cache, attn_sink, topk_indices,
                      num_tokens):
  c.check_rank("q", q, 3)
  c.check_shape("q", q, (num_tokens, config.num_heads, config.head_dim))
  c.check_dtype("q", q, jnp.bfloat16)
  c.check_rank("swa_cache", swa_cache, 3)
  if swa_cache.shape[1] != config.swa_block_size:
    raise ValueError(f"swa_cache block size (shape[1]) must be config.swa_block_size="
                     f"{config.swa_block_size}; got shape {tuple(swa_cache.shape)}")
  if attn_sink is not None:
    c.check_shape("attn_sink", attn_sink, (config.num_heads,))
    c.check_dtype("attn_sink", attn_sink, jnp.float32)
  if config.compress_ratio > 1:
    if compressed_cache is None:
      raise ValueError(f"compressed_cache is required for compress_ratio={config.compress_ratio}")
    c.check_rank("compressed_cache", compressed_cache, 3)
    if compressed_cache.shape[1] != config.compressed_block_size:
      raise ValueError(
          f"compressed_cache block size (shape[1]) must be block_size // compress_ratio = "
          f"{config.compressed_block_size}; got shape {tuple(compressed_cache.shape)}")
  if config.compress_ratio == 4:
    if topk_indices is None:
      raise ValueError("topk_indices (the indexer output) is required for compress_ratio=4")
    c.check_int32("topk_indices", topk_indices)
    c.check_shape("topk_indices", topk_indices, (num_tokens, config.index_topk))


@functools.partial(jax.jit, static_argnames=("config", "implementation", "interpret"))
def deepseek_v4_sparse_decode(
    q: jax.Array, swa_cache: jax.Array, compressed_cache: jax.Array | None,
    metadata: DeepseekV4Metadata, attn_sink: jax.Array | None,
    topk_indices: jax.Array | None = None, *, config: DeepseekV4Config,
    implementation: c.Implementation = None, interpret: bool = False) -> jax.Array:
  """Attention of the decode tokens (vLLM ``_forward_decode``).

  Each decode token is one row of :func:`sparse_mla_decode`: its window slots in
  the SWA cache are the main set, its compressed slots (ratio 4: the indexer's
  top-k through the block table; ratio 128: all entries so far) the extra set.

  Args:
    q: bf16 ``[Td, num_heads, 512]``, the decode tokens' queries.
    swa_cache, compressed_cache: caches in ``config.kv_cache_dtype`` /
      ``config.compressed_cache_dtype`` (``compressed_cache`` None for ratio 1).
    metadata: from :func:`build_deepseek_v4_metadata`.
    attn_sink: float32 ``[num_heads]`` or None.
    topk_indices: int32 ``[Td, index_topk]`` request-local compressed ids (ratio 4).

  Returns:
    bf16 ``[Td, num_heads, 512]``; a token with nothing to attend to (padding) gets 0.
  """
  td = metadata.num_decode_tokens
  _check_layer_args(config, q, swa_cache, compressed_cache, attn_sink, topk_indices, td)
  if td == 0:
    return jnp.zeros(q.shape, jnp.bfloat16)
  extra = {}
  if config.compress_ratio == 4:
    extra_indices, extra_lens = idx.compute_global_topk_indices_and_lens(
        topk_indices, metadata.token_to_req_indices[:td], metadata.block_table,
        metadata.is_valid_token[:td], block_size=config.compressed_block_size)
  elif config.compress_ratio == 128:
    extra_indices = metadata.c128a_global_decode_topk_indices
    extra_lens = metadata.c128a_decode_topk_lens
  if config.compress_ratio > 1:
    extra = dict(extra_kv_cache=compressed_cache, extra_indices=extra_indices[:, None, :],
                 extra_topk_length=extra_lens,
                 extra_kv_cache_dtype=config.compressed_cache_dtype)
  out, _ = sparse_mla_decode(
      q[:, None], swa_cache, metadata.decode_swa_indices[:, None, :],
      kv_cache_dtype=config.kv_cache_dtype, sm_scale=config.sm_scale, d_v=config.head_dim,
      attn_sink=attn_sink, topk_length=metadata.decode_swa_lens, implementation=implementation,
      interpret=interpret, **extra)
  return out[:, 0]


@functools.partial(jax.jit, static_argnames=("config", "implementation", "interpret"))
def deepseek_v4_sparse_prefill(
    q: jax.Array, swa_cache: jax.Array, compressed_cache: jax.Array | None,
    metadata: DeepseekV4Metadata, attn_sink: jax.Array | None,
    topk_indices: jax.Array | None = None, *, config: DeepseekV4Config,
    implementation: c.Implementation = None, interpret: bool = False) -> jax.Array:
  """Attention of the prefill tokens (vLLM ``_forward_prefill``), in request chunks.

  For each chunk of ``config.prefill_chunk_size`` requests, a bf16 workspace of
  ``M = N + window_size - 1 + prefill_chunk_capacity`` rows per request receives the
  request's compressed entries (rows ``[0, seq_len // ratio)``) and its last
  ``gather_len`` SWA tokens (from row ``N``); :func:`combine_topk_swa_indices` lists
  each token's rows and :func:`sparse_mla_prefill` attends over them with the sink.

  Args:
    q: bf16 ``[Tp, num_heads, 512]``, the prefill tokens' queries.
    topk_indices: int32 ``[Tp, index_topk]`` request-local compressed ids (ratio 4).
    Others as :func:`deepseek_v4_sparse_decode`.

  Returns:
    bf16 ``[Tp, num_heads, 512]``; padding tokens past the last request get 0.
  """
  tp, cap = metadata.num_prefill_tokens, metadata.prefill_chunk_capacity
  _check_layer_args(config, q, swa_cache, compressed_cache, attn_sink, topk_indices, tp)
  if tp == 0 or metadata.num_prefills == 0:
    return jnp.zeros(q.shape, jnp.bfloat16)
  ratio, n, topk, w = config.compress_ratio, config.max_compressed, config.topk, config.window_size
  m = n + w - 1 + cap
  if ratio == 128:
    topk_indices = metadata.c128a_prefill_topk_indices
  elif ratio == 1:
    topk_indices = jnp.zeros((tp, 0), jnp.int32)
  nd = metadata.num_decodes
  # prefill-relative token numbering
  qsl = metadata.query_start_loc[nd:] - metadata.query_start_loc[nd]
  swa_bt = metadata.swa_block_table[nd:]
  out = None
  for chunk_start in range(0, metadata.num_prefills, config.prefill_chunk_size):
    chunk_end = min(chunk_start + config.prefill_chunk_size, metadata.num_prefills)
    cs = chunk_end - chunk_start
    seq_lens = metadata.prefill_seq_lens[chunk_start:chunk_end]
    gather_lens = metadata.prefill_gather_lens[chunk_start:chunk_end]
    kv = jnp.zeros((cs, m, config.head_dim), jnp.bfloat16)
    if ratio > 1:
      kv = idx.dequantize_and_gather_k_cache(
          kv, compressed_cache, seq_lens // ratio, None,
          metadata.block_table[nd + chunk_start:nd + chunk_end], offset=0, capacity=n,
          kv_cache_dtype=config.compressed_cache_dtype)
    kv = idx.dequantize_and_gather_k_cache(
        kv, swa_cache, seq_lens, gather_lens, swa_bt[chunk_start:chunk_end], offset=n,
        capacity=m - n, kv_cache_dtype=config.kv_cache_dtype)
    # The chunk's queries are a dynamic row range of at most `cap` rows: take a
    # static `cap`-row window that contains it (clamped inside the array).
    first, last = qsl[chunk_start], qsl[chunk_end]
    start = 0 if cap == tp else jnp.clip(first, 0, tp - cap)
    q_c = jax.lax.dynamic_slice_in_dim(q, start, cap)
    topk_c = jax.lax.dynamic_slice_in_dim(topk_indices, start, cap)
    indices, lens = idx.combine_topk_swa_indices(
        topk_c, qsl[chunk_start:chunk_end + 1] - start, seq_lens, gather_lens, window_size=w,
        compress_ratio=ratio, topk=topk, M=m, N=n)
    out_c, _, _ = sparse_mla_prefill(
        q_c, kv.reshape(cs * m, config.head_dim), indices, sm_scale=config.sm_scale,
        d_v=config.head_dim, attn_sink=attn_sink, topk_length=lens,
        implementation=implementation, interpret=interpret)
    # Rows outside the chunk got no key, hence out_c = 0 there: a chunk that
    # spans the whole array is the output as it stands (no extra pass).
    if out is None and cap == tp:
      out = out_c
      continue
    out = jnp.zeros(q.shape, jnp.bfloat16) if out is None else out
    row = start + jnp.arange(cap)
    mine = ((row >= first) & (row < last))[:, None, None]
    old = jax.lax.dynamic_slice_in_dim(out, start, cap)
    out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, out_c, old), start, 0)
  return out


@functools.partial(jax.jit, static_argnames=("config", "implementation", "interpret"),
                   donate_argnames=("swa_cache",))
def deepseek_v4_write_swa_cache(kv: jax.Array, swa_cache: jax.Array, metadata: DeepseekV4Metadata,
                                *, config: DeepseekV4Config,
                                implementation: c.Implementation = None,
                                interpret: bool = False) -> jax.Array:
  """Writes the new tokens' latents ``kv`` (bf16 ``[T, 512]``: NoPE then RoPE) into the
  SWA cache at ``metadata.slot_mapping`` (``-1`` skipped); returns the cache (donated)."""
  c.check_shape("kv", kv, (metadata.slot_mapping.shape[0], config.head_dim))
  return concat_and_cache_mla(kv[:, :config.nope_head_dim], kv[:, config.nope_head_dim:],
                              swa_cache, metadata.slot_mapping,
                              kv_cache_dtype=config.kv_cache_dtype,
                              implementation=c.without_mosaic(implementation),
                              interpret=interpret)


@functools.partial(jax.jit, static_argnames=("config", "implementation", "interpret"),
                   donate_argnames=("swa_cache",))
def deepseek_v4_sparse_forward(
    q: jax.Array, kv: jax.Array | None, swa_cache: jax.Array,
    compressed_cache: jax.Array | None, metadata: DeepseekV4Metadata,
    attn_sink: jax.Array | None, topk_indices: jax.Array | None = None, *,
    config: DeepseekV4Config, implementation: c.Implementation = None,
    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """One DeepSeek V4 attention layer step: SWA cache write, then decode and prefill.

  Args:
    q: bf16 ``[T, num_heads, 512]`` (decode tokens first; RoPE already applied).
    kv: bf16 ``[T, 512]`` new latents written to the SWA cache first, or None when
      the cache already holds them.
    swa_cache: uint8 ``[num_blocks, swa_block_size, bytes]`` cache in
      ``config.kv_cache_dtype`` (donated).
    compressed_cache: cache of the compressed entries (ratio 4/128) in
      ``config.compressed_cache_dtype``, already holding every entry up to
      ``seq_len // compress_ratio``.
    metadata: from :func:`build_deepseek_v4_metadata`.
    attn_sink: float32 ``[num_heads]`` or None.
    topk_indices: int32 ``[T, index_topk]`` request-local compressed ids from the
      indexer (ratio 4 only).
    config: static layer configuration.
    implementation, interpret: forwarded to the sparse-MLA ops (the cache write runs
      Triton for ``"mosaic"``).

  Returns:
    ``(out bf16[T, num_heads, 512], swa_cache)``.
  """
  kw = dict(config=config, implementation=implementation, interpret=interpret)
  if kv is not None:
    swa_cache = deepseek_v4_write_swa_cache(kv, swa_cache, metadata, **kw)
  td = metadata.num_decode_tokens
  tk_d = tk_p = None
  if topk_indices is not None:
    tk_d, tk_p = topk_indices[:td], topk_indices[td:]
  out_d = deepseek_v4_sparse_decode(q[:td], swa_cache, compressed_cache, metadata, attn_sink,
                                    tk_d, **kw)
  out_p = deepseek_v4_sparse_prefill(q[td:], swa_cache, compressed_cache, metadata, attn_sink,
                                     tk_p, **kw)
  return jnp.concatenate([out_d, out_p], axis=0), swa_cache


class DeepseekV4Sparse:
  """DeepSeek V4 sparse attention layer (vLLM's ``ROCM_AITER_MLA_SPARSE_DSV4``), functional.

  Per step, :attr:`build_metadata` (with the decode counts of
  :func:`~jax_mla.backends.split_decodes_and_prefills`) builds a
  :class:`DeepseekV4Metadata`; per layer, :attr:`forward` writes the new latents
  into the sliding-window cache and attends each token to its window and its
  compressed entries with the head's sink, returning ``(out, swa_cache)``. Tokens
  are ordered decodes first. Shapes (``T`` tokens, ``H`` heads): ``q [T, H, 512]``
  and ``kv [T, 512]`` bf16 (448 NoPE + 64 RoPE), ``swa_cache`` /
  ``compressed_cache`` uint8 caches (``kv_cache_shape(blocks, block_size, 512,
  config.kv_cache_dtype / config.compressed_cache_dtype)``, ``block_size`` =
  ``config.swa_block_size`` / ``config.compressed_block_size``; ``fp8_model1`` by
  default, the V4.1 formats by ``kv_cache_dtype`` / ``compressed_kv_cache_dtype``),
  ``attn_sink`` float32 ``[H]``,
  ``topk_indices`` int32 ``[T, config.index_topk]`` request-local compressed ids
  (ratio 4 only); ``out`` bf16 ``[T, H, 512]``.

  Example (ratio 4; request 0 decodes its 13th token, request 1 prefills 3 tokens;
  the reference runs anywhere, drop ``implementation`` for the GPU kernels):

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from jax_mla.backends import DeepseekV4Sparse, split_decodes_and_prefills
    >>> from jax_mla.cache import kv_cache_shape

    >>> H = 4
    >>> config = DeepseekV4Sparse.Config(num_heads=H, window_size=8, compress_ratio=4,
    ...                                  index_topk=4, block_size=16, swa_block_size=8,
    ...                                  max_model_len=64)
    >>> query_start_loc = np.array([0, 1, 4], np.int32)
    >>> num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(query_start_loc)
    >>> metadata = DeepseekV4Sparse.build_metadata(
    ...     config, jnp.asarray(query_start_loc),
    ...     jnp.array([13, 3], jnp.int32),           # seq_lens, new tokens included
    ...     jnp.array([12, 16, 17, 18], jnp.int32),  # slot_mapping: SWA block * 8 + offset
    ...     jnp.array([[0, 1], [2, 3]], jnp.int32),  # swa_block_table
    ...     jnp.array([[0], [1]], jnp.int32),        # block_table of the compressed cache
    ...     num_decodes=num_decodes, num_decode_tokens=num_decode_tokens)
    >>> x = lambda seed, shape: jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    >>> out, swa_cache = DeepseekV4Sparse.forward(
    ...     x(0, (4, H, 512)), x(1, (4, 512)),                               # q, kv
    ...     jnp.zeros(kv_cache_shape(4, 8, 512, "fp8_model1"), jnp.uint8),  # swa_cache
    ...     jnp.zeros(kv_cache_shape(2, 4, 512, "fp8_model1"), jnp.uint8),  # compressed_cache
    ...     metadata, jnp.zeros((H,), jnp.float32),                           # attn_sink
    ...     jnp.array([[0, 1, 2, -1]] + [[-1] * 4] * 3, jnp.int32),          # topk_indices
    ...     config=config, implementation="xla")
    >>> assert out.shape == (4, H, 512)
  """
  Config = DeepseekV4Config
  Metadata = DeepseekV4Metadata
  build_metadata = staticmethod(build_deepseek_v4_metadata)
  forward = staticmethod(deepseek_v4_sparse_forward)


# Heads split over devices with their sinks; caches and metadata replicated.
for _op, _outs in ((deepseek_v4_sparse_forward, (1, None)), (deepseek_v4_sparse_decode, 1),
                   (deepseek_v4_sparse_prefill, 1)):
  _op.sharding = OpSharding(heads=dict(q=1, attn_sink=0), head_outs=_outs,
                            num_heads=config_heads, set_heads=set_config_heads,
                            shared=("attn_sink",))


__all__ = [
    "DeepseekV4Config", "DeepseekV4Metadata", "DeepseekV4Sparse", "build_deepseek_v4_metadata",
    "deepseek_v4_sparse_decode", "deepseek_v4_sparse_forward", "deepseek_v4_sparse_prefill",
    "deepseek_v4_write_swa_cache",
]
