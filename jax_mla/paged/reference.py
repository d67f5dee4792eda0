"""Pure jax.numpy paged decode attention: the oracle for the Triton kernel.

The caches are read through the canonical views of :mod:`jax_mla.paged.layout`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mla.paged.layout import CacheView, decode_rows, finish_output, scatter_rows


def _gather_tokens(view: CacheView, block_table: jax.Array) -> jax.Array:
  """``[S, maxb * bs, Hkv, D]`` float32 of each sequence's logical token slots."""
  nb, hkv, dx, bs, x = view.data.shape
  blocks = view.data[jnp.clip(block_table, 0, nb - 1)]  # [S, maxb, Hkv, D//x, bs, x]
  blocks = jnp.moveaxis(blocks, 4, 2)  # [S, maxb, bs, Hkv, D//x, x]
  s, maxb = block_table.shape
  return blocks.reshape(s, maxb * bs, hkv, dx * x).astype(jnp.float32)


def paged_attention_xla(query, key_view_: CacheView, value_view_: CacheView, block_table,
                        seq_lens, *, sm_scale, k_scale, v_scale, attn_sink, alibi_slopes,
                        sliding_window, query_start_loc, out_scale):
  """Dense softmax over each sequence's gathered keys (float32 throughout)."""
  t, hq, _ = query.shape
  num_blocks = key_view_.data.shape[0]
  hkv = key_view_.data.shape[1]
  bs = key_view_.data.shape[3]
  group = hq // hkv
  query_row, lens = decode_rows(seq_lens, query_start_loc, t)

  q = query[jnp.maximum(query_row, 0)].astype(jnp.float32)  # [S, Hq, D]
  k = _gather_tokens(key_view_, block_table) * jnp.asarray(k_scale, jnp.float32)
  v = _gather_tokens(value_view_, block_table) * jnp.asarray(v_scale, jnp.float32)
  n = k.shape[1]
  pos = jnp.arange(n, dtype=jnp.int32)
  blk = jnp.take(block_table, pos // bs, axis=1)  # [S, n]
  valid = (pos[None] < lens[:, None]) & (blk >= 0) & (blk < num_blocks)
  if sliding_window > 0:
    valid &= (lens[:, None] - 1 - pos[None]) < sliding_window
  # Zero the rows of slots not read so that NaN there cannot reach a product.
  k = jnp.where(valid[:, :, None, None], k, 0.0)
  v = jnp.where(valid[:, :, None, None], v, 0.0)
  k = jnp.repeat(k, group, axis=2)  # [S, n, Hq, D]
  v = jnp.repeat(v, group, axis=2)

  scores = jnp.einsum("shd,snhd->shn", q, k, precision="highest") * sm_scale
  if alibi_slopes is not None:
    rel = (pos[None] - (lens[:, None] - 1)).astype(jnp.float32)  # [S, n]
    scores += alibi_slopes.astype(jnp.float32)[None, :, None] * rel[:, None, :]
  scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
  m = jnp.max(scores, axis=-1)  # [S, Hq]
  if attn_sink is not None:
    m = jnp.maximum(m, attn_sink.astype(jnp.float32)[None])
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(scores - m_safe[..., None])
  denom = jnp.sum(p, axis=-1)
  if attn_sink is not None:
    denom += jnp.exp(attn_sink.astype(jnp.float32)[None] - m_safe)
  out = jnp.einsum("shn,snhd->shd", p, v, precision="highest")
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  if attn_sink is not None:  # an infinite sink takes all the weight
    out = jnp.where(jnp.isposinf(attn_sink)[None, :, None], 0.0, out)
  out = scatter_rows(out, query_row, t, identity=query_start_loc is None)
  return finish_output(out, query.dtype, out_scale)
