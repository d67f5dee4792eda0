"""Layer-level attention backends: functional versions of vLLM's MLA backends.

Metadata are pytree dataclasses built once a step by a builder and shared by every
layer; forwards are pure jitted functions of (inputs, cache, metadata, weights)
that return the output and the updated cache. One class per backend, named as in
vLLM, gathers its entry points and shows a whole step (``help(FlashMLASparse)``):

- :class:`FlashMLASparse` (vLLM ``FLASHMLA_SPARSE``, DeepSeek V3.2 sparse MLA),
- :class:`AiterMLA` (vLLM ``ROCM_AITER_MLA``, dense MLA),
- :class:`DeepseekV4Sparse` (vLLM ``ROCM_AITER_MLA_SPARSE_DSV4``, DeepSeek V4).

:func:`split_decodes_and_prefills` counts the decodes at the front of a batch.
"""

from jax_mla.backends._batch import split_decodes_and_prefills
from jax_mla.backends.aiter_mla import AiterMLA
from jax_mla.backends.deepseek_v4 import DeepseekV4Sparse
from jax_mla.backends.flashmla_sparse import FlashMLASparse

__all__ = ["AiterMLA", "DeepseekV4Sparse", "FlashMLASparse", "split_decodes_and_prefills"]
