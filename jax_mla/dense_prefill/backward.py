"""Backward of ``mla_prefill`` in jax.numpy: gradients for ``q``, ``k`` and ``v`` from the
forward's saved ``out`` and ``lse`` (FlashAttention's recompute scheme).

Per sequence, head, query ``i`` and visible key ``j``: ``s = sm_scale q_i.k_j``, ``p =
exp(s - lse_i)``, ``out_i = sum_j p v_j``. With ``g`` the cotangent of ``out`` and
``c`` that of ``lse``::

  ds = p (g_i.v_j - g_i.out_i + c_i);  dq = sm_scale ds k;  dk = sm_scale ds^T q;  dv = p^T g

A query with no visible key (``lse = +inf``) gives zero gradients. Sequences are padded
to ``[B, max_seqlen, H, D]`` and the queries taken in blocks, so memory grows with
``B * H * 128 * max_seqlen_k``. The backward of the reference forward
(``implementation="xla"``) and the oracle of ``triton_backward``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_mla.dense_prefill.layout import causal_limit, pad_sequences

# Query positions per step: bounds the [B, H, queries, max_seqlen_k] score block.
_QUERIES_PER_STEP = 128


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
  kf, vf, qf = f32(kp), f32(vp), f32(qp)
  limit = causal_limit(len_q, len_k, max_seqlen_q)  # [B, Sq]
  pos_k = jnp.arange(max_seqlen_k, dtype=jnp.int32)
  # Query blocks of _QUERIES_PER_STEP bound the [B, H, queries, Sk] score block.
  qb = min(_QUERIES_PER_STEP, max_seqlen_q)
  n = -(-max_seqlen_q // qb)
  pad = n * qb - max_seqlen_q

  def blocks(x, fill=0):  # [B, Sq, ...] -> [n, B, qb, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], n, qb, *x.shape[2:]), 1, 0)

  def step(carry, c):
    dk, dv = carry
    q_b, valid_b, limit_b, o_b, g_b, lse_b, dlse_b = c
    s = jnp.einsum("bqhd,bkhd->bhqk", q_b, kf, precision=hi) * sm_scale
    mask = k_valid[:, None, None, :] & valid_b[:, None, :, None]
    if causal:
      mask = mask & (pos_k[None, None, None, :] <= limit_b[:, None, :, None])
    lse_h = jnp.transpose(lse_b, (0, 2, 1))[..., None]  # [B, H, qb, 1]; +inf: no key
    p = jnp.where(mask, jnp.exp(s - lse_h), 0.0)
    g_out = jnp.transpose(jnp.sum(g_b * o_b, axis=-1), (0, 2, 1))[..., None]
    g_v = jnp.einsum("bqhd,bkhd->bhqk", g_b, vf, precision=hi)
    ds = p * (g_v - g_out + jnp.transpose(dlse_b, (0, 2, 1))[..., None])
    dq = sm_scale * jnp.einsum("bhqk,bkhd->bqhd", ds, kf, precision=hi)
    dk = dk + sm_scale * jnp.einsum("bhqk,bqhd->bkhd", ds, q_b, precision=hi)
    dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, g_b, precision=hi)
    return (dk, dv), dq

  inputs = (blocks(qf), blocks(q_valid, False), blocks(limit), blocks(f32(op)), blocks(f32(gp)),
            blocks(lse_p, jnp.inf), blocks(dlse_p))
  (dk, dv), dq = lax.scan(step, (jnp.zeros(kf.shape, jnp.float32),
                                 jnp.zeros(vf.shape, jnp.float32)), inputs)
  dq = jnp.moveaxis(dq, 0, 1).reshape(qp.shape[0], n * qb, *qp.shape[2:])[:, :max_seqlen_q]

  def scatter(x, idx, valid, like):
    dst = jnp.where(valid, idx, like.shape[0])
    return jnp.zeros(like.shape, jnp.float32).at[dst].add(x, mode="drop").astype(like.dtype)

  return (scatter(dq, q_idx, q_valid, q), scatter(dk, k_idx, k_valid, k),
          scatter(dv, k_idx, k_valid, v))
