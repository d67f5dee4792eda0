"""How paged_attention reads its caches and places its rows: shared by the kernels
(:mod:`jax_mla.paged.triton`, :mod:`jax_mla.paged.mosaic`) and the reference
(:mod:`jax_mla.paged.reference`).

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

from jax_mla.cache.e4m3 import cast_fp8
from jax_mla.merge import combine_splits


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
  """Casts to the output dtype; with ``out_scale``, fp8 e4m3 of ``out / out_scale``
  (saturated to +-448, NaN kept)."""
  if out_scale is None:
    return out.astype(dtype)
  return cast_fp8(out, out_scale)


def finish_parts(out_part: jax.Array, lse_part: jax.Array, attn_sink: jax.Array | None,
                 query_row: jax.Array, num_tokens: int, *, identity: bool, dtype,
                 out_scale) -> jax.Array:
  """A kernel's KV splits to the op's output: ``out_part[P, S, Hq, D]`` (each split
  normalised over its own keys) and natural-log ``lse_part[P, S, Hq]`` (``+inf``: no
  key) are combined with the sink, placed at the sequences' rows
  (:func:`scatter_rows`) and cast (:func:`finish_output`)."""
  if attn_sink is not None:
    # The sink adds exp(sink) to the softmax denominator and nothing to the values: one
    # more part with zero output. A +inf sink (which the combine reads as "no keys")
    # takes all the weight.
    sink = jnp.broadcast_to(attn_sink.astype(jnp.float32), (1, *lse_part.shape[1:]))
    out_part = jnp.concatenate([out_part, jnp.zeros_like(out_part[:1])])
    lse_part = jnp.concatenate([lse_part, sink])
  out, _ = combine_splits(out_part, lse_part)
  if attn_sink is not None:
    out = jnp.where(jnp.isposinf(attn_sink)[None, :, None], 0.0, out)
  out = scatter_rows(out, query_row, num_tokens, identity=identity)
  return finish_output(out, dtype, out_scale)
