"""Dense MLA decode (AITER, FlashMLA and tpu-inference conventions) over one split-KV Triton
kernel; ``mla_decode_paged`` also has a Mosaic GPU kernel for Hopper."""

from jax_mla.dense_decode.api import mla_decode, mla_decode_paged, mla_ragged_paged_attention

__all__ = ["mla_decode", "mla_decode_paged", "mla_ragged_paged_attention"]
