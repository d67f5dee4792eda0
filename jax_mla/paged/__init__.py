"""Paged decode attention (vLLM ``kernel_paged_attention_2d``): reference and Triton kernel."""

from jax_mla.paged.api import paged_attention

__all__ = ["paged_attention"]
