"""Index conversion and metadata helpers (vLLM FlashMLASparse and AiterMLA seeds)."""

from jax_mla.indexing.api import (
    convert_req_index_to_global_index,
    expand_page_indices,
    filter_prefill_indices,
    req_id_per_token,
)

__all__ = [
    "convert_req_index_to_global_index", "expand_page_indices", "filter_prefill_indices",
    "req_id_per_token",
]
