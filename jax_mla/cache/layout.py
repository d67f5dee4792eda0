"""What every cache format is: the :class:`Format` interface and the byte plumbing
the format modules share.

A cache holds one latent vector per token slot; slot ``s`` lives in block
``s // block_size`` at offset ``s % block_size`` (``block_size = cache.shape[1]``
for every format). Each format module (``auto``, ``fp8``, ``ds_mla``, ``model1``)
defines one frozen :class:`Format` object holding its layout (offsets, tiles,
scale encoding, block padding) and its XLA codec; the Triton writer
(:mod:`jax_mla.cache.triton`), the sparse MLA kernels and the torch bridge read
the same object. :func:`jax_mla.cache.formats.resolve` turns a ``kv_cache_dtype``
string into it, once, at the public boundary.

The base class describes a format that stores one row of ``head_size`` values per
token (``"auto"``, ``"fp8"``); the packed fp8 formats override what differs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mla._common import check_dtype, check_shape


def check_float(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize < 2:
    raise TypeError(f"{name} must have dtype bfloat16, float16 or float32; got {x.dtype}")


def check_last(name: str, x, size: int) -> None:
  if x.ndim < 1 or x.shape[-1] != size:
    raise ValueError(f"{name} must have shape [..., {size}]; got {list(x.shape)}")


def to_bytes(x: jax.Array) -> jax.Array:
  """Little-endian bytes of ``x`` along the last axis: ``[..., n] -> [..., n * itemsize]``."""
  b = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return b.reshape(*x.shape[:-1], -1)


def from_bytes(b: jax.Array, dtype) -> jax.Array:
  """Inverse of :func:`to_bytes`: uint8 ``[..., n * itemsize] -> [..., n]`` of ``dtype``."""
  size = jnp.dtype(dtype).itemsize
  return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, size), dtype)


def slot_targets(slot_mapping: jax.Array, capacity: int) -> jax.Array:
  """Scatter targets of a write: skipped tokens (slot < 0 or past the cache) go to
  ``capacity``, which ``mode="drop"`` discards; negative indices would otherwise wrap."""
  valid = (slot_mapping >= 0) & (slot_mapping < capacity)
  return jnp.where(valid, slot_mapping, capacity)


def write_rows(kv_cache: jax.Array, rows: jax.Array, slot_mapping: jax.Array) -> jax.Array:
  """Scatters one row per token into a cache whose token rows are contiguous."""
  nb, bs, width = kv_cache.shape
  flat = kv_cache.reshape(nb * bs, width)
  flat = flat.at[slot_targets(slot_mapping, nb * bs)].set(rows, mode="drop")
  return flat.reshape(nb, bs, width)


@dataclasses.dataclass(frozen=True)
class Format:
  """A KV-cache format (``kv_cache_dtype``): its layout and its XLA codec.

  Attributes:
    name: the ``kv_cache_dtype`` string.
  """
  name: str

  @property
  def head_size(self) -> int | None:
    """Width of the latents it stores (dequantized); ``None``: any width (a cache row
    is the latent itself)."""
    return None

  def shape(self, num_blocks: int, block_size: int, head_size: int) -> tuple[int, int, int]:
    """``(num_blocks, block_size, last_dim)`` of a cache holding ``head_size``-wide latents."""
    if self.head_size is not None and head_size != self.head_size:
      raise ValueError(f"head_size must be {self.head_size} for {self.name!r}; got {head_size}")
    return (num_blocks, block_size, self.row_width(block_size, head_size))

  def row_width(self, block_size: int, head_size: int) -> int:
    """The cache's last dimension."""
    del block_size
    return head_size

  def storage_dtype(self, activation_dtype) -> jnp.dtype:
    """Array dtype of the cache."""
    del activation_dtype
    return jnp.dtype(jnp.uint8)

  def check(self, cache, name: str) -> None:
    """Validates a rank-3 cache array: dtype and last dimension."""
    check_dtype(name, cache, jnp.uint8)
    check_shape(name, cache, (None, None, self.row_width(cache.shape[1], self.head_size)))

  def scale_arg(self, scale) -> jax.Array:
    """The per-tensor ``scale`` argument as the codec takes it (a float32 scalar). The
    formats other than ``"fp8"`` carry their own scales and ignore it (vLLM passes one
    regardless)."""
    del scale
    return jnp.float32(1.0)

  def latent_size(self, cache) -> int:
    """Width of the latents ``cache`` holds."""
    return cache.shape[-1] if self.head_size is None else self.head_size

  def input_widths(self) -> tuple[tuple[int, int], ...] | None:
    """The ``(kv_c, k_pe)`` widths the writer takes; ``None``: any pair adding up to
    the cache width."""
    return None

  def gather_dequantize(self, kv_cache: jax.Array, slots: jax.Array,
                        scale: jax.Array | None = None) -> jax.Array:
    """XLA read of the latents at ``slots`` (int32, any shape; clamped into range, so
    callers mask the slots outside it). ``scale``: see :meth:`scale_arg`."""
    nb, bs, width = kv_cache.shape
    rows = kv_cache.reshape(nb * bs, width)[jnp.clip(slots, 0, nb * bs - 1)]
    return self.decode_rows(rows, scale)

  def decode_rows(self, rows: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Contiguous token rows ``[..., width]`` -> latents (bf16; ``"auto"`` keeps its dtype)."""
    raise NotImplementedError

  def write(self, kv_cache: jax.Array, x: jax.Array, slot_mapping: jax.Array,
            scale: jax.Array) -> jax.Array:
    """XLA write of latents ``x[S, head_size]`` at ``slot_mapping[S]`` (the reference
    writer; skipped slots, see :func:`slot_targets`)."""
    return write_rows(kv_cache, self.encode_rows(x, scale, kv_cache.dtype), slot_mapping)

  def encode_rows(self, x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Latents ``[..., head_size]`` -> token rows of array dtype ``dtype``."""
    raise NotImplementedError
