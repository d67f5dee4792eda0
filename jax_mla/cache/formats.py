"""The registry of MLA KV-cache formats: ``kv_cache_dtype`` -> its :class:`Format`.

``"auto"`` (:mod:`~jax_mla.cache.auto`), ``"fp8"`` (:mod:`~jax_mla.cache.fp8`),
``"fp8_ds_mla"`` (DeepSeek V3.2, :mod:`~jax_mla.cache.ds_mla`), ``"fp8_model1"``
(DeepSeek V4, :mod:`~jax_mla.cache.model1`), ``"fp8_v41"`` and ``"fp4_v41"``
(DeepSeek V4.1, :mod:`~jax_mla.cache.v41_fp8`, :mod:`~jax_mla.cache.v41_fp4`); each
module holds its byte layout and XLA codec, and the fp8 / fp4 arithmetic they share
is :mod:`~jax_mla.cache.e4m3` / :mod:`~jax_mla.cache.e2m1`.
Public ops resolve the string once (:func:`resolve`) and hand the format object
down; a new format is one new module added to :data:`FORMATS`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla._common import D_QK, as_int32, check_one_of, check_rank
from jax_mla.cache.auto import AUTO
from jax_mla.cache.ds_mla import DS_MLA
from jax_mla.cache.fp8 import FP8_PER_TENSOR
from jax_mla.cache.layout import Format
from jax_mla.cache.model1 import MODEL1
from jax_mla.cache.v41_fp4 import V41_FP4
from jax_mla.cache.v41_fp8 import V41_FP8

FORMATS: dict[str, Format] = {
    f.name: f for f in (AUTO, FP8_PER_TENSOR, DS_MLA, MODEL1, V41_FP8, V41_FP4)}
KV_CACHE_DTYPES = tuple(FORMATS)


def resolve(kv_cache_dtype: str, name: str = "kv_cache_dtype") -> Format:
  """The format named ``kv_cache_dtype``; ``ValueError`` naming ``name`` otherwise."""
  check_one_of(name, kv_cache_dtype, KV_CACHE_DTYPES)
  return FORMATS[kv_cache_dtype]


def check_cache(kv_cache, fmt: Format, name: str = "kv_cache") -> None:
  """Validates a cache array against its format (rank, dtype, last dimension)."""
  check_rank(name, kv_cache, 3)
  fmt.check(kv_cache, name)


def kv_cache_shape(num_blocks: int, block_size: int, head_size: int = D_QK,
                   cache_dtype: str = "auto") -> tuple[int, int, int]:
  """Shape of an MLA KV cache (vLLM ``get_kv_cache_shape``).

  Args:
    num_blocks: number of cache blocks.
    block_size: tokens per block.
    head_size: latent width: 576 for DeepSeek V3/V3.2 (``"fp8_ds_mla"`` needs 576),
      512 for DeepSeek V4 / V4.1 (``"fp8_model1"``, ``"fp8_v41"`` and ``"fp4_v41"``
      need 512); any width for ``"auto"``/``"fp8"``.
    cache_dtype: one of :data:`KV_CACHE_DTYPES`.

  Returns:
    ``(num_blocks, block_size, last_dim)``; allocate it with
    :func:`kv_cache_storage_dtype`.
  """
  fmt = resolve(cache_dtype, "cache_dtype")
  if num_blocks < 1 or block_size < 1 or head_size < 1:
    raise ValueError("num_blocks, block_size and head_size must be >= 1; got "
                     f"{num_blocks}, {block_size}, {head_size}")
  return fmt.shape(num_blocks, block_size, head_size)


def kv_cache_storage_dtype(cache_dtype: str = "auto", activation_dtype=jnp.bfloat16):
  """Array dtype of a cache in format ``cache_dtype`` (``"auto"`` stores activations as is)."""
  return resolve(cache_dtype, "cache_dtype").storage_dtype(activation_dtype)


def gather_dequantize(kv_cache: jax.Array, slots: jax.Array, *, kv_cache_dtype: str,
                      scale=None) -> jax.Array:
  """Reads and dequantizes the latents at global slots, for any cache format.

  Args:
    kv_cache: ``[num_blocks, block_size, *]`` cache in format ``kv_cache_dtype``.
    slots: integer array (cast to int32), any shape; ``slot = block * block_size +
      offset``. Slots outside ``[0, num_blocks * block_size)`` are clamped into range
      (so the result there is some other slot's data, possibly NaN): callers mask them.
    kv_cache_dtype: one of :data:`KV_CACHE_DTYPES`.
    scale: per-tensor float32 scale of ``"fp8"`` (default 1.0); unused otherwise.

  Returns:
    ``[*slots.shape, d]`` with ``d = 576`` (``"fp8_ds_mla"``), 512 (``"fp8_model1"``,
    ``"fp8_v41"``, ``"fp4_v41"``) or ``head_size`` (``"auto"``/``"fp8"``); bf16, except
    ``"auto"`` which keeps the cache dtype.
  """
  fmt = resolve(kv_cache_dtype)
  check_cache(kv_cache, fmt)
  slots = as_int32("slots", slots)
  return _gather_dequantize(kv_cache, slots, fmt.scale_arg(scale), fmt=fmt)


@functools.partial(jax.jit, static_argnames=("fmt",))
def _gather_dequantize(kv_cache, slots, scale, *, fmt: Format):
  return fmt.gather_dequantize(kv_cache, slots, scale)
