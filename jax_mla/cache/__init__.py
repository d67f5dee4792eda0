"""Paged MLA KV caches: formats, quantization, per-slot reads and the cache writer.

See :mod:`jax_mla.cache.formats` for the byte layouts of ``"auto"``, ``"fp8"``,
``"fp8_ds_mla"`` (DeepSeek V3.2) and ``"fp8_model1"`` (DeepSeek V4).
"""

from jax_mla.cache.formats import (
    KV_CACHE_DTYPES,
    dequantize_fp8_ds_mla,
    dequantize_fp8_model1,
    dequantize_fp8_model1_cache,
    gather_dequantize,
    kv_cache_shape,
    kv_cache_storage_dtype,
    model1_block_bytes,
    quantize_fp8_ds_mla,
    quantize_fp8_model1,
    quantize_fp8_model1_cache,
)
from jax_mla.cache.write import concat_and_cache_mla

__all__ = [
    "KV_CACHE_DTYPES",
    "concat_and_cache_mla",
    "dequantize_fp8_ds_mla",
    "dequantize_fp8_model1",
    "dequantize_fp8_model1_cache",
    "gather_dequantize",
    "kv_cache_shape",
    "kv_cache_storage_dtype",
    "model1_block_bytes",
    "quantize_fp8_ds_mla",
    "quantize_fp8_model1",
    "quantize_fp8_model1_cache",
]
