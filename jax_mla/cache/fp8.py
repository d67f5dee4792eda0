"""``"fp8"``: the ``"auto"`` layout in float8_e4m3fn, ``x / scale`` with one per-tensor
float32 ``scale`` (vLLM's ``fp8`` / ``fp8_e4m3``). The array may be
``float8_e4m3fn`` or ``uint8`` (the same bytes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mla._common import check_dtype
from jax_mla.cache.e4m3 import FP8, cast_fp8
from jax_mla.cache.layout import Format


def as_scale(scale) -> jax.Array:
  """The per-tensor scale as a float32 scalar (``None`` means 1.0)."""
  s = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
  if s.size != 1:
    raise ValueError(f"scale must be a scalar (one per-tensor value); got shape {list(s.shape)}")
  return s.reshape(())


@dataclasses.dataclass(frozen=True)
class Fp8PerTensor(Format):
  name: str = "fp8"

  def storage_dtype(self, activation_dtype) -> jnp.dtype:
    del activation_dtype
    return jnp.dtype(FP8)

  def check(self, cache, name: str) -> None:
    check_dtype(name, cache, (FP8, jnp.uint8))

  def scale_arg(self, scale) -> jax.Array:
    return as_scale(scale)

  def decode_rows(self, rows, scale):
    vals = jax.lax.bitcast_convert_type(rows, FP8) if rows.dtype == jnp.uint8 else rows
    return (vals.astype(jnp.float32) * as_scale(scale)).astype(jnp.bfloat16)

  def encode_rows(self, x, scale, dtype):
    rows = cast_fp8(x, scale)
    return jax.lax.bitcast_convert_type(rows, jnp.uint8) if dtype == jnp.uint8 else rows


FP8_PER_TENSOR = Fp8PerTensor()
