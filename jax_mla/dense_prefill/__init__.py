"""Dense MLA prefill: varlen MHA with q/k head 192 and v head 128 (flash_attn_varlen_func);
``mla_prefill_token_major`` returns the LSE token-major for ``merge_attn_states``.

Modules: ``api`` (entry points), ``reference`` (jax.numpy oracle), ``mosaic`` (Pallas
Mosaic GPU forward, Hopper), ``triton`` (Pallas Triton forward), ``triton_backward`` (the
kernels' backward), ``backward`` (the reference's jax.numpy backward), ``layout``
(packed-token bookkeeping they share)."""

from jax_mla.dense_prefill.api import mla_prefill, mla_prefill_token_major

__all__ = ["mla_prefill", "mla_prefill_token_major"]
