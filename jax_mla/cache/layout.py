"""What every cache format is: the :class:`Format` interface and the byte plumbing
the format modules share.

A cache holds one latent vector per token slot; slot ``s`` lives in block
``s // block_size`` at offset ``s % block_size`` (``block_size = cache.shape[1]``
for every format). Each format module (``auto``, ``fp8``, ``ds_mla``, ``model1``,
``v41_fp8``, ``v41_fp4``) defines one frozen :class:`Format` object holding its layout
(offsets, tiles, scale encoding, block padding) and its XLA codec; the Triton writer
(:mod:`jax_mla.cache.triton`), the sparse MLA kernels and the torch bridge read
the same object. :func:`jax_mla.cache.formats.resolve` turns a ``kv_cache_dtype``
string into it, once, at the public boundary.

The base class describes a format that stores one row of ``head_size`` values per
token (``"auto"``, ``"fp8"``); the packed fp8 formats override what differs, and
:class:`TileScaled` is the row ``[quantized latent | scale bytes]`` of DeepSeek V4.1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mla._common import D_QK_V4, D_ROPE, check_dtype, check_shape


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

  def token_regions(self, block_size: int, width: int) -> tuple[tuple[int, int], ...]:
    """Where a token's bytes live in its block, as ``(offset, length)`` per region in
    cache elements: token ``j`` of a block has region ``r`` at ``offset_r + j *
    length_r``. One region, the whole ``width``-wide row, unless a format splits it."""
    del block_size
    return ((0, width),)

  def encode_regions(self, x: jax.Array, scale: jax.Array, dtype) -> tuple[jax.Array, ...]:
    """Latents -> one ``[..., length]`` array per region of :meth:`token_regions`."""
    return (self.encode_rows(x, scale, dtype),)


@dataclasses.dataclass(frozen=True)
class TileScaled(Format):
  """A token row ``[quantized latent | one scale byte per tile]`` with the whole latent
  quantized, RoPE included (DeepSeek V4.1: ``"fp8_v41"``, ``"fp4_v41"``). Rows are
  contiguous, one per slot, no block padding. Subclasses give the codec of a tile.

  Attributes:
    head_size: latent width (448 NoPE + 64 RoPE).
    rope: RoPE columns at the end of the latent (only for the writer's ``kv_c`` /
      ``k_pe`` split: they are quantized like the rest).
    tile: values per scale byte.
    bits: bits per quantized value; with 4, byte ``i`` holds value ``2i`` in its low
      nibble and ``2i + 1`` in its high one.
  """
  head_size: int = D_QK_V4
  rope: int = D_ROPE
  tile: int = 32
  bits: int = 8

  @property
  def num_tiles(self) -> int:
    return self.head_size // self.tile

  @property
  def data_bytes(self) -> int:  # the quantized values; the scales follow
    return self.head_size * self.bits // 8

  @property
  def token_bytes(self) -> int:
    return self.data_bytes + self.num_tiles

  def row_width(self, block_size: int, head_size: int) -> int:
    del block_size, head_size
    return self.token_bytes

  def input_widths(self):
    # One latent, passed split (448 | 64) or whole with an empty k_pe (as fp8_model1).
    return ((self.head_size - self.rope, self.rope), (self.head_size, 0))

  def quantize_tiles(self, tiles: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 ``[..., tile]`` -> (int32 value codes ``[..., tile]``, int32 scale bytes
    ``[...]``), shared by the XLA codec and the Triton writer."""
    raise NotImplementedError

  def decode_values(self, codes: jax.Array) -> jax.Array:
    """int32 value codes -> their float32 values (unscaled), exact."""
    raise NotImplementedError

  def decode_scales(self, codes: jax.Array) -> jax.Array:
    """int32 scale bytes -> float32 scales, exact."""
    raise NotImplementedError

  def pack(self, codes: jax.Array) -> jax.Array:
    """int32 value codes ``[..., n]`` -> their bytes uint8 ``[..., n * bits / 8]``."""
    if self.bits == 8:
      return codes.astype(jnp.uint8)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    shift = 4 * jax.lax.broadcasted_iota(jnp.int32, pairs.shape, pairs.ndim - 1)
    return jnp.sum(jax.lax.shift_left(pairs, shift), axis=-1).astype(jnp.uint8)

  def unpack(self, data: jax.Array) -> jax.Array:
    """Inverse of :meth:`pack`: uint8 ``[..., k]`` -> int32 value codes."""
    b = data.astype(jnp.int32)
    if self.bits == 8:
      return b
    pairs = jnp.stack([b & 0xF, jax.lax.shift_right_logical(b, 4)], axis=-1)
    return pairs.reshape(*b.shape[:-1], 2 * b.shape[-1])

  def encode(self, x: jax.Array) -> jax.Array:
    """Latents ``[..., head_size]`` (float) -> token rows uint8 ``[..., token_bytes]``."""
    tiles = x.astype(jnp.float32).reshape(*x.shape[:-1], self.num_tiles, self.tile)
    codes, scales = self.quantize_tiles(tiles)
    data = self.pack(codes.reshape(*x.shape[:-1], self.head_size))
    return jnp.concatenate([data, scales.astype(jnp.uint8)], axis=-1)

  def decode_rows(self, rows, scale=None):
    """Token rows ``[..., token_bytes]`` -> bf16 latents: value times its tile's scale
    in float32, rounded once to bf16 (exact: both factors have short significands)."""
    del scale
    vals = self.decode_values(self.unpack(rows[..., :self.data_bytes]))
    scales = self.decode_scales(rows[..., self.data_bytes:].astype(jnp.int32))
    vals = vals.reshape(*rows.shape[:-1], self.num_tiles, self.tile) * scales[..., None]
    return vals.reshape(*rows.shape[:-1], self.head_size).astype(jnp.bfloat16)

  def encode_rows(self, x, scale, dtype):
    del scale, dtype
    return self.encode(x)
