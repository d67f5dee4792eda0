"""Pure jax.numpy paged decode attention: the oracle for the Pallas kernel.

Every cache layout is first viewed as one canonical 5-D shape
``[num_blocks, num_kv_heads, D // x, block_size, x]`` (the vLLM key layout):

- 5-D key cache ``[nb, Hkv, D//x, bs, x]``: as is.
- 4-D ``[nb, Hkv, bs, D]`` (token-major): ``x = D`` -> ``[nb, Hkv, 1, bs, D]``.
- 4-D ``[nb, Hkv, D, bs]`` (dim-major, vLLM's value layout): ``x = 1`` ->
  ``[nb, Hkv, D, bs, 1]``.

These are free reshapes, and element ``(token offset o, dim d)`` of a block sits
at ``[.., d // x, o, d % x]`` in all three, so the kernel has one addressing rule.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mla._common import FP8_E4M3_MAX


@dataclasses.dataclass(frozen=True)
class CacheView:
  """A cache viewed as ``[nb, Hkv, D // x, bs, x]`` (see the module docstring)."""
  data: jax.Array
  x: int  # innermost run of head dims: 1 (dim-major), vLLM's x, or D (token-major)


def key_view(key_cache: jax.Array) -> CacheView:
  if key_cache.ndim == 5:
    return CacheView(key_cache, key_cache.shape[4])
  nb, hkv, bs, d = key_cache.shape
  return CacheView(key_cache.reshape(nb, hkv, 1, bs, d), d)


def value_view(value_cache: jax.Array, dim_major: bool) -> CacheView:
  nb, hkv, a, b = value_cache.shape
  if dim_major:  # [nb, Hkv, D, bs]
    return CacheView(value_cache.reshape(nb, hkv, a, b, 1), 1)
  return CacheView(value_cache.reshape(nb, hkv, 1, a, b), b)  # [nb, Hkv, bs, D]


def decode_rows(seq_lens: jax.Array, query_start_loc: jax.Array | None,
                num_tokens: int) -> tuple[jax.Array, jax.Array]:
  """Returns ``(query_row[S], seq_lens[S])`` of the sequences this op computes.

  Without ``query_start_loc`` sequence ``s`` is query row ``s``. With it, only
  sequences with exactly one query token are decoded (the seed kernel skips
  longer ones: they belong to a prefill kernel); a skipped sequence gets row
  ``-1`` and length 0, so it reads no key. Negative lengths count as 0.
  """
  seq_lens = jnp.maximum(seq_lens, 0)
  if query_start_loc is None:
    return jnp.arange(seq_lens.shape[0], dtype=jnp.int32), seq_lens
  start = query_start_loc[:-1]
  is_decode = (query_start_loc[1:] - start == 1) & (start >= 0) & (start < num_tokens)
  return jnp.where(is_decode, start, -1), jnp.where(is_decode, seq_lens, 0)


def scatter_rows(out_seq: jax.Array, query_row: jax.Array, num_tokens: int,
                 identity: bool) -> jax.Array:
  """Places ``out_seq[S, ...]`` at rows ``query_row`` of a zero ``[T, ...]`` output."""
  if identity:
    return out_seq
  rows = jnp.where(query_row >= 0, query_row, num_tokens)  # skipped -> dropped
  out = jnp.zeros((num_tokens, *out_seq.shape[1:]), out_seq.dtype)
  return out.at[rows].set(out_seq, mode="drop")


def finish_output(out: jax.Array, dtype, out_scale) -> jax.Array:
  """Casts to the output dtype; with ``out_scale``, fp8 e4m3 of ``out / out_scale``."""
  if out_scale is None:
    return out.astype(dtype)
  out = out.astype(jnp.float32) / jnp.asarray(out_scale, jnp.float32)
  return jnp.clip(out, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)


def _gather_tokens(view: CacheView, block_tables: jax.Array) -> jax.Array:
  """``[S, maxb * bs, Hkv, D]`` float32 of each sequence's logical token slots."""
  nb, hkv, dx, bs, x = view.data.shape
  blocks = view.data[jnp.clip(block_tables, 0, nb - 1)]  # [S, maxb, Hkv, D//x, bs, x]
  blocks = jnp.moveaxis(blocks, 4, 2)  # [S, maxb, bs, Hkv, D//x, x]
  s, maxb = block_tables.shape
  return blocks.reshape(s, maxb * bs, hkv, dx * x).astype(jnp.float32)


def paged_attention_xla(query, key_view_, value_view_, block_tables, seq_lens, *, scale,
                        k_scale, v_scale, sinks, alibi_slopes, sliding_window,
                        query_start_loc, out_scale, physical_block_size):
  """Dense softmax over each sequence's gathered keys (float32 throughout)."""
  del physical_block_size  # the caches' own block size: a view, not a tiling choice
  t, hq, _ = query.shape
  num_blocks = key_view_.data.shape[0]
  hkv = key_view_.data.shape[1]
  bs = key_view_.data.shape[3]
  group = hq // hkv
  query_row, lens = decode_rows(seq_lens, query_start_loc, t)

  q = query[jnp.maximum(query_row, 0)].astype(jnp.float32)  # [S, Hq, D]
  k = _gather_tokens(key_view_, block_tables) * jnp.asarray(k_scale, jnp.float32)
  v = _gather_tokens(value_view_, block_tables) * jnp.asarray(v_scale, jnp.float32)
  n = k.shape[1]
  pos = jnp.arange(n, dtype=jnp.int32)
  blk = jnp.take(block_tables, pos // bs, axis=1)  # [S, n]
  valid = (pos[None] < lens[:, None]) & (blk >= 0) & (blk < num_blocks)
  if sliding_window > 0:
    valid &= (lens[:, None] - 1 - pos[None]) < sliding_window
  # Zero the rows of slots not read so that NaN there cannot reach a product.
  k = jnp.where(valid[:, :, None, None], k, 0.0)
  v = jnp.where(valid[:, :, None, None], v, 0.0)
  k = jnp.repeat(k, group, axis=2)  # [S, n, Hq, D]
  v = jnp.repeat(v, group, axis=2)

  scores = jnp.einsum("shd,snhd->shn", q, k, precision="highest") * scale
  if alibi_slopes is not None:
    rel = (pos[None] - (lens[:, None] - 1)).astype(jnp.float32)  # [S, n]
    scores += alibi_slopes.astype(jnp.float32)[None, :, None] * rel[:, None, :]
  scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
  m = jnp.max(scores, axis=-1)  # [S, Hq]
  if sinks is not None:
    m = jnp.maximum(m, sinks.astype(jnp.float32)[None])
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(scores - m_safe[..., None])
  denom = jnp.sum(p, axis=-1)
  if sinks is not None:
    denom += jnp.exp(sinks.astype(jnp.float32)[None] - m_safe)
  out = jnp.einsum("shn,snhd->shd", p, v, precision="highest")
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  if sinks is not None:  # an infinite sink takes all the weight
    out = jnp.where(jnp.isposinf(sinks)[None, :, None], 0.0, out)
  out = scatter_rows(out, query_row, t, identity=query_start_loc is None)
  return finish_output(out, query.dtype, out_scale)
