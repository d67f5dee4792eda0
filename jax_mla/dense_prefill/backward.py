"""Backward of ``mla_prefill`` in jax.numpy: gradients for ``q``, ``k`` and ``v`` from the
forward's saved ``out`` and ``lse`` (FlashAttention's recompute scheme).

Per sequence, head, query ``i`` and visible key ``j``: ``s = sm_scale q_i.k_j``, ``p =
exp(s - lse_i)``, ``out_i = sum_j p v_j``. With ``g`` the cotangent of ``out`` and
``c`` that of ``lse``::

  ds = p (g_i.v_j - g_i.out_i + c_i);  dq = sm_scale ds k;  dk = sm_scale ds^T q;  dv = p^T g

A query with no visible key (``lse = +inf``) gives zero gradients. GPU backward kernels
are not written yet: this runs as XLA on every backend.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_mla.dense_prefill.layout import causal_limit, pad_sequences


def mla_prefill_bwd(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, d_out, d_lse, *,
                    max_seqlen_q, max_seqlen_k, sm_scale, causal):
  """``(dq, dk, dv)`` of ``mla_prefill`` (``lse``, ``d_lse`` token-major ``[Tq, H]``)."""
  if q.shape[0] == 0 or k.shape[0] == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
    return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  qp, q_idx, q_valid, len_q = pad_sequences(q, cu_seqlens_q, max_seqlen_q)
  kp, k_idx, k_valid, len_k = pad_sequences(k, cu_seqlens_k, max_seqlen_k)
  vp, _, _, _ = pad_sequences(v, cu_seqlens_k, max_seqlen_k)
  op, gp = (pad_sequences(x, cu_seqlens_q, max_seqlen_q)[0] for x in (out, d_out))
  lse_p, dlse_p = (pad_sequences(x[..., None], cu_seqlens_q, max_seqlen_q)[0][..., 0]
                   for x in (lse, d_lse))  # [B, Sq, H]
  hi = lax.Precision.HIGHEST
  s = jnp.einsum("bqhd,bkhd->bhqk", f32(qp), f32(kp), precision=hi) * sm_scale
  mask = k_valid[:, None, None, :] & q_valid[:, None, :, None]
  if causal:
    pos_k = jnp.arange(max_seqlen_k, dtype=jnp.int32)
    limit = causal_limit(len_q, len_k, max_seqlen_q)
    mask = mask & (pos_k[None, None, None, :] <= limit[:, None, :, None])
  lse_h = jnp.transpose(lse_p, (0, 2, 1))[..., None]  # [B, H, Sq, 1]; +inf: no key
  p = jnp.where(mask, jnp.exp(s - lse_h), 0.0)
  g_out = jnp.transpose(jnp.sum(f32(gp) * f32(op), axis=-1), (0, 2, 1))[..., None]
  g_v = jnp.einsum("bqhd,bkhd->bhqk", f32(gp), f32(vp), precision=hi)
  ds = p * (g_v - g_out + jnp.transpose(dlse_p, (0, 2, 1))[..., None])
  dq = sm_scale * jnp.einsum("bhqk,bkhd->bqhd", ds, f32(kp), precision=hi)
  dk = sm_scale * jnp.einsum("bhqk,bqhd->bkhd", ds, f32(qp), precision=hi)
  dv = jnp.einsum("bhqk,bqhd->bkhd", p, f32(gp), precision=hi)

  def scatter(x, idx, valid, like):
    dst = jnp.where(valid, idx, like.shape[0])
    return jnp.zeros(like.shape, jnp.float32).at[dst].add(x, mode="drop").astype(like.dtype)

  return (scatter(dq, q_idx, q_valid, q), scatter(dk, k_idx, k_valid, k),
          scatter(dv, k_idx, k_valid, v))
