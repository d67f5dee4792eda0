"""Backward of sparse MLA prefill in jax.numpy: gradients for ``q``, ``kv`` and the sink
from the forward's saved ``out`` and ``lse`` (FlashAttention's recompute scheme).

Per token ``t``, head ``h`` and valid key ``k`` (gathered row ``K_k``, value ``V_k`` its
first ``d_v`` columns): ``s = sm_scale q.K_k``, ``p = exp(s - lse)``, ``f = 1 / (1 +
exp(sink - lse))`` (1 without a sink) and ``out = f sum_k p V_k``. With ``g`` the
cotangent of ``out`` and ``c`` that of ``lse``::

  ds_k   = p_k (f (g.V_k - g.out) + c)
  dq     = sm_scale sum_k ds_k K_k
  dK_k  += sm_scale sum_h ds_k q        (rows scattered back by index: duplicates add)
  dV_k  += sum_h f p_k g
  dsink  = -sum_t (1 - f) g.out

``max_logits`` is treated as a constant (its cotangent is ignored). Invalid or masked
indices get no gradient; a row with no valid key gives zero gradients (never NaN).
This is the backward of the ``"xla"`` implementation; the kernels' backward is
:mod:`.triton_backward`, which takes ``f`` and ``bias`` from :func:`head_terms`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_mla.sparse_mla.layout import valid_slots

# Query tokens per step: bounds the gathered [tokens, topk, d] rows.
_TOKENS_PER_STEP = 64


def head_terms(out, lse, d_out, attn_sink):
  """``(f, g_out)`` float32 ``[T, h]``: the sink factor ``f`` (1 without a sink and for
  rows with no key) and ``g.out``."""
  if attn_sink is None:
    f = jnp.ones_like(lse)
  else:
    f = jnp.where(jnp.isinf(lse), 1.0, jax.nn.sigmoid(lse - attn_sink.astype(jnp.float32)))
  g_out = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  return f, g_out


def sink_grad(f, g_out, attn_sink):
  """``dsink`` (``attn_sink``'s dtype; None without a sink)."""
  if attn_sink is None:
    return None
  return (-jnp.sum((1.0 - f) * g_out, axis=0)).astype(attn_sink.dtype)


def sparse_prefill_bwd(q, kv, indices, attn_sink, lengths, out, lse, d_out, d_lse, *,
                       sm_scale: float, d_v: int):
  """``(dq, dkv, dsink)`` of :func:`jax_mla.sparse_mla.sparse_mla_prefill` (shapes and
  dtypes of ``q``, ``kv`` and ``attn_sink``; ``dsink`` None without a sink)."""
  s_q, h_q, d_qk = q.shape
  num_slots = kv.shape[0]
  f, g_out = head_terms(out, lse, d_out, attn_sink)
  step_t = min(_TOKENS_PER_STEP, s_q)
  n = -(-s_q // step_t)
  pad = n * step_t - s_q

  def chunks(x, fill=0):
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return x.reshape(n, step_t, *x.shape[1:])

  def step(dkv, c):
    q_c, idx_c, len_c, lse_c, g_c, f_c, bias_c = c
    valid = valid_slots(idx_c, len_c, num_slots)  # [T, K]
    safe = jnp.where(valid, idx_c, 0)
    rows = jnp.where(valid[..., None], kv[safe].astype(jnp.float32), 0.0)  # [T, K, d]
    qf = q_c.astype(jnp.float32)
    s = jnp.einsum("thd,tkd->thk", qf, rows, precision=lax.Precision.HIGHEST) * sm_scale
    # lse is +inf for a row with no valid key: p = 0 there, like every masked key.
    p = jnp.where(valid[:, None, :], jnp.exp(s - lse_c[..., None]), 0.0)
    g = g_c.astype(jnp.float32)
    g_v = jnp.einsum("thd,tkd->thk", g, rows[..., :d_v], precision=lax.Precision.HIGHEST)
    ds = p * (f_c[..., None] * g_v + bias_c[..., None])
    dq = sm_scale * jnp.einsum("thk,tkd->thd", ds, rows, precision=lax.Precision.HIGHEST)
    drows = sm_scale * jnp.einsum("thk,thd->tkd", ds, qf, precision=lax.Precision.HIGHEST)
    drows = drows.at[..., :d_v].add(
        jnp.einsum("thk,thd->tkd", f_c[..., None] * p, g, precision=lax.Precision.HIGHEST))
    target = jnp.where(valid, idx_c, num_slots).reshape(-1)  # invalid: dropped
    return dkv.at[target].add(drows.reshape(-1, d_qk), mode="drop"), dq

  # ds = p (f (g.V - g.out) + c) = p (f g.V + bias)
  inputs = (chunks(q), chunks(indices, -1), chunks(lengths), chunks(lse, jnp.inf),
            chunks(d_out), chunks(f), chunks(d_lse - f * g_out))
  dkv, dq = lax.scan(step, jnp.zeros(kv.shape, jnp.float32), inputs)
  dq = dq.reshape(n * step_t, h_q, d_qk)[:s_q]
  return dq.astype(q.dtype), dkv.astype(kv.dtype), sink_grad(f, g_out, attn_sink)
