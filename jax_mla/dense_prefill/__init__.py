"""Dense MLA prefill: varlen MHA with q/k head 192 and v head 128 (flash_attn_varlen_func);
``mla_prefill_token_major`` returns the LSE token-major for ``merge_attn_states``."""

from jax_mla.dense_prefill.api import mla_prefill, mla_prefill_token_major

__all__ = ["mla_prefill", "mla_prefill_token_major"]
