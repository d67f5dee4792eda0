"""``implementation=None`` picks by where the op's arrays live (``_common.op_platform``).

The CPU machine pretends to be a GPU machine (``jax.default_backend`` patched to "gpu"):
arrays on the CPU must still run the reference there, not a GPU kernel, which would fail
with "Only interpret mode is supported on CPU backend" (torch CPU tensors handed to the
bridge on a GPU machine did). Traced arrays follow ``jax.default_device``, else the
default backend.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla import _common, paged
from jax_mla.sparse_mla import sparse_mla_prefill

pytestmark = pytest.mark.cpu_only


@pytest.fixture
def gpu_machine(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def test_concrete_arrays_decide(gpu_machine):
  x = jnp.zeros((2, 3))
  assert _common.op_platform(x) == "cpu"
  assert _common.resolve_implementation(None, like=x) == "xla"
  assert _common.resolve_implementation(None) == "triton"  # no array: the default backend
  with pytest.raises(ValueError, match="needs a GPU .*'cpu'"):
    _common.resolve_implementation("triton", like=x)


def test_traced_arrays_follow_default_device(gpu_machine):
  seen = []

  @jax.jit
  def f(x):
    seen.append(_common.resolve_implementation(None, like=x))
    return x

  f(jnp.zeros(3))
  with jax.default_device(jax.devices("cpu")[0]):
    f(jnp.zeros(3))  # default_device is in jit's cache key: a new trace
  assert seen == ["triton", "xla"]


def test_ops_on_cpu_arrays_run_the_reference(gpu_machine):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((3, 16, 576)), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((40, 576)), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(-1, 40, (3, 64)), jnp.int32)
  out = sparse_mla_prefill(q, kv, idx, sm_scale=0.04)[0]
  ref = sparse_mla_prefill(q, kv, idx, sm_scale=0.04, implementation="xla")[0]
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
  query = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.bfloat16)
  cache = jnp.asarray(rng.standard_normal((4, 2, 16, 64)), jnp.bfloat16)
  got = paged.paged_attention(query, cache, cache, jnp.asarray([[0, 1], [2, 3]], jnp.int32),
                              jnp.asarray([5, 20], jnp.int32), scale=0.1)
  assert got.shape == query.shape


def test_bridge_cpu_tensors(gpu_machine):
  torch = pytest.importorskip("torch")
  from torch_bridge import ops
  rng = np.random.default_rng(1)
  q = torch.from_numpy(rng.standard_normal((3, 16, 576)).astype(np.float32)).bfloat16()
  kv = torch.from_numpy(rng.standard_normal((40, 576)).astype(np.float32)).bfloat16()
  idx = torch.from_numpy(rng.integers(-1, 40, (3, 64)).astype(np.int32))
  out = ops.sparse_mla_prefill(q, kv, idx, sm_scale=0.04)[0]
  ref = sparse_mla_prefill(jnp.asarray(q.float().numpy(), jnp.bfloat16),
                           jnp.asarray(kv.float().numpy(), jnp.bfloat16), jnp.asarray(idx.numpy()),
                           sm_scale=0.04, implementation="xla")[0]
  np.testing.assert_array_equal(out.float().numpy(), np.asarray(ref, np.float32))
