"""KV-cache writer: ``concat_and_cache_mla`` (vLLM's op) for every cache format.

The XLA path quantizes all tokens with the format's codec and scatters the rows
with ``mode="drop"``; the kernels quantize and write in one pass, in place through
``input_output_aliases``: Mosaic GPU on Hopper (every format, bf16 input; auto (bf16)
and fp8 for DeepSeek's 512 + 64 latent), Triton elsewhere (fp8_ds_mla, fp8_model1,
fp8_v41, fp4_v41).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import _mosaic
from jax_mla._common import (
  Implementation,
  as_int32,
  check_config,
  check_rank,
  check_values,
  resolve_implementation,
)
from jax_mla.cache import mosaic, triton
from jax_mla.cache.formats import check_cache, resolve
from jax_mla.cache.layout import Format, TileScaled, check_float


def _write(kv_c, k_pe, kv_cache, slot_mapping, scale, *, fmt: Format, kernel: str, config,
           interpret):
  if slot_mapping.shape[0] == 0:  # nothing to write (and no kernel grid is empty)
    return kv_cache
  if kernel == "mosaic":  # reads the first S rows itself: no slice, no concatenated copy
    return mosaic.write(kv_c, k_pe, kv_cache, slot_mapping, scale, fmt=fmt)
  num_tokens = slot_mapping.shape[0]
  kv_c, k_pe = kv_c[:num_tokens], k_pe[:num_tokens].astype(kv_c.dtype)
  x = jnp.concatenate([kv_c, k_pe], axis=-1)
  if kernel == "xla":
    return fmt.write(kv_cache, x, slot_mapping, scale)
  # The kernel quantizes the leading columns of its input and stores the RoPE bytes
  # as given: V3.2 reads kv_c itself (no concatenated copy), V4 its whole latent;
  # V4.1 quantizes its whole latent, RoPE included.
  num_tiles, tile = triton.tiles(fmt)
  quantized = kv_c if kv_c.shape[1] >= num_tiles * tile else x
  rope = None if isinstance(fmt, TileScaled) else x[:, -fmt.rope:]
  return triton.write_quantized(quantized, rope, kv_cache, slot_mapping, fmt=fmt,
                                config=config, interpret=interpret)


_STATIC = ("fmt", "kernel", "config", "interpret")
_concat_and_cache = jax.jit(_write, static_argnames=_STATIC)
# The caller asked to give its buffer up: the write is in place even outside a jit.
_concat_and_cache_donated = jax.jit(_write, static_argnames=_STATIC, donate_argnums=(2,))


def token_writes(kv_c: jax.Array, k_pe: jax.Array, kv_cache: jax.Array,
                 slot_mapping: jax.Array, *, kv_cache_dtype: str = "auto", scale=None):
  """What :func:`concat_and_cache_mla` writes, for a caller that writes it itself into
  memory JAX does not own (the torch bridge's in-place write): only the new tokens'
  bytes, never the cache.

  Same arguments as :func:`concat_and_cache_mla`. Returns ``(block[S], position[S],
  rows)`` (int32; ``S = len(slot_mapping)``): token ``t``'s bytes go to block
  ``block[t]``, in-block position ``position[t]``, ``rows[r][t]`` at region ``r`` of
  the format (``Format.token_regions``). A skipped token (slot < 0 or past the cache) repeats
  the first written token's target and bytes, or, when no token is written, rewrites
  slot 0's current bytes: every target may be written without a host-side filter.
  """
  fmt = resolve(kv_cache_dtype)
  slot_mapping = as_int32("slot_mapping", slot_mapping)
  _check_inputs(kv_c, k_pe, kv_cache, slot_mapping, fmt)
  return _token_writes(kv_c, k_pe, kv_cache, slot_mapping, fmt.scale_arg(scale), fmt=fmt)


@functools.partial(jax.jit, static_argnames=("fmt",))
def _token_writes(kv_c, k_pe, kv_cache, slot_mapping, scale, *, fmt: Format):
  num_blocks, block_size, width = kv_cache.shape
  n = slot_mapping.shape[0]
  if n == 0:  # nothing to write (and no first written token to repeat)
    none = jnp.zeros((0,), jnp.int32)
    return none, none, tuple(jnp.zeros((0, length), kv_cache.dtype)
                             for _, length in fmt.token_regions(block_size, width))
  x = jnp.concatenate([kv_c[:n], k_pe[:n].astype(kv_c.dtype)], axis=-1)
  ok = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
  first = jnp.argmax(ok)
  any_ok = jnp.any(ok)
  target = jnp.where(ok, slot_mapping, jnp.where(any_ok, slot_mapping[first], 0))
  blocks = kv_cache.reshape(num_blocks, block_size * width)
  rows = []
  for (offset, length), r in zip(fmt.token_regions(block_size, width),
                                 fmt.encode_regions(x, scale, kv_cache.dtype), strict=True):
    fill = jnp.where(any_ok, r[first], blocks[0, offset:offset + length])
    rows.append(jnp.where(ok[:, None], r, fill[None]))
  return target // block_size, target % block_size, tuple(rows)


def _check_inputs(kv_c, k_pe, kv_cache, slot_mapping, fmt: Format) -> None:
  check_cache(kv_cache, fmt)
  check_rank("kv_c", kv_c, 2)
  check_rank("k_pe", k_pe, 2)
  check_float("kv_c", kv_c)
  check_float("k_pe", k_pe)
  check_rank("slot_mapping", slot_mapping, 1)
  num_tokens = kv_c.shape[0]
  if k_pe.shape[0] != num_tokens:
    raise ValueError(f"k_pe must have {num_tokens} rows like kv_c; got shape {list(k_pe.shape)}")
  if slot_mapping.shape[0] > num_tokens:
    raise ValueError(f"slot_mapping must have at most {num_tokens} entries (one per token of "
                     f"kv_c); got shape {list(slot_mapping.shape)}")
  widths = (kv_c.shape[1], k_pe.shape[1])
  allowed = fmt.input_widths()
  if allowed is None:
    if sum(widths) != kv_cache.shape[2]:
      raise ValueError(
          f"kv_c and k_pe widths must add up to the {fmt.name!r} cache width "
          f"{kv_cache.shape[2]}; got kv_c {list(kv_c.shape)} and k_pe {list(k_pe.shape)}")
    return
  if widths not in allowed:
    want = " or ".join(f"kv_c [T, {a}] with k_pe [T, {b}]" for a, b in allowed)
    raise ValueError(f"{fmt.name!r} cache needs {want}; "
                     f"got kv_c {list(kv_c.shape)} and k_pe {list(k_pe.shape)}")


def concat_and_cache_mla(kv_c: jax.Array, k_pe: jax.Array, kv_cache: jax.Array,
                         slot_mapping: jax.Array, *, kv_cache_dtype: str = "auto", scale=None,
                         implementation: Implementation = None, interpret: bool = False,
                         config: triton.Config | None = None, donate: bool = False,
                         checks: bool = False) -> jax.Array:
  """Writes each token's latent ``[kv_c | k_pe]`` into the paged MLA cache (vLLM op).

  Token ``t`` goes to slot ``slot_mapping[t]`` = block ``slot // block_size``,
  offset ``slot % block_size``. Tokens whose slot is ``< 0`` (padding) or
  ``>= num_blocks * block_size`` are skipped; every other byte of the cache is
  left as it was. Two tokens with the same slot write in an unspecified order.

  Args:
    kv_c: ``[T, 512]`` compressed latent (``[T, 448]`` NoPE part for
      ``"fp8_model1"``, ``"fp8_v41"`` and ``"fp4_v41"``, or their whole ``[T, 512]``
      latent with a ``[T, 0]`` ``k_pe``), bf16/f16/f32. NaN values are stored as NaN
      and do not change the scale of their tile (the CUDA writers' rule), except in
      the V4.1 formats, where a NaN or an infinity poisons its tile (FlashMLA's
      quantizer; see :mod:`jax_mla.cache.v41_fp8`).
    k_pe: ``[T, 64]`` RoPE part (already rotated).
    kv_cache: ``[num_blocks, block_size, *]`` cache in format ``kv_cache_dtype``
      (see :mod:`jax_mla.cache.formats`). Use the returned array afterwards. Under
      ``jax.jit`` the write is in place when the jitted function donates the cache;
      an eager call leaves ``kv_cache`` as it was (a copy is written) unless
      ``donate=True``.
    slot_mapping: integer ``[S]`` (cast to int32), ``S <= T``; tokens past ``S`` are
      not written (vLLM's padded-batch convention).
    kv_cache_dtype: ``"auto"``, ``"fp8"``, ``"fp8_ds_mla"``, ``"fp8_model1"``,
      ``"fp8_v41"`` or ``"fp4_v41"``.
    scale: per-tensor float32 scale of ``"fp8"`` (default 1.0). Other formats
      carry their own scales and ignore it (vLLM passes one regardless).
    implementation: ``None``, ``"mosaic"``, ``"triton"`` (old name ``"pallas"``) or
      ``"xla"``. The Mosaic GPU kernel (Hopper) writes ``"fp8_ds_mla"``,
      ``"fp8_model1"``, ``"fp8_v41"``, ``"fp4_v41"``, and ``"auto"`` (a bf16 cache) and
      ``"fp8"`` from ``kv_c [T, 512]`` and ``k_pe [T, 64]``, all from bf16 ``kv_c`` and
      ``k_pe``; ``None`` picks it there. The Triton kernel covers ``"fp8_ds_mla"``,
      ``"fp8_model1"``, ``"fp8_v41"`` and ``"fp4_v41"``; other ``"auto"``/``"fp8"``
      writes are a plain XLA scatter.
    interpret: run the Triton kernel in the interpreter (CPU tests).
    config: a :class:`jax_mla.cache.triton.Config` for the Triton kernel (``None``:
      the default); ignored where no kernel runs.
    donate: give ``kv_cache``'s buffer to the write in an eager call (in place; the
      caller's array is deleted). Inside ``jax.jit`` it changes nothing.
    checks: also check values shapes cannot show (``slot_mapping`` entries past the
      cache); see :func:`jax_mla._common.check_values`.

  Returns:
    The updated cache, same shape and dtype as ``kv_cache``.
  """
  fmt = resolve(kv_cache_dtype)
  slot_mapping = as_int32("slot_mapping", slot_mapping)
  _check_inputs(kv_c, k_pe, kv_cache, slot_mapping, fmt)
  if implementation == "mosaic":
    mosaic.check_supported(kv_c, k_pe, kv_cache, fmt)
  kernel = resolve_implementation(implementation, interpret, has_mosaic=True, like=kv_cache)
  config = check_config(config, triton.Config, kernel)
  if implementation is None and kernel == "triton" and not interpret and _mosaic.default_for(
      mosaic.check_supported, kv_c, k_pe, kv_cache, fmt):
    kernel = "mosaic"
  if kernel == "triton" and not triton.supports(fmt):
    kernel = "xla"  # "auto" / "fp8": a plain scatter
  config = (config or triton.default_config()) if kernel == "triton" else None
  capacity = kv_cache.shape[0] * kv_cache.shape[1]
  if checks:  # the operands are device work: build them only when asked
    check_values(checks, (slot_mapping < capacity,
                          f"slot_mapping must be < num_blocks * block_size = {capacity} "
                          "(negative skips a token); got max {got}",
                          dict(got=jnp.max(slot_mapping, initial=-1))))
  write = _concat_and_cache_donated if donate else _concat_and_cache
  return write(kv_c, k_pe, kv_cache, slot_mapping, fmt.scale_arg(scale), fmt=fmt, kernel=kernel,
               config=config, interpret=interpret)
