"""jax-mla: MLA, sparse MLA and paged attention for JAX on GPUs.

Every op has a pure jax.numpy reference (``implementation="xla"``) and a Pallas
Triton kernel (``implementation="triton"``; ``"pallas"`` is its old name), some a
Pallas Mosaic GPU kernel for Hopper (``"mosaic"``); ``None`` picks by JAX's default
backend (Mosaic GPU on Hopper where the op has a kernel for the shapes, else Triton on
a GPU, else the reference). Layer-level backends (``FlashMLASparse``, ``AiterMLA``,
``DeepseekV4Sparse``) live in :mod:`jax_mla.backends`, the ``shard_map`` wrappers
(``head_parallel``, ``request_parallel``) in :mod:`jax_mla.sharding`, the KV-cache
formats in :mod:`jax_mla.cache`.
"""

from jax_mla._common import FP8_E4M3_MAX
from jax_mla.cache import (
    concat_and_cache_mla,
    dequantize_fp4_v41,
    dequantize_fp8_ds_mla,
    dequantize_fp8_model1,
    dequantize_fp8_v41,
    kv_cache_shape,
    quantize_fp4_v41,
    quantize_fp8_ds_mla,
    quantize_fp8_model1,
    quantize_fp8_v41,
)
from jax_mla.dense_decode import mla_decode, mla_decode_paged, mla_ragged_paged_attention
from jax_mla.dense_prefill import mla_prefill
from jax_mla.indexing import (
    convert_req_index_to_global_index,
    expand_page_indices,
    filter_prefill_indices,
    req_id_per_token,
)
from jax_mla.l2_fetch import l2_fetch_granularity, set_l2_fetch_granularity
from jax_mla.merge import lse2_to_lse, merge_attn_states
from jax_mla.paged import paged_attention
from jax_mla.sparse_mla import sparse_mla_decode, sparse_mla_prefill

__version__ = "0.1.0"

__all__ = [
    "FP8_E4M3_MAX", "concat_and_cache_mla", "convert_req_index_to_global_index",
    "dequantize_fp4_v41", "dequantize_fp8_ds_mla", "dequantize_fp8_model1", "dequantize_fp8_v41",
    "expand_page_indices", "filter_prefill_indices", "kv_cache_shape", "l2_fetch_granularity",
    "lse2_to_lse", "merge_attn_states", "mla_decode", "mla_decode_paged", "mla_prefill",
    "mla_ragged_paged_attention", "paged_attention", "quantize_fp4_v41", "quantize_fp8_ds_mla",
    "quantize_fp8_model1", "quantize_fp8_v41", "req_id_per_token", "set_l2_fetch_granularity",
    "sparse_mla_decode", "sparse_mla_prefill",
]
