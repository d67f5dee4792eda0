"""torch bridge for jax-mla: zero-copy DLPack interop and torch-callable ops.

* ``to_jax(t)`` / ``to_torch(a)``: share memory both ways (CPU and CUDA), with
  torch's current stream and JAX's stream ordered correctly.
* ``torch_bridge.ops``: every jax_mla op taking and returning torch tensors, plus
  FlashMLA-compatible drop-ins (``flash_mla_sparse_fwd``,
  ``flash_mla_with_kvcache``, ``get_mla_metadata``).
* ``set_direct_launch(enabled)``: on CUDA, ops whose program is Mosaic GPU kernels
  plus views launch those kernels on torch's stream without PJRT (the default; see
  ``torch_bridge.ops.torch_op``); off, every call goes through PJRT.
* ``torch_bridge.flashmla`` / ``torch_bridge.aiter``: the installed FlashMLA
  (CUDA) or AITER (ROCm) kernels called on jax.Array inputs, with jax_mla's
  argument conventions, for one-to-one comparisons.

Needs PyTorch: ``pip install "jax-mla[torch]"`` (CPU-only machines: ``pip install
torch --index-url https://download.pytorch.org/whl/cpu`` first, which avoids the
CUDA wheels).
"""

try:
  import torch  # noqa: F401  (checked first, so that a missing torch names the extra)
except ImportError as e:
  raise ImportError(
      f"torch_bridge needs PyTorch, which could not be imported ({e}). Install the extra: "
      'pip install "jax-mla[torch]"; for a CPU-only machine take the CPU wheel first '
      "(no CUDA libraries): pip install torch --index-url "
      "https://download.pytorch.org/whl/cpu") from e

from torch_bridge._direct import set_enabled as set_direct_launch  # noqa: E402
from torch_bridge._interop import to_jax, to_torch  # noqa: E402

__all__ = ["set_direct_launch", "to_jax", "to_torch"]
