"""Pure jax.numpy varlen attention with different q/k and v head sizes (the oracle).

Sequences are gathered into a padded ``[B, max_seqlen, H, D]`` batch, attended in
float32, and scattered back to the packed token layout.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_mla.dense_prefill.layout import causal_limit, pad_sequences


def mla_prefill_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
                          sm_scale, causal):
  """Returns ``(out[Tq, H, d_v] in q.dtype, lse f32[Tq, H])``; see ``jax_mla.dense_prefill``."""
  num_tokens = q.shape[0]
  num_heads, d_v = v.shape[1], v.shape[2]
  if num_tokens == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
    return (jnp.zeros((num_tokens, num_heads, d_v), q.dtype),
            jnp.full((num_tokens, num_heads), jnp.inf, jnp.float32))
  qp, q_idx, q_valid, len_q = pad_sequences(q, cu_seqlens_q, max_seqlen_q)
  kp, _, k_valid, len_k = pad_sequences(k, cu_seqlens_k, max_seqlen_k)
  vp, _, _, _ = pad_sequences(v, cu_seqlens_k, max_seqlen_k)

  s = jnp.einsum("bqhd,bkhd->bhqk", qp.astype(jnp.float32), kp.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * sm_scale
  mask = k_valid[:, None, None, :]
  if causal:
    pos_k = jnp.arange(max_seqlen_k, dtype=jnp.int32)
    limit = causal_limit(len_q, len_k, max_seqlen_q)                       # [B, Sq]
    mask = mask & (pos_k[None, None, None, :] <= limit[:, None, :, None])
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
  p = jnp.exp(s - m_safe[..., None])
  l = jnp.sum(p, axis=-1)                                                     # [B, H, Sq]
  o = jnp.einsum("bhqk,bkhd->bqhd", p, vp.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  # No visible key: l == 0 (out 0, lse +inf). A NaN score makes l NaN: NaN out, as the
  # kernel gives.
  empty = l == 0
  l_q = jnp.transpose(l, (0, 2, 1))[..., None]                                # [B, Sq, H, 1]
  o = jnp.where(l_q == 0, 0.0, o / jnp.where(l_q == 0, 1.0, l_q))
  lse = jnp.where(empty, jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, l)))

  # Scatter back; padding rows (and tokens past cu_seqlens_q[-1]) keep out=0, lse=+inf.
  dst = jnp.where(q_valid, q_idx, num_tokens)
  out = jnp.zeros((num_tokens, num_heads, d_v), jnp.float32).at[dst].set(o, mode="drop")
  lse_t = jnp.full((num_tokens, num_heads), jnp.inf, jnp.float32).at[dst].set(
      jnp.transpose(lse, (0, 2, 1)), mode="drop")
  return out.astype(q.dtype), lse_t

