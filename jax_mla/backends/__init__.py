"""Layer-level attention backends: functional versions of vLLM's MLA backends.

Metadata are pytree dataclasses built by a builder; forwards are pure jitted
functions of (inputs, cache, metadata, weights) that return the output and the
updated cache. Each backend is also gathered under the vLLM backend's name:

- ``FlashMLASparse`` (vLLM ``flashmla_sparse``, DeepSeek V3.2),
- ``AiterMLA`` (vLLM ``rocm_aiter_mla``, dense MLA),
- ``DeepseekV4Sparse`` (vLLM ``rocm_aiter_mla_sparse_dsv4``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from jax_mla.backends import aiter_mla, deepseek_v4, flashmla_sparse


class Backend(NamedTuple):
  """One backend's entry points: its static config type, its metadata builder and its forward."""
  name: str
  config: type
  build_metadata: Callable[..., Any]
  forward: Callable[..., Any]
  kv_cache_dtypes: tuple[str, ...]


FlashMLASparse = Backend(
    "FLASHMLA_SPARSE", flashmla_sparse.FlashMLASparseConfig,
    flashmla_sparse.build_flashmla_sparse_metadata, flashmla_sparse.flashmla_sparse_forward,
    flashmla_sparse.KV_CACHE_DTYPES)
AiterMLA = Backend(
    "ROCM_AITER_MLA", aiter_mla.AiterMLAConfig,
    # vLLM's builder is an object configured once (block size, workspace) whose
    # build() runs each step; the same here.
    aiter_mla.AiterMLAMetadataBuilder, aiter_mla.aiter_mla_forward, ("auto", "fp8"))
DeepseekV4Sparse = Backend(
    "ROCM_AITER_MLA_SPARSE_DSV4", deepseek_v4.DeepseekV4Config,
    deepseek_v4.build_deepseek_v4_metadata, deepseek_v4.deepseek_v4_sparse_forward,
    ("fp8_model1",))

__all__ = ["AiterMLA", "Backend", "DeepseekV4Sparse", "FlashMLASparse", "aiter_mla", "deepseek_v4",
           "flashmla_sparse"]
