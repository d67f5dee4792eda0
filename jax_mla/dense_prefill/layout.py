"""How packed varlen tokens map to a padded per-sequence batch (the reference and the
jax.numpy backward share it) and to the kernels' per-sequence rows."""

from __future__ import annotations

import jax.numpy as jnp


def pad_sequences(x, cu_seqlens, max_seqlen):
  """Gathers packed ``x[T, ...]`` into ``[B, max_seqlen, ...]`` (zeros past each length).

  Returns ``(rows, idx, valid, lens)``: the padded rows, each row's packed index, which
  rows are real, and the sequence lengths.
  """
  pos = jnp.arange(max_seqlen, dtype=jnp.int32)
  lens = cu_seqlens[1:] - cu_seqlens[:-1]
  valid = pos[None, :] < lens[:, None]
  idx = jnp.where(valid, cu_seqlens[:-1, None] + pos[None, :], 0)
  # Zero padding rows with `where` so a NaN in a foreign row never enters a dot.
  rows = jnp.where(valid[..., None, None], x[jnp.clip(idx, 0, max(x.shape[0] - 1, 0))], 0)
  return rows, idx, valid, lens


def causal_limit(len_q, len_k, max_seqlen_q):
  """``[B, Sq]``: the last key each query sees under the bottom-right aligned causal mask
  (flash-attn >= 2.1): query ``i`` sees keys ``j <= i + len_k - len_q``."""
  pos_q = jnp.arange(max_seqlen_q, dtype=jnp.int32)
  return pos_q[None, :] + (len_k - len_q)[:, None]


def seq_info(cu_seqlens_q, cu_seqlens_k, num_q_tokens):
  """``[B + 1, 4]`` int32 rows ``(q_start, len_q, k_start, len_k)``; row B is the tail."""
  q_start = cu_seqlens_q[:-1]
  len_q = cu_seqlens_q[1:] - q_start
  k_start = cu_seqlens_k[:-1]
  len_k = cu_seqlens_k[1:] - k_start
  tail_start = cu_seqlens_q[-1:]
  tail = jnp.concatenate([tail_start, num_q_tokens - tail_start, jnp.zeros((2,), jnp.int32)])
  rows = jnp.stack([q_start, len_q, k_start, len_k], axis=1)
  return jnp.concatenate([rows, tail[None, :]], axis=0).astype(jnp.int32)
