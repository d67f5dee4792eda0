"""Public entry point: ``paged_attention`` (vLLM ``kernel_paged_attention_2d`` semantics).

vLLM's argument names (``scale``, ``sinks``, ``block_tables``) stop here; inside they
are ``sm_scale``, ``attn_sink`` and ``block_table`` as in every other op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import _mosaic
from jax_mla._common import (
  Implementation,
  as_int32,
  backend_config,
  check_dtype,
  check_num_splits,
  check_rank,
  check_shape,
  check_values,
  resolve_implementation,
)
from jax_mla.indexing.metadata import block_table_checks
from jax_mla.paged import mosaic, triton
from jax_mla.paged.layout import key_view, value_view
from jax_mla.paged.reference import paged_attention_xla
from jax_mla.sharding import OpSharding, shape_of

_QUERY_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def _value_is_dim_major(key_cache, value_cache, head_dim: int, block_size: int) -> bool:
  """True for V ``[nb, Hkv, D, bs]``, False for ``[nb, Hkv, bs, D]``.

  Read from V's shape; when ``D == bs`` both read alike and V follows K: a 5-D
  (vLLM) key cache pairs with the dim-major value cache as in vLLM, a 4-D
  token-major key cache with a token-major value cache.
  """
  tail = tuple(value_cache.shape[2:])
  if head_dim == block_size:
    return key_cache.ndim == 5
  if tail == (head_dim, block_size):
    return True
  if tail == (block_size, head_dim):
    return False
  raise ValueError(
      f"value_cache must have shape [nb, Hkv, {head_dim}, {block_size}] or "
      f"[nb, Hkv, {block_size}, {head_dim}] (head size {head_dim}, block size {block_size}); "
      f"got {list(value_cache.shape)}")


def _check_scalar(name, x):
  if x is not None and jnp.ndim(x) != 0:
    raise ValueError(f"{name} must be a scalar; got shape {jnp.shape(x)}")


@functools.partial(
    jax.jit, static_argnames=("sliding_window", "config", "interpret", "has_out_scale",
                              "static_scales"))
def _paged_attention(query, key_cache, value_cache, block_table, seq_lens, sm_scale, k_scale,
                     v_scale, attn_sink, alibi_slopes, query_start_loc, out_scale, *,
                     sliding_window, config, interpret, has_out_scale, static_scales=None):
  if static_scales is not None:  # Python numbers (the traced ones are None): the Mosaic
    sm_scale, k_scale, v_scale = static_scales  # kernel takes them as constants
  head_dim = query.shape[2]
  kv = key_view(key_cache)
  block_size = kv.data.shape[3]
  vv = value_view(value_cache, _value_is_dim_major(key_cache, value_cache, head_dim, block_size))
  kwargs = dict(sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, attn_sink=attn_sink,
                alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                query_start_loc=query_start_loc, out_scale=out_scale if has_out_scale else None)
  if config is None:
    return paged_attention_xla(query, kv, vv, block_table, seq_lens, **kwargs)
  if isinstance(config, mosaic.Config):
    return mosaic.paged_attention_mosaic(query, kv, vv, block_table, seq_lens, config=config,
                                         **kwargs)
  return triton.paged_attention_triton(query, kv, vv, block_table, seq_lens, config=config,
                                       interpret=interpret, **kwargs)


def paged_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float | jax.Array,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    sinks: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    sliding_window: int = 0,
    query_start_loc: jax.Array | None = None,
    out_scale: float | jax.Array | None = None,
    physical_block_size: int | None = None,
    num_kv_splits: int | None = None,
    config: triton.Config | mosaic.Config | None = None,
    checks: bool = False,
    implementation: Implementation = None,
    interpret: bool = False,
) -> jax.Array:
  """Paged decode attention over a vLLM-style block cache (one query token per sequence).

  Args:
    query: ``[T, Hq, D]`` bf16/f16/f32. Without ``query_start_loc``, row ``s`` is
      the query of sequence ``s`` (``T == S``).
    key_cache: ``[nb, Hkv, D // x, bs, x]`` (vLLM) or ``[nb, Hkv, bs, D]``; the
      query dtype, or fp8 (``float8_e4m3fn``/``float8_e5m2``) read as ``k_scale * k``.
    value_cache: ``[nb, Hkv, D, bs]`` (vLLM) or ``[nb, Hkv, bs, D]``, same dtype as
      the key cache. The layout is read from the shape; when ``D == bs`` a 5-D key
      cache means ``[nb, Hkv, D, bs]`` and a 4-D one ``[nb, Hkv, bs, D]``.
    block_tables: ``[S, max_blocks]`` integer (any integer dtype, cast to int32):
      physical block of each logical block. Ids outside ``[0, nb)`` are masked (never
      read).
    seq_lens: ``[S]`` integer: keys ``0 .. seq_len - 1`` are attended; slots at or
      past ``seq_len`` are never read (they may hold NaN). Negative lengths count as 0.
    scale: softmax scale applied to ``q . k`` (float or float32 scalar).
    k_scale, v_scale: per-tensor dequantisation scales of fp8 caches (scalars).
    sinks: optional ``[Hq]`` attention-sink logits: ``exp(sink)`` joins the softmax
      denominator (seed: initial max ``sink``, initial sum 1). ``+inf`` gives 0.
    alibi_slopes: optional float32 ``[Hq]``: adds ``slope * (pos - (seq_len - 1))``.
    sliding_window: static; if > 0 only keys with ``seq_len - 1 - pos < window``.
      (The seed gives keys outside the window the score -10000; here they are
      excluded, the same result unless every in-window score is below -10000.)
    query_start_loc: optional integer ``[S + 1]`` token offsets of a mixed batch.
      Only sequences with exactly one query token are computed (at row
      ``query_start_loc[s]``); rows of other sequences (prefill) and rows that
      belong to no sequence are returned as 0 (the seed leaves them untouched).
    out_scale: if given, the output is ``float8_e4m3fn(clip(out / out_scale, ±448))``.
    physical_block_size: static; tokens per cache block. Defaults to the cache's
      block dimension and must equal it when given (vLLM passes it for blocks
      such as 544 that are not a power of two; any size works here).
    num_kv_splits: static; programs per (sequence, kv head) along the sequence
      (replaces ``config.num_splits`` when given). ``None`` picks enough to fill the GPU.
    config: ``None`` (the heuristic), a :class:`jax_mla.paged.triton.Config` (Triton) or
      a :class:`jax_mla.paged.mosaic.Config` (Mosaic GPU), matching the implementation.
    checks: also check values (eager raise; under ``jax.jit`` wrap the call in
      ``checkify.checkify``): ``0 <= seq_lens <= max_blocks * block_size`` and the
      block ids each sequence uses inside ``[0, nb)``.
    implementation: ``"mosaic"`` (Pallas Mosaic GPU, Hopper: caches in vLLM's layout,
      bf16/fp16 with head sizes a multiple of 32 or fp8 with a multiple of 64, up to
      256, blocks a multiple of 16; see
      :func:`jax_mla.paged.mosaic.check_supported`),
      ``"triton"`` (old name ``"pallas"``) or ``"xla"`` (the reference). ``None``:
      Mosaic GPU on Hopper where it takes the inputs, else Triton on a GPU, else the
      reference.
    interpret: run the Triton kernel in the Pallas interpreter (CPU tests).

  Returns:
    ``[T, Hq, D]`` in the query dtype, or ``float8_e4m3fn`` with ``out_scale``.
    A sequence with no valid key (``seq_len == 0``) gives 0.
  """
  if implementation == "mosaic":
    mosaic.check_supported(query, key_cache, value_cache)
  impl = resolve_implementation(implementation, interpret, has_mosaic=True, like=query)
  check_rank("query", query, 3)
  check_dtype("query", query, _QUERY_DTYPES)
  check_rank("key_cache", key_cache, (4, 5))
  check_rank("value_cache", value_cache, 4)
  check_dtype("key_cache", key_cache, (query.dtype, *_FP8_DTYPES))
  check_dtype("value_cache", value_cache, key_cache.dtype)
  t, hq, head_dim = query.shape
  nb, hkv = key_cache.shape[:2]
  if key_cache.ndim == 5:
    block_size = key_cache.shape[3]
    k_dim = key_cache.shape[2] * key_cache.shape[4]
  else:
    block_size, k_dim = key_cache.shape[2:]
  if k_dim != head_dim:
    raise ValueError(f"key_cache head size must equal query's {head_dim}; got {k_dim} "
                     f"from shape {list(key_cache.shape)}")
  check_shape("value_cache", value_cache, (nb, hkv, None, None))
  _value_is_dim_major(key_cache, value_cache, head_dim, block_size)
  if hkv == 0 or hq % hkv:
    raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
  block_tables = as_int32("block_tables", block_tables)
  check_rank("block_tables", block_tables, 2)
  num_seqs = block_tables.shape[0]
  seq_lens = as_int32("seq_lens", seq_lens)
  check_shape("seq_lens", seq_lens, (num_seqs,))
  if query_start_loc is None:
    if t != num_seqs:
      raise ValueError(f"without query_start_loc, query must have one row per sequence "
                       f"({num_seqs}); got {t}")
  else:
    query_start_loc = as_int32("query_start_loc", query_start_loc)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
  for name, x in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
    if x is not None:
      check_shape(name, x, (hq,))
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")
  for name, x in (("scale", scale), ("k_scale", k_scale), ("v_scale", v_scale),
                  ("out_scale", out_scale)):
    _check_scalar(name, x)
  if not isinstance(sliding_window, int) or sliding_window < 0:
    raise ValueError(f"sliding_window must be an int >= 0; got {sliding_window!r}")
  if physical_block_size is not None and physical_block_size != block_size:
    raise ValueError(f"physical_block_size must equal the cache block size {block_size}; "
                     f"got {physical_block_size}")
  check_num_splits("num_kv_splits", num_kv_splits)
  if checks:
    check_values(True, *block_table_checks(block_tables, seq_lens, block_size=block_size,
                                           num_blocks=nb, table_name="block_tables"))
  if num_seqs == 0:  # no sequence: every token belongs to none (0); no kernel to run
    return jnp.zeros((t, hq, head_dim), query.dtype if out_scale is None else jnp.float8_e4m3fn)
  if implementation is None and impl == "triton" and not interpret and _mosaic.default_for(
      mosaic.check_supported, query, key_cache, value_cache):
    impl = "mosaic"
  max_tokens = block_tables.shape[1] * block_size
  itemsize = jnp.dtype(key_cache.dtype).itemsize
  mosaic_defaults = functools.partial(
      mosaic.with_defaults, num_kv_splits=num_kv_splits, num_seqs=num_seqs, num_kv_heads=hkv,
      group=hq // hkv, max_tokens=max_tokens, cache_itemsize=itemsize, head_dim=head_dim)
  triton_defaults = functools.partial(
      triton.with_defaults, num_kv_splits=num_kv_splits, fp8_cache=itemsize == 1,
      head_dim=head_dim, num_seqs=num_seqs, num_kv_heads=hkv, max_tokens=max_tokens,
      interpret=interpret)
  config = backend_config(impl, config, mosaic=(mosaic.Config, mosaic_defaults),
                          triton=(triton.Config, triton_defaults))
  # With Python-number scales the Mosaic GPU program is kernels alone (the torch bridge
  # launches it directly); each distinct value compiles once.
  numbers = all(isinstance(x, (int, float)) for x in (scale, k_scale, v_scale))
  static_scales = ((float(scale), float(k_scale), float(v_scale))
                   if numbers and isinstance(config, mosaic.Config) else None)
  if static_scales is not None:  # not passed twice: no traced copies
    scale = k_scale = v_scale = None
  return _paged_attention(
      query, key_cache, value_cache, block_tables, seq_lens, scale, k_scale, v_scale, sinks,
      alibi_slopes, query_start_loc, 1.0 if out_scale is None else out_scale,
      sliding_window=sliding_window, config=config, interpret=interpret,
      has_out_scale=out_scale is not None, static_scales=static_scales)


# --- sharding: how jax_mla.sharding splits this op over devices (see OpSharding) -----------

# Heads are counted in KV heads: query head i reads KV head i // (Hq // Hkv), so the
# query, sink and ALiBi head axes hold Hkv groups of Hq // Hkv, KV heads outermost,
# and a device gets whole groups. query_start_loc is ragged: requests only stacked.
paged_attention.sharding = OpSharding(
    heads=dict(query=1, key_cache=1, value_cache=1, sinks=0, alibi_slopes=0), head_outs=1,
    num_heads=shape_of("key_cache", 1),
    shared=("scale", "k_scale", "v_scale", "sinks", "alibi_slopes", "out_scale"))
