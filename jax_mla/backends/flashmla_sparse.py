"""FlashMLASparse: vLLM's ``flashmla_sparse`` backend as functions over pytree metadata.

DeepSeek V3.2 sparse MLA in the absorbed ("MQA 576/512") form for prefill and
decode alike: ``q_nope`` is absorbed into the latent space with ``W_UK_T``, the new
tokens' latents are written into the cache, the indexer's request-local top-k is
turned into global cache slots, sparse attention runs over those slots (bf16
cache: ``sparse_mla_prefill`` over the flat cache; ``fp8_ds_mla`` cache:
``sparse_mla_decode`` with in-kernel dequantization) and ``W_UV`` projects the
latent output to the value heads. :class:`FlashMLASparse` gathers the entry
points and shows a whole step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_mla import _common as c
from jax_mla._pytree import pytree_dataclass, static_field
from jax_mla.cache import concat_and_cache_mla
from jax_mla.indexing import convert_req_index_to_global_index, req_id_per_token
from jax_mla.sharding import OpSharding, config_heads, set_config_heads
from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill

KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")


@pytree_dataclass
class FlashMLASparseMetadata:
  """Per-step metadata (vLLM ``FlashMLASparseMetadata``); arrays are device data.

  Attributes:
    query_start_loc: int32 ``[R + 1]``, query-token offsets of the requests.
    slot_mapping: int32 ``[T]``, cache slot of each new token (``-1`` = padding).
    block_table: int32 ``[R, B]``, physical cache blocks of each request.
    req_id_per_token: int32 ``[T]``, request of each token (padding tokens: 0).
    num_actual_tokens: int32 scalar; tokens past it are batch padding (output 0).
    block_size: tokens per cache block (static).
    topk_tokens: indexer top-k (static; 2048 for DeepSeek V3.2).
  """
  query_start_loc: jax.Array
  slot_mapping: jax.Array
  block_table: jax.Array
  req_id_per_token: jax.Array
  num_actual_tokens: jax.Array
  block_size: int = static_field(64)
  topk_tokens: int = static_field(2048)


def build_flashmla_sparse_metadata(query_start_loc: jax.Array, block_table: jax.Array,
                                   slot_mapping: jax.Array, *, num_tokens: int,
                                   block_size: int = 64, topk_tokens: int = 2048,
                                   num_actual_tokens: jax.Array | int | None = None,
                                   ) -> FlashMLASparseMetadata:
  """Builds the metadata of one step (vLLM ``FlashMLASparseMetadataBuilder.build``).

  Built once a step and shared by every layer; :class:`FlashMLASparse` shows a step.

  Args:
    query_start_loc: int32 ``[R + 1]``.
    block_table: int32 ``[R, B]``.
    slot_mapping: int32 ``[num_tokens]`` (``-1`` for padding tokens).
    num_tokens: padded token count of the step (static).
    block_size: cache block size.
    topk_tokens: indexer top-k.
    num_actual_tokens: real tokens (default ``query_start_loc[-1]``).
  """
  c.check_rank("query_start_loc", query_start_loc, 1)
  c.check_int32("query_start_loc", query_start_loc)
  c.check_rank("block_table", block_table, 2)
  c.check_int32("block_table", block_table)
  c.check_shape("block_table", block_table, (query_start_loc.shape[0] - 1, None))
  c.check_int32("slot_mapping", slot_mapping)
  c.check_shape("slot_mapping", slot_mapping, (num_tokens,))
  if num_actual_tokens is None:
    num_actual_tokens = query_start_loc[-1]
  return FlashMLASparseMetadata(
      query_start_loc=query_start_loc, slot_mapping=slot_mapping, block_table=block_table,
      req_id_per_token=req_id_per_token(query_start_loc, num_tokens=num_tokens),
      num_actual_tokens=jnp.asarray(num_actual_tokens, jnp.int32),
      block_size=block_size, topk_tokens=topk_tokens)


@dataclasses.dataclass(frozen=True)
class FlashMLASparseConfig:
  """Static layer configuration (DeepSeek V3.2 defaults)."""
  num_heads: int
  scale: float
  kv_cache_dtype: str = "auto"
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  kv_lora_rank: int = 512
  v_head_dim: int = 128


def _check_forward(config, q, k_c_normed, k_pe, kv_cache, topk_indices, w_uk_t, w_uv, metadata):
  c.check_one_of("config.kv_cache_dtype", config.kv_cache_dtype, KV_CACHE_DTYPES)
  h, p, r = config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
  L, v = config.kv_lora_rank, config.v_head_dim
  c.check_rank("q", q, 3)
  T = q.shape[0]
  c.check_shape("q", q, (T, h, p + r))
  c.check_shape("k_c_normed", k_c_normed, (T, L))
  if k_pe.ndim == 3:
    c.check_shape("k_pe", k_pe, (T, 1, r))
  else:
    c.check_shape("k_pe", k_pe, (T, r))
  c.check_shape("w_uk_t", w_uk_t, (h, p, L))
  c.check_shape("w_uv", w_uv, (h, L, v))
  c.check_int32("topk_indices", topk_indices)
  c.check_shape("topk_indices", topk_indices, (T, None))
  if metadata is not None:
    c.check_shape("metadata.slot_mapping", metadata.slot_mapping, (T,))
    c.check_shape("metadata.req_id_per_token", metadata.req_id_per_token, (T,))


@functools.partial(jax.jit, static_argnames=("config", "implementation", "interpret"),
                   donate_argnames=("kv_cache",))
def flashmla_sparse_forward(q: jax.Array, k_c_normed: jax.Array, k_pe: jax.Array,
                            kv_cache: jax.Array, topk_indices: jax.Array, w_uk_t: jax.Array,
                            w_uv: jax.Array, metadata: FlashMLASparseMetadata | None, *,
                            config: FlashMLASparseConfig, k_scale: jax.Array | None = None,
                            implementation: c.Implementation = None,
                            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """One sparse-MLA attention layer step (vLLM ``FlashMLASparseImpl.forward``).

  Args:
    q: ``[T, H, qk_nope + qk_rope]`` queries (bf16).
    k_c_normed: ``[T, kv_lora_rank]`` new latents; k_pe: ``[T, rope]`` or ``[T, 1, rope]``.
    kv_cache: ``[num_blocks, block_size, 576]`` bf16 (``"auto"``) or
      ``[num_blocks, block_size, 656]`` uint8 (``"fp8_ds_mla"``); donated.
    topk_indices: int32 ``[T, topk]`` request-local token positions from the indexer
      (``-1`` = none).
    w_uk_t: ``[H, qk_nope, kv_lora_rank]`` (absorbs ``q_nope`` into the latent space).
    w_uv: ``[H, kv_lora_rank, v_head_dim]`` (value up-projection).
    metadata: from :func:`build_flashmla_sparse_metadata`; ``None`` (a profiling or
      idle step) gives a zero output and leaves the cache as it is.
    config: static layer configuration.
    k_scale: accepted for vLLM parity; the formats here carry their own scales.
    implementation, interpret: forwarded to the sparse-MLA op (the cache write and the
      index conversion run Triton for ``"mosaic"``).

  Returns:
    ``(output [T, H * v_head_dim], kv_cache)``; rows past ``num_actual_tokens`` are 0.
  """
  del k_scale  # "auto" and "fp8_ds_mla" need no per-tensor scale.
  _check_forward(config, q, k_c_normed, k_pe, kv_cache, topk_indices, w_uk_t, w_uv, metadata)
  T, H = q.shape[0], config.num_heads
  if metadata is None:
    return jnp.zeros((T, H * config.v_head_dim), q.dtype), kv_cache

  live = jnp.arange(T) < metadata.num_actual_tokens
  q_nope, q_pe = q[..., :config.qk_nope_head_dim], q[..., config.qk_nope_head_dim:]
  # bf16 x bf16 -> bf16 with f32 accumulation inside the dot, as torch.bmm does.
  ql_nope = jnp.einsum("thp,hpl->thl", q_nope, w_uk_t.astype(q.dtype))
  q_latent = jnp.concatenate([ql_nope, q_pe], axis=-1)

  kv_cache = concat_and_cache_mla(
      k_c_normed, k_pe.reshape(T, config.qk_rope_head_dim), kv_cache,
      jnp.where(live, metadata.slot_mapping, -1), kv_cache_dtype=config.kv_cache_dtype,
      implementation=c.without_mosaic(implementation), interpret=interpret)
  slots = convert_req_index_to_global_index(
      metadata.req_id_per_token, metadata.block_table, topk_indices,
      block_size=metadata.block_size, implementation=c.without_mosaic(implementation),
      interpret=interpret)
  slots = jnp.where(live[:, None], slots, -1)

  if config.kv_cache_dtype == "fp8_ds_mla":
    # All tokens as one batch of s_q = T queries, as vLLM calls FlashMLA.
    attn, _ = sparse_mla_decode(
        q_latent[None], kv_cache, slots[None], kv_cache_dtype=config.kv_cache_dtype,
        sm_scale=config.scale, implementation=implementation, interpret=interpret)
    attn = attn[0]
  else:
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    attn, _, _ = sparse_mla_prefill(q_latent, flat, slots, sm_scale=config.scale,
                                    implementation=implementation, interpret=interpret)

  out = jnp.einsum("thl,hlv->thv", attn.astype(q.dtype), w_uv.astype(q.dtype))
  out = jnp.where(live[:, None, None], out, 0).astype(q.dtype)
  return out.reshape(T, H * config.v_head_dim), kv_cache


class FlashMLASparse:
  """DeepSeek V3.2 sparse MLA layer (vLLM's ``FLASHMLA_SPARSE`` backend), functional.

  Per step, :attr:`build_metadata` turns the batch layout (request offsets, block
  table, cache slot of each new token) into a :class:`FlashMLASparseMetadata`
  pytree; per layer, :attr:`forward` writes the new latents into the cache, runs
  sparse attention over each token's top-k and returns ``(output, kv_cache)``.
  Shapes (``T`` tokens, ``H`` heads, V3.2 dims): ``q [T, H, 128 + 64]``,
  ``k_c_normed [T, 512]``, ``k_pe [T, 64]``, ``kv_cache [blocks, block_size, 576]``
  bf16 (``"auto"``) or ``[blocks, block_size, 656]`` uint8 (``"fp8_ds_mla"``),
  ``topk_indices`` int32 ``[T, topk]`` request-local positions (``-1`` = none),
  ``w_uk_t [H, 128, 512]``, ``w_uv [H, 512, 128]``; output ``[T, H * 128]``.

  Example (2 requests: 2 new tokens at positions 0-1, and 1 at position 0; the
  reference runs anywhere, drop ``implementation`` to use the GPU kernels):

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jax_mla.backends import FlashMLASparse

    >>> H, T, block_size = 4, 3, 64
    >>> config = FlashMLASparse.Config(num_heads=H, scale=192 ** -0.5)
    >>> metadata = FlashMLASparse.build_metadata(
    ...     jnp.array([0, 2, 3], jnp.int32),         # query_start_loc [R + 1]
    ...     jnp.array([[1, 0], [3, 2]], jnp.int32),  # block_table [R, blocks per request]
    ...     jnp.array([64, 65, 192], jnp.int32),     # slot_mapping [T]: block * 64 + offset
    ...     num_tokens=T, block_size=block_size)
    >>> x = lambda seed, shape: jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    >>> out, kv_cache = FlashMLASparse.forward(
    ...     x(0, (T, H, 192)), x(1, (T, 512)), x(2, (T, 64)),   # q, k_c_normed, k_pe
    ...     jnp.zeros((4, block_size, 576), jnp.bfloat16),     # kv_cache (donated)
    ...     jnp.array([[0, -1], [0, 1], [0, -1]], jnp.int32),  # topk_indices [T, 2]
    ...     x(3, (H, 128, 512)), x(4, (H, 512, 128)),          # w_uk_t, w_uv
    ...     metadata, config=config, implementation="xla")
    >>> assert out.shape == (T, H * 128) and kv_cache.shape == (4, block_size, 576)
  """
  Config = FlashMLASparseConfig
  Metadata = FlashMLASparseMetadata
  build_metadata = staticmethod(build_flashmla_sparse_metadata)
  forward = staticmethod(flashmla_sparse_forward)


# Heads split over devices with their weights; the cache and metadata replicated.
flashmla_sparse_forward.sharding = OpSharding(
    heads=dict(q=1, w_uk_t=0, w_uv=0), head_outs=(1, None), num_heads=config_heads,
    set_heads=set_config_heads, shared=("w_uk_t", "w_uv", "k_scale"))
