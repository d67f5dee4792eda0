"""Paged MLA KV caches: formats, quantization, per-slot reads and the cache writer.

Each format is one module holding its byte layout and codec (:mod:`.auto`,
:mod:`.fp8`, :mod:`.ds_mla` for DeepSeek V3.2's ``"fp8_ds_mla"``, :mod:`.model1` for
DeepSeek V4's ``"fp8_model1"``, :mod:`.v41_fp8` and :mod:`.v41_fp4` for DeepSeek
V4.1's ``"fp8_v41"`` and ``"fp4_v41"``); :mod:`.formats` is the registry that
resolves a ``kv_cache_dtype`` string into that layout object.
"""

from jax_mla.cache.api import concat_and_cache_mla
from jax_mla.cache.ds_mla import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from jax_mla.cache.formats import (
  KV_CACHE_DTYPES,
  gather_dequantize,
  kv_cache_shape,
  kv_cache_storage_dtype,
)
from jax_mla.cache.model1 import (
  dequantize_fp8_model1,
  dequantize_fp8_model1_cache,
  model1_block_bytes,
  quantize_fp8_model1,
  quantize_fp8_model1_cache,
)
from jax_mla.cache.v41_fp4 import dequantize_fp4_v41, quantize_fp4_v41
from jax_mla.cache.v41_fp8 import dequantize_fp8_v41, quantize_fp8_v41

__all__ = [
  "KV_CACHE_DTYPES",
  "concat_and_cache_mla",
  "dequantize_fp4_v41",
  "dequantize_fp8_ds_mla",
  "dequantize_fp8_model1",
  "dequantize_fp8_model1_cache",
  "dequantize_fp8_v41",
  "gather_dequantize",
  "kv_cache_shape",
  "kv_cache_storage_dtype",
  "model1_block_bytes",
  "quantize_fp4_v41",
  "quantize_fp8_ds_mla",
  "quantize_fp8_model1",
  "quantize_fp8_model1_cache",
  "quantize_fp8_v41",
]
