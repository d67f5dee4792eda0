"""Public entry points: sparse MLA prefill and decode (FlashMLA semantics).

Each op validates its arguments (errors name them), resolves the implementation,
its ``Config`` and the cache format once, then calls a private jitted function
that runs the Triton kernel (:mod:`.triton`), the Mosaic GPU kernel
(:mod:`.mosaic`) or the reference (:mod:`.reference`). Internally LSE is
token-major ``[T, h_q]``; FlashMLA's decode layout ``lse[b, h_q, s_q]`` is made here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import _mosaic
from jax_mla._common import (
  D_QK,
  D_QK_V4,
  D_V,
  Implementation,
  as_int32,
  backend_config,
  check_dtype,
  check_one_of,
  check_rank,
  check_shape,
  check_static,
  check_values,
  resolve_implementation,
)
from jax_mla.cache.auto import AUTO
from jax_mla.cache.ds_mla import DS_MLA
from jax_mla.cache.formats import check_cache, resolve
from jax_mla.cache.layout import Format
from jax_mla.cache.model1 import MODEL1
from jax_mla.cache.v41_fp4 import V41_FP4
from jax_mla.cache.v41_fp8 import V41_FP8
from jax_mla.sharding import OpSharding, shape_of
from jax_mla.sparse_mla import (
  backward,
  mosaic,
  mosaic_backward,
  reference,
  triton,
  triton_backward,
)
from jax_mla.sparse_mla.layout import token_lengths

D_QKS = (D_QK, D_QK_V4)
# The formats decode reads.
DECODE_CACHE_DTYPES = tuple(f.name for f in (DS_MLA, MODEL1, V41_FP8, V41_FP4, AUTO))
# (main, extra) cache formats besides a shared one: FlashMLA's V4.1 fp8 main cache with
# an fp4 compressed cache.
EXTRA_FORMAT_PAIRS = ((V41_FP8.name, V41_FP4.name),)


def _check_d_v(d_v) -> None:
  if d_v != D_V:
    raise ValueError(f"d_v must be {D_V} (V = the first 512 latent columns); got {d_v!r}")


def _check_sink(attn_sink, h_q: int) -> None:
  if attn_sink is not None:
    check_dtype("attn_sink", attn_sink, jnp.float32)
    check_shape("attn_sink", attn_sink, (h_q,))


def _lengths(name: str, lengths, size: int):
  if lengths is None:
    return None
  lengths = as_int32(name, lengths)
  check_shape(name, lengths, (size,))
  return lengths


def _check_topk(name: str, indices) -> None:
  if indices.shape[-1] < 1:
    raise ValueError(f"{name} must have topk >= 1; got shape {list(indices.shape)}")


def _decode_indices(name: str, indices, b: int, s_q: int):
  check_rank(name, indices, 3)
  indices = as_int32(name, indices)
  check_shape(name, indices, (b, s_q, None))
  _check_topk(name, indices)
  return indices


def _check_length_values(checks: bool, name: str, lengths, topk: int) -> None:
  if checks and lengths is not None:  # the operands are device work: only when asked
    check_values(checks, ((lengths >= 0) & (lengths <= topk),
                          f"{name} must be in [0, topk = {topk}]; got min {{lo}}, max {{hi}}",
                          dict(lo=jnp.min(lengths), hi=jnp.max(lengths))))


def _sm_scale(sm_scale) -> float:
  check_static("sm_scale", sm_scale)
  return float(sm_scale)


def _implementation(q, implementation: Implementation, interpret: bool,
                    fmts: tuple[Format, ...] = ()) -> str:
  """The kernel to run: Mosaic GPU by default on Hopper for the head counts and cache
  formats (``fmts``) it takes."""
  if implementation == "mosaic":
    mosaic.check_supported(q, fmts)
  impl = resolve_implementation(implementation, interpret, has_mosaic=True, like=q)
  if implementation is None and not interpret and _mosaic.default_for(
      mosaic.check_supported, q, fmts):
    return "mosaic"
  return impl


def _config(config, impl: str, fmt: Format | None, h_q: int):
  """The backend's ``Config``: the user's, or the heuristic; the reference takes none."""
  return backend_config(
      impl, config,
      mosaic=(mosaic.Config, lambda cfg: cfg or mosaic.default_config(fmt, h_q)),
      triton=(triton.Config, lambda cfg: cfg or triton.default_config(decode=fmt is not None)))


def sparse_mla_prefill(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float,
                       d_v: int = 512, attn_sink: jax.Array | None = None,
                       topk_length: jax.Array | None = None,
                       implementation: Implementation = None, interpret: bool = False,
                       config: triton.Config | mosaic.Config | None = None, checks: bool = False):
  """Sparse attention prefill (FlashMLA ``flash_mla_sparse_fwd``).

  Every query token attends to its own ``topk`` key rows of ``kv``, picked by
  ``indices``; all query heads share the one latent KV head (MLA).

  Args:
    q: ``[s_q, h_q, d_qk]`` bf16; ``d_qk`` 576 (DeepSeek V3.2: 512 NoPE + 64 RoPE) or
      512 (DeepSeek V4). Any ``h_q >= 1``.
    kv: ``[s_kv, d_qk]`` or ``[s_kv, 1, d_qk]`` bf16 latent rows; V is the first
      ``d_v`` columns.
    indices: integer (cast to int32) ``[s_q, topk]`` or ``[s_q, 1, topk]``, rows of
      ``kv``. Entries ``< 0`` or ``>= s_kv`` are invalid: masked, never read.
    sm_scale: softmax scale applied to ``q k^T`` (static Python float).
    d_v: value width; must be 512.
    attn_sink: optional float32 ``[h_q]``: the output is multiplied by
      ``exp(lse) / (exp(lse) + exp(attn_sink))``; ``lse`` and ``max_logits`` are
      unchanged; ``+inf`` gives a zero output, ``-inf`` has no effect.
    topk_length: optional integer ``[s_q]``: token ``i`` only uses
      ``indices[i, :topk_length[i]]`` (values are clamped to ``[0, topk]``).
    implementation: ``"triton"`` (old name ``"pallas"``), ``"mosaic"`` (Pallas Mosaic
      GPU, Hopper; any ``h_q``) or ``"xla"`` (reference). ``None`` picks Mosaic GPU on
      a Hopper GPU, else Triton on GPU, else the reference.
    interpret: run the Triton kernel in the Pallas interpreter (CPU tests).
    config: the chosen kernel's tuning, a :class:`jax_mla.sparse_mla.triton.Config` or
      :class:`jax_mla.sparse_mla.mosaic.Config` (``None``: the measured defaults);
      the reference ignores it.
    checks: also check values shapes cannot show (``topk_length`` outside
      ``[0, topk]``); see :func:`jax_mla._common.check_values`.

  Returns:
    ``(out, max_logits, lse)``: ``out`` bf16 ``[s_q, h_q, d_v]``; ``max_logits``
    float32 ``[s_q, h_q]``, the largest ``sm_scale * q k^T`` over valid keys; ``lse``
    float32 ``[s_q, h_q]``, natural-log sum-exp of those scores. A row with no valid
    key gets ``out = 0``, ``max_logits = -inf`` and ``lse = +inf``; a NaN score at a
    valid key (a NaN query, say) gives NaN in all three.

  Differentiable (``jax.grad``) in ``q``, ``kv`` and ``attn_sink`` on every
  implementation; the backward runs the implementation's backward kernels (jax.numpy
  for ``"xla"``; docs/api.md, section 9).
  """
  check_rank("q", q, 3)
  check_dtype("q", q, jnp.bfloat16)
  s_q, h_q, d_qk = q.shape
  check_one_of("q.shape[-1] (d_qk)", d_qk, D_QKS)
  check_rank("kv", kv, (2, 3))
  check_dtype("kv", kv, jnp.bfloat16)
  if kv.ndim == 3:
    check_shape("kv", kv, (None, 1, d_qk))
    kv = kv.reshape(kv.shape[0], d_qk)
  check_shape("kv", kv, (None, d_qk))
  check_rank("indices", indices, (2, 3))
  indices = as_int32("indices", indices)
  if indices.ndim == 3:
    check_shape("indices", indices, (s_q, 1, None))
    indices = indices.reshape(s_q, indices.shape[-1])
  check_shape("indices", indices, (s_q, None))
  _check_topk("indices", indices)
  _check_d_v(d_v)
  _check_sink(attn_sink, h_q)
  topk_length = _lengths("topk_length", topk_length, s_q)
  sm_scale = _sm_scale(sm_scale)
  impl = _implementation(q, implementation, interpret)
  config = _config(config, impl, None, h_q)
  _check_length_values(checks, "topk_length", topk_length, indices.shape[1])
  if s_q == 0:  # no token: nothing to run (a kernel's grid would be empty); zero gradients
    return (jnp.zeros((0, h_q, d_v), jnp.bfloat16), jnp.zeros((0, h_q), jnp.float32),
            jnp.zeros((0, h_q), jnp.float32))
  return _prefill(q, kv, indices, attn_sink, topk_length, sm_scale=sm_scale, d_v=d_v, impl=impl,
                  config=config, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "d_v", "impl", "config", "interpret"))
def _prefill(q, kv, indices, attn_sink, topk_length, *, sm_scale, d_v, impl, config, interpret):
  return _differentiable_prefill((sm_scale, d_v, impl, config, interpret), q, kv, indices,
                                 attn_sink, topk_length)


def _prefill_forward(statics, q, kv, indices, attn_sink, lengths):
  """``lengths``: ``topk_length`` (None: every entry counts; the Mosaic GPU kernel then
  takes the indices as they are, with no XLA pre-pass)."""
  sm_scale, d_v, impl, config, interpret = statics
  if impl != "mosaic":
    lengths = token_lengths(indices, lengths)
  if impl == "xla":
    return reference.sparse_prefill(q, kv, indices, attn_sink, lengths, sm_scale=sm_scale,
                                    d_v=d_v)
  if impl == "mosaic":
    return mosaic.sparse_prefill(q, kv, indices, attn_sink, lengths, sm_scale=sm_scale,
                                 config=config)
  return triton.sparse_prefill(q, kv, indices, attn_sink, lengths, sm_scale=sm_scale, d_v=d_v,
                               config=config, interpret=interpret)


# Every implementation's forward; the backward from the saved out and lse: backward.py
# (XLA) for the reference, the backward kernels for the kernels.
_differentiable_prefill = jax.custom_vjp(_prefill_forward, nondiff_argnums=(0,))


def _prefill_fwd(statics, q, kv, indices, attn_sink, lengths):
  out, max_logits, lse = _prefill_forward(statics, q, kv, indices, attn_sink, lengths)
  return (out, max_logits, lse), (q, kv, indices, attn_sink, lengths, out, lse)


def _prefill_bwd(statics, residuals, cotangents):
  sm_scale, d_v, impl, _, interpret = statics
  q, kv, indices, attn_sink, lengths, out, lse = residuals
  lengths = token_lengths(indices, lengths)
  d_out, _, d_lse = cotangents  # max_logits is treated as a constant
  if impl == "xla":
    dq, dkv, dsink = backward.sparse_prefill_bwd(q, kv, indices, attn_sink, lengths, out, lse,
                                                 d_out, d_lse, sm_scale=sm_scale, d_v=d_v)
    return dq, dkv, None, dsink, None
  # Triton and Mosaic GPU forwards: the Mosaic GPU backward kernel behind a Mosaic GPU
  # forward where it takes the shape, else the Triton ones.
  f, g_out = backward.head_terms(out, lse, d_out, attn_sink)
  args = (q, kv, indices, lengths, d_out.astype(jnp.bfloat16), lse, f, d_lse - f * g_out)
  if impl == "mosaic" and mosaic_backward.supported(q, d_v):
    dq, dkv = mosaic_backward.sparse_prefill_bwd(*args, sm_scale=sm_scale)
  else:
    dq, dkv = triton_backward.sparse_prefill_bwd(
        *args, sm_scale=sm_scale, d_v=d_v, config=triton_backward.Config(), interpret=interpret)
  return dq, dkv.astype(kv.dtype), None, backward.sink_grad(f, g_out, attn_sink), None


_differentiable_prefill.defvjp(_prefill_fwd, _prefill_bwd)


def sparse_mla_decode(q: jax.Array, kv_cache: jax.Array, indices: jax.Array, *,
                      kv_cache_dtype: str = "fp8_ds_mla", sm_scale: float | None = None,
                      d_v: int = 512, attn_sink: jax.Array | None = None,
                      topk_length: jax.Array | None = None,
                      extra_kv_cache: jax.Array | None = None,
                      extra_indices: jax.Array | None = None,
                      extra_topk_length: jax.Array | None = None,
                      extra_kv_cache_dtype: str | None = None,
                      implementation: Implementation = None, interpret: bool = False,
                      config: triton.Config | mosaic.Config | None = None, checks: bool = False):
  """Sparse attention decode on a paged latent cache (FlashMLA ``flash_mla_with_kvcache``
  with ``indices``).

  Args:
    q: ``[b, s_q, h_q, d_qk]`` bf16; ``d_qk`` 576 for ``"fp8_ds_mla"``, 512 for
      ``"fp8_model1"``, ``"fp8_v41"`` and ``"fp4_v41"``, the cache width for ``"auto"``.
    kv_cache: ``[num_blocks, block_size, *]`` cache in format ``kv_cache_dtype``
      (see ``jax_mla.cache``). fp8 rows are dequantized inside the kernel.
    indices: integer (cast to int32) ``[b, s_q, topk]`` global slots ``block *
      block_size + offset`` (no block table). Slots ``< 0`` or ``>= num_blocks *
      block_size`` are invalid: masked, never read.
    kv_cache_dtype: ``"fp8_ds_mla"`` (V3.2), ``"fp8_model1"`` (V4), ``"fp8_v41"`` or
      ``"fp4_v41"`` (V4.1), or ``"auto"`` (bf16).
    sm_scale: softmax scale (static Python float); ``None`` means ``d_qk ** -0.5``.
    d_v: value width; must be 512 (V = the first 512 latent columns).
    attn_sink: optional float32 ``[h_q]``; output times ``exp(lse) / (exp(lse) +
      exp(attn_sink))``, ``lse`` unchanged.
    topk_length: optional integer ``[b]``: batch ``i`` only uses
      ``indices[i, :, :topk_length[i]]``.
    extra_kv_cache, extra_indices, extra_topk_length: an optional second key set
      (its own block size, ``extra_indices[b, s_q, extra_topk]``,
      ``extra_topk_length[b]``) attended in the same softmax as the main one
      (DeepSeek V4: sliding window + compressed cache).
    extra_kv_cache_dtype: format of ``extra_kv_cache``; ``None`` (default) means
      ``kv_cache_dtype``. The one other pair: an ``"fp8_v41"`` main cache with a
      ``"fp4_v41"`` extra cache (FlashMLA's V4.1 pair).
    implementation: ``"triton"`` (old name ``"pallas"``), ``"mosaic"`` (Pallas Mosaic
      GPU, Hopper; any ``h_q``, every format) or ``"xla"`` (reference). ``None`` picks
      Mosaic GPU on a Hopper GPU, else Triton on GPU, else the reference.
    interpret: run the Triton kernel in the Pallas interpreter (CPU tests).
    config: the chosen kernel's tuning (see :func:`sparse_mla_prefill`).
    checks: also check values shapes cannot show (``topk_length`` /
      ``extra_topk_length`` outside ``[0, topk]``).

  Returns:
    ``(out, lse)``: ``out`` bf16 ``[b, s_q, h_q, d_v]``; ``lse`` float32
    ``[b, h_q, s_q]`` natural log over both key sets, ``+inf`` (and ``out = 0``) for a
    query with no valid key, NaN for a NaN score at a valid key.
  """
  check_one_of("kv_cache_dtype", kv_cache_dtype, DECODE_CACHE_DTYPES)
  fmt = resolve(kv_cache_dtype)
  check_rank("q", q, 4)
  check_dtype("q", q, jnp.bfloat16)
  b, s_q, h_q, d_qk = q.shape
  check_cache(kv_cache, fmt)
  if fmt is AUTO:
    check_dtype("kv_cache", kv_cache, jnp.bfloat16)
  want_d = fmt.latent_size(kv_cache)
  if d_qk != want_d or d_qk not in D_QKS:
    raise ValueError(f"q.shape[-1] must be {want_d} for kv_cache_dtype={kv_cache_dtype!r} "
                     f"(576 or 512); got {d_qk}")
  indices = _decode_indices("indices", indices, b, s_q)
  topk_length = _lengths("topk_length", topk_length, b)
  has_extra = extra_kv_cache is not None
  if has_extra != (extra_indices is not None):
    raise ValueError("extra_kv_cache and extra_indices must be given together")
  if extra_topk_length is not None and not has_extra:
    raise ValueError("extra_topk_length needs extra_kv_cache and extra_indices")
  extra_fmt = _extra_format(extra_kv_cache_dtype, kv_cache_dtype, has_extra)
  if has_extra:
    check_cache(extra_kv_cache, extra_fmt or fmt, name="extra_kv_cache")
    check_dtype("extra_kv_cache", extra_kv_cache, kv_cache.dtype)
    if fmt is AUTO:
      check_shape("extra_kv_cache", extra_kv_cache, (None, None, d_qk))
    extra_indices = _decode_indices("extra_indices", extra_indices, b, s_q)
    extra_topk_length = _lengths("extra_topk_length", extra_topk_length, b)
  _check_d_v(d_v)
  _check_sink(attn_sink, h_q)
  sm_scale = d_qk ** -0.5 if sm_scale is None else _sm_scale(sm_scale)
  impl = _implementation(q, implementation, interpret,
                         (fmt,) if extra_fmt is None else (fmt, extra_fmt))
  config = _config(config, impl, fmt, h_q)
  _check_length_values(checks, "topk_length", topk_length, indices.shape[-1])
  if has_extra:
    _check_length_values(checks, "extra_topk_length", extra_topk_length,
                         extra_indices.shape[-1])
  if b * s_q == 0:  # no query token: nothing to run (a kernel's grid would be empty)
    return jnp.zeros((b, s_q, h_q, d_v), jnp.bfloat16), jnp.zeros((b, h_q, s_q), jnp.float32)
  return _decode(q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices,
                 extra_topk_length, attn_sink, fmt=fmt, extra_fmt=extra_fmt, sm_scale=sm_scale,
                 d_v=d_v, impl=impl, config=config, interpret=interpret)


def _extra_format(extra_kv_cache_dtype, kv_cache_dtype: str, has_extra: bool) -> Format | None:
  """The extra cache's format when it is not ``kv_cache_dtype`` (``None`` when it is):
  the other one of an allowed pair."""
  if extra_kv_cache_dtype is None or extra_kv_cache_dtype == kv_cache_dtype:
    return None
  if not has_extra:
    raise ValueError("extra_kv_cache_dtype needs extra_kv_cache and extra_indices")
  check_one_of("extra_kv_cache_dtype", extra_kv_cache_dtype, DECODE_CACHE_DTYPES)
  if (kv_cache_dtype, extra_kv_cache_dtype) not in EXTRA_FORMAT_PAIRS:
    pairs = ", ".join(f"{a!r} with {b!r}" for a, b in EXTRA_FORMAT_PAIRS)
    raise ValueError(f"extra_kv_cache_dtype must be kv_cache_dtype ({kv_cache_dtype!r}) or form "
                     f"one of the pairs (kv_cache_dtype, extra_kv_cache_dtype): {pairs}; got "
                     f"{extra_kv_cache_dtype!r}")
  return resolve(extra_kv_cache_dtype, "extra_kv_cache_dtype")


@functools.partial(jax.jit, static_argnames=("fmt", "extra_fmt", "sm_scale", "d_v", "impl",
                                             "config", "interpret"))
def _decode(q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices, extra_topk_length,
            attn_sink, *, fmt, extra_fmt, sm_scale, d_v, impl, config, interpret):
  b, s_q, h_q, d_qk = q.shape
  tokens = b * s_q

  def flat_set(cache, idx, lengths):
    # Per-batch lengths apply to each of the batch's s_q query tokens (Mosaic GPU reads
    # them per request itself). None (every entry counts) stays None for Mosaic GPU,
    # which then needs no index pre-pass.
    idx = idx.reshape(tokens, idx.shape[-1])
    if impl == "mosaic":
      return cache, idx, lengths
    lengths = token_lengths(idx, None) if lengths is None else jnp.repeat(lengths, s_q)
    return cache, idx, lengths

  sets = [flat_set(kv_cache, indices, topk_length)]
  if extra_kv_cache is not None:
    sets.append(flat_set(extra_kv_cache, extra_indices, extra_topk_length))
  qf = q.reshape(tokens, h_q, d_qk)
  if impl == "mosaic":  # its LSE comes in FlashMLA's decode layout, [b, h_q, s_q]
    fmts = (fmt, extra_fmt or fmt)[:len(sets)]
    out, _, lse = mosaic.sparse_decode(qf, sets, attn_sink, fmts=fmts, sm_scale=sm_scale,
                                       config=config, query_len=s_q)
    return out.reshape(b, s_q, h_q, d_v), lse
  if impl == "xla":
    out, _, lse = reference.sparse_decode(qf, sets, attn_sink, fmt=fmt, sm_scale=sm_scale,
                                          d_v=d_v, extra_fmt=extra_fmt)
  else:
    out, _, lse = triton.sparse_decode(qf, sets, attn_sink, fmt=fmt, sm_scale=sm_scale, d_v=d_v,
                                       config=config, interpret=interpret, extra_fmt=extra_fmt)
  # FlashMLA's decode LSE is [b, h_q, s_q].
  return out.reshape(b, s_q, h_q, d_v), lse.reshape(b, s_q, h_q).transpose(0, 2, 1)


# --- sharding: how jax_mla.sharding splits these ops over devices (see OpSharding) ---------

sparse_mla_prefill.sharding = OpSharding(
    heads=dict(q=1, attn_sink=0), head_outs=(1, 1, 1), num_heads=shape_of("q", 1),
    requests=dict(q=0, kv=0, indices=0, topk_length=0), request_outs=(0, 0, 0),
    rebase=dict(indices=("kv", "rows")), shared=("attn_sink",))
sparse_mla_decode.sharding = OpSharding(
    heads=dict(q=2, attn_sink=0), head_outs=(2, 1), num_heads=shape_of("q", 2),
    requests=dict(q=0, kv_cache=0, indices=0, topk_length=0, extra_kv_cache=0,
                  extra_indices=0, extra_topk_length=0), request_outs=(0, 0),
    rebase=dict(indices=("kv_cache", "slots"), extra_indices=("extra_kv_cache", "slots")),
    shared=("attn_sink",))
