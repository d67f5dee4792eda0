"""Sparse MLA (DeepSeek V3.2 / V4 / V4.1): top-k gathered attention, FlashMLA semantics.

``sparse_mla_prefill`` attends each query token to its own ``topk`` rows of a bf16
latent array; ``sparse_mla_decode`` does the same on a paged cache (``"fp8_ds_mla"``,
``"fp8_model1"``, ``"fp8_v41"``, ``"fp4_v41"`` or bf16), with an optional extra key
set in the same softmax.

Modules: :mod:`.api` (the public ops), :mod:`.reference` (the jax.numpy oracle),
:mod:`.triton` and :mod:`.mosaic` (the kernels, each with its ``Config``),
:mod:`.backward` (the prefill backward in jax.numpy), :mod:`.triton_backward` and
:mod:`.mosaic_backward` (its Triton and Mosaic GPU kernels), and :mod:`.layout` (index
plumbing the reference and the kernels share).
"""

from jax_mla.sparse_mla.api import sparse_mla_decode, sparse_mla_prefill

__all__ = ["sparse_mla_decode", "sparse_mla_prefill"]
