"""Pure jax.numpy sparse MLA (the oracle): gather the selected rows, dense softmax over them.

Semantics follow FlashMLA's ``tests/ref.py``: invalid indices (``< 0``, ``>= number
of slots``, or at positions ``>= topk_length``) are masked and their rows zeroed
before any arithmetic, so NaN in unused slots never reaches an output; the sink
scales the output by ``exp(lse) / (exp(lse) + exp(sink))`` and leaves ``lse``
alone; a query row with no valid key gets ``out = 0``, ``lse = +inf`` and
``max_logits = -inf``; a NaN score at a valid key (a NaN query, a NaN in a used
slot) gives NaN in all three.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_mla.cache.layout import Format
from jax_mla.sparse_mla.layout import valid_slots

# Query tokens per step of the reference: bounds the gathered [tokens, topk, d] copy.
_TOKENS_PER_STEP = 64


def attend_gathered(q: jax.Array, rows: jax.Array, valid: jax.Array, attn_sink: jax.Array | None,
                    *, sm_scale: float, d_v: int):
  """Softmax attention of ``q[T, h, d]`` over its own gathered ``rows[T, K, d]``.

  ``valid[T, K]`` marks usable rows (others may hold anything, NaN included).
  Returns ``(out bf16[T, h, d_v], max_logits f32[T, h], lse f32[T, h])``.
  """
  rows = jnp.where(valid[..., None], rows.astype(jnp.float32), 0.0)
  s = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), rows,
                 precision=lax.Precision.HIGHEST) * sm_scale
  s = jnp.where(valid[:, None, :], s, -jnp.inf)
  # A NaN score at a valid key (a NaN query, say) makes the row NaN, whatever NaN rule
  # the backend's max follows; the row is not empty then.
  max_logits = jnp.where(jnp.isnan(s).any(axis=-1), jnp.nan, jnp.max(s, axis=-1))
  empty = max_logits == -jnp.inf
  lse = jnp.where(empty, 0.0, jax.nn.logsumexp(jnp.where(empty[..., None], 0.0, s), axis=-1))
  p = jnp.exp(s - lse[..., None])
  out = jnp.einsum("thk,tkd->thd", p, rows[..., :d_v], precision=lax.Precision.HIGHEST)
  if attn_sink is not None:
    out = out / (1.0 + jnp.exp(attn_sink.astype(jnp.float32) - lse))[..., None]
  out = jnp.where(empty[..., None], 0.0, out)
  lse = jnp.where(empty, jnp.inf, lse)
  return out.astype(jnp.bfloat16), max_logits, lse


def _map_tokens(fn, *xs):
  """``fn`` over leading-axis chunks of ``xs`` (bounds memory for long prefills)."""
  t = xs[0].shape[0]
  if t <= _TOKENS_PER_STEP:
    return fn(*xs)
  n = -(-t // _TOKENS_PER_STEP)
  pad = n * _TOKENS_PER_STEP - t
  chunks = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(
      n, _TOKENS_PER_STEP, *x.shape[1:]) for x in xs]
  outs = lax.map(lambda c: fn(*c), chunks)
  return tuple(o.reshape(n * _TOKENS_PER_STEP, *o.shape[2:])[:t] for o in outs)


def sparse_prefill(q, kv, indices, attn_sink, lengths, *, sm_scale: float, d_v: int):
  """Reference sparse prefill: ``q[s_q, h, d]``, ``kv[s_kv, d]``, ``indices[s_q, topk]``,
  ``lengths[s_q]``."""
  num_slots = kv.shape[0]

  def step(q_c, idx_c, len_c):
    valid = valid_slots(idx_c, len_c, num_slots)
    rows = kv[jnp.where(valid, idx_c, 0)]
    return attend_gathered(q_c, rows, valid, attn_sink, sm_scale=sm_scale, d_v=d_v)

  return _map_tokens(step, q, indices, lengths)


def sparse_decode(q, sets, attn_sink, *, fmt: Format, sm_scale: float, d_v: int,
                  extra_fmt: Format | None = None):
  """Reference sparse decode over key sets that share one softmax.

  ``q[T, h, d]`` (batch and query position flattened); each set is
  ``(kv_cache, indices[T, topk], lengths[T])`` with global slots
  ``block * block_size + offset``, caches in format ``fmt`` (the second set in
  ``extra_fmt`` when given). Returns ``(out, max_logits, lse)`` over ``T``.
  """
  caches = [cache for cache, _, _ in sets]
  fmts = (fmt, extra_fmt or fmt)[:len(sets)]

  def step(q_c, *pairs):
    rows, valid = [], []
    for cache, f, idx_c, len_c in zip(caches, fmts, pairs[::2], pairs[1::2], strict=True):
      ok = valid_slots(idx_c, len_c, cache.shape[0] * cache.shape[1])
      rows.append(f.gather_dequantize(cache, jnp.where(ok, idx_c, 0)))
      valid.append(ok)
    return attend_gathered(q_c, jnp.concatenate(rows, axis=1), jnp.concatenate(valid, axis=1),
                           attn_sink, sm_scale=sm_scale, d_v=d_v)

  return _map_tokens(step, q, *[a for _, idx, lengths in sets for a in (idx, lengths)])
