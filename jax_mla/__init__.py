"""jax-mla: MLA, sparse MLA and paged attention for JAX on GPUs.

Every op has a pure jax.numpy reference (``implementation="xla"``) and a Pallas
kernel (``implementation="pallas"``); ``None`` picks Pallas on GPU.
"""

from jax_mla._common import FP8_E4M3_MAX, resolve_implementation

__all__ = ["FP8_E4M3_MAX", "resolve_implementation"]
