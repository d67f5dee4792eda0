"""``"auto"``: the latents as they are, ``[num_blocks, block_size, head_size]`` in the
activation dtype (bf16: ``[kv_c (512) | k_pe (64)]`` for DeepSeek V3/V3.2)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_mla.cache.layout import Format, check_float


@dataclasses.dataclass(frozen=True)
class Auto(Format):
  name: str = "auto"

  def storage_dtype(self, activation_dtype) -> jnp.dtype:
    return jnp.dtype(activation_dtype)

  def check(self, cache, name: str) -> None:
    check_float(name, cache)

  def decode_rows(self, rows, scale):
    del scale
    return rows

  def encode_rows(self, x, scale, dtype):
    del scale
    return x.astype(dtype)


AUTO = Auto()
