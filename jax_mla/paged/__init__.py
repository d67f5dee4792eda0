"""Paged decode attention (vLLM ``kernel_paged_attention_2d``): reference, Triton kernel
and, for Hopper, a Mosaic GPU kernel."""

from jax_mla.paged.api import paged_attention

__all__ = ["paged_attention"]
