"""KV-cache writer: ``concat_and_cache_mla`` (vLLM's op) for every cache format.

The XLA path quantizes all tokens with the format references and scatters the
rows with ``mode="drop"``; the Pallas path (fp8_ds_mla, fp8_model1) quantizes
and writes in one kernel, in place through ``input_output_aliases``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla._common import check_int32, check_rank, resolve_implementation
from jax_mla.cache import formats as F
from jax_mla.cache.pallas_write import write_quantized_pallas


def _slot_targets(slot_mapping: jax.Array, capacity: int) -> jax.Array:
  # Skipped tokens (slot < 0 or past the cache) scatter to `capacity`, which
  # mode="drop" discards; negative indices would otherwise wrap around.
  valid = (slot_mapping >= 0) & (slot_mapping < capacity)
  return jnp.where(valid, slot_mapping, capacity)


def _write_rows(kv_cache: jax.Array, rows: jax.Array, slot_mapping: jax.Array) -> jax.Array:
  """Scatters one row per token into a cache whose token rows are contiguous."""
  nb, bs, width = kv_cache.shape
  flat = kv_cache.reshape(nb * bs, width)
  flat = flat.at[_slot_targets(slot_mapping, nb * bs)].set(rows, mode="drop")
  return flat.reshape(nb, bs, width)


def _write_model1(kv_cache: jax.Array, x: jax.Array, slot_mapping: jax.Array) -> jax.Array:
  """Reference fp8_model1 write: token data and scales into their block regions."""
  nb, bs, width = kv_cache.shape
  data, scales = F.encode_model1(x)
  target = _slot_targets(slot_mapping, nb * bs)
  block = (target // bs)[:, None]  # == nb for skipped tokens: dropped
  offset = (target % bs)[:, None]
  flat = kv_cache.reshape(nb, bs * width)
  data_cols = offset * F.MODEL1_DATA_BYTES + jnp.arange(F.MODEL1_DATA_BYTES)
  scale_cols = (bs * F.MODEL1_DATA_BYTES + offset * F.MODEL1_SCALE_BYTES
                + jnp.arange(F.MODEL1_SCALE_BYTES))
  flat = flat.at[block, data_cols].set(data, mode="drop")
  flat = flat.at[block, scale_cols].set(scales, mode="drop")
  return flat.reshape(nb, bs, width)


@functools.partial(jax.jit, static_argnames=("kv_cache_dtype", "implementation", "interpret"),
                   donate_argnums=(2,))
def _concat_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale, *, kv_cache_dtype,
                      implementation, interpret):
  num_tokens = slot_mapping.shape[0]
  kv_c, k_pe = kv_c[:num_tokens], k_pe[:num_tokens].astype(kv_c.dtype)
  x = jnp.concatenate([kv_c, k_pe], axis=-1)
  if kv_cache_dtype in ("fp8_ds_mla", "fp8_model1") and implementation == "triton":
    # The kernel quantizes the first 512 columns of its input and stores the
    # RoPE bytes as given: V3.2 reads kv_c itself (no concatenated copy), V4
    # its whole latent.
    nope = kv_c if kv_cache_dtype == "fp8_ds_mla" else x
    return write_quantized_pallas(nope, x[:, -F.ROPE_DIM:], kv_cache, slot_mapping,
                                  kv_cache_dtype=kv_cache_dtype, interpret=interpret)
  if kv_cache_dtype == "fp8_model1":
    return _write_model1(kv_cache, x, slot_mapping)
  if kv_cache_dtype == "fp8_ds_mla":
    rows = F.quantize_fp8_ds_mla(x)
  elif kv_cache_dtype == "fp8":
    rows = F.quantize_fp8_per_tensor(x, scale)
    if kv_cache.dtype == jnp.uint8:
      rows = jax.lax.bitcast_convert_type(rows, jnp.uint8)
  else:
    rows = x.astype(kv_cache.dtype)
  return _write_rows(kv_cache, rows, slot_mapping)


def _check_inputs(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype) -> None:
  F.check_cache(kv_cache, kv_cache_dtype)
  check_rank("kv_c", kv_c, 2)
  check_rank("k_pe", k_pe, 2)
  F.check_float("kv_c", kv_c)
  F.check_float("k_pe", k_pe)
  check_int32("slot_mapping", slot_mapping)
  check_rank("slot_mapping", slot_mapping, 1)
  num_tokens = kv_c.shape[0]
  if k_pe.shape[0] != num_tokens:
    raise ValueError(f"k_pe must have {num_tokens} rows like kv_c; got shape {list(k_pe.shape)}")
  if slot_mapping.shape[0] > num_tokens:
    raise ValueError(f"slot_mapping must have at most {num_tokens} entries (one per token of "
                     f"kv_c); got shape {list(slot_mapping.shape)}")
  widths = (kv_c.shape[1], k_pe.shape[1])
  if kv_cache_dtype == "fp8_ds_mla":
    allowed = [(F.KV_LORA_RANK, F.ROPE_DIM)]
  elif kv_cache_dtype == "fp8_model1":
    # V4 has one 512-wide latent: pass it split (448 | 64) or whole with an empty
    # k_pe, as vLLM's V4 writer takes the whole latent.
    allowed = [(F.MODEL1_NOPE, F.ROPE_DIM), (F.MODEL1_HEAD_SIZE, 0)]
  else:
    if sum(widths) != kv_cache.shape[2]:
      raise ValueError(
          f"kv_c and k_pe widths must add up to the {kv_cache_dtype!r} cache width "
          f"{kv_cache.shape[2]}; got kv_c {list(kv_c.shape)} and k_pe {list(k_pe.shape)}")
    return
  if widths not in allowed:
    want = " or ".join(f"kv_c [T, {a}] with k_pe [T, {b}]" for a, b in allowed)
    raise ValueError(f"{kv_cache_dtype!r} cache needs {want}; "
                     f"got kv_c {list(kv_c.shape)} and k_pe {list(k_pe.shape)}")


def concat_and_cache_mla(kv_c: jax.Array, k_pe: jax.Array, kv_cache: jax.Array,
                         slot_mapping: jax.Array, *, kv_cache_dtype: str = "auto", scale=None,
                         implementation=None, interpret: bool = False) -> jax.Array:
  """Writes each token's latent ``[kv_c | k_pe]`` into the paged MLA cache (vLLM op).

  Token ``t`` goes to slot ``slot_mapping[t]`` = block ``slot // block_size``,
  offset ``slot % block_size``. Tokens whose slot is ``< 0`` (padding) or
  ``>= num_blocks * block_size`` are skipped; every other byte of the cache is
  left as it was. Two tokens with the same slot write in an unspecified order.

  Args:
    kv_c: ``[T, 512]`` compressed latent (``[T, 448]`` NoPE part for
      ``"fp8_model1"``, or the whole ``[T, 512]`` V4 latent with a ``[T, 0]``
      ``k_pe``), bf16/f16/f32.
    k_pe: ``[T, 64]`` RoPE part (already rotated).
    kv_cache: ``[num_blocks, block_size, *]`` cache in format ``kv_cache_dtype``
      (see :mod:`jax_mla.cache.formats`). The buffer is donated: use the returned
      array, not this one, afterwards (the write is in place under jit).
    slot_mapping: int32 ``[S]``, ``S <= T``; tokens past ``S`` are not written
      (vLLM's padded-batch convention).
    kv_cache_dtype: ``"auto"``, ``"fp8"``, ``"fp8_ds_mla"`` or ``"fp8_model1"``.
    scale: per-tensor float32 scale of ``"fp8"`` (default 1.0). Other formats
      carry their own scales and ignore it (vLLM passes one regardless).
    implementation: ``None``, ``"pallas"`` or ``"xla"``. The Pallas kernel covers
      ``"fp8_ds_mla"`` and ``"fp8_model1"``; ``"auto"``/``"fp8"`` writes are a
      plain XLA scatter on every path.
    interpret: run the Pallas kernel in the interpreter (CPU tests).

  Returns:
    The updated cache, same shape and dtype as ``kv_cache``.
  """
  _check_inputs(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype)
  implementation = resolve_implementation(implementation, interpret)
  scale = F.as_scale(scale) if kv_cache_dtype == "fp8" else jnp.float32(1.0)
  return _concat_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale,
                           kv_cache_dtype=kv_cache_dtype, implementation=implementation,
                           interpret=interpret)
