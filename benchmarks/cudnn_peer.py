"""cuDNN frontend's DeepSeek sparse attention (DSA) backward beside jax-mla's.

Where ``cudnn.deepseek_sparse_attention`` (pip ``nvidia-cudnn-frontend`` >= 1.32 with
``nvidia-cutlass-dsl[cu13]``; a CuTe DSL kernel with a torch interface, sm90 and sm100)
imports on a CUDA machine, ``bench_sparse_mla_grad`` times each row's backward for both
libraries in one process: cuDNN reads our arrays through DLPack without a copy, takes
our forward's ``out`` and ``lse`` (natural log, the sink left out: the same convention
as its own forward's), its gradients are compared with ours, then both are timed by
``benchmarks.harness.time_calls_us``. Nothing of cuDNN is in this repository.
"""

from __future__ import annotations

import importlib

NAME = "cuDNN DSA backward (same run)"


def load():
  """The ``cudnn.deepseek_sparse_attention`` module, or None where it (or a CUDA torch)
  is missing."""
  try:
    import torch
    if not torch.cuda.is_available():
      return None
    dsa = importlib.import_module("cudnn.deepseek_sparse_attention")
    dsa.SparseAttentionBackward  # noqa: B018  (the lazy import that needs CuTe DSL)
    return dsa
  except (ImportError, OSError):  # OSError: a CuTe DSL runtime library that won't load
    return None


def sparse_backward(dsa, q, kv, indices, out, lse, d_out, attn_sink, sm_scale):
  """A zero-argument cuDNN backward call on our arrays: ``q [s_q, h_q, d_qk]``,
  ``kv [s_kv, d_qk]`` (keys and values share rows), global ``indices [s_q, topk]``,
  the forward's ``out``/``lse`` and the cotangent ``d_out``. It returns
  ``(dq, dkv, d_sink)`` as torch tensors; the outputs and the workspace are allocated
  once here, so the timed call allocates nothing."""
  import torch

  from torch_bridge import to_torch

  q_t, kv_t, idx_t, out_t, lse_t, g_t, sink_t = (
      to_torch(a) for a in (q, kv, indices, out, lse, d_out, attn_sink))
  plan = dsa.SparseAttentionBackward(q_t, kv_t, out_t, g_t, lse_t, sink_t, idx_t,
                                     softmax_scale=sm_scale)
  assert plan.check_support()
  plan.compile()
  dq, dkv = torch.empty_like(q_t), torch.empty_like(kv_t)
  d_sink = torch.empty_like(sink_t)
  workspace = torch.empty(plan.scratch_workspace_bytes(), dtype=torch.uint8,
                          device=q_t.device)

  def call():
    return plan.execute(q_t, kv_t, out_t, g_t, lse_t, sink_t, idx_t, dq, dkv,
                        workspace=workspace, d_sink=d_sink)
  return call
