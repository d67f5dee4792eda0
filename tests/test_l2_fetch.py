"""jax_mla.set_l2_fetch_granularity: its checks everywhere, the setting on a CUDA GPU."""

import numpy as np
import pytest
from sparse_cases import decode_inputs

import jax_mla


@pytest.mark.parametrize("nbytes", [0, 16, 48, 256, 32.0, "32", True])
def test_refuses_other_sizes(nbytes):
  with pytest.raises(ValueError, match="nbytes must be one of"):
    jax_mla.set_l2_fetch_granularity(nbytes)


@pytest.mark.cpu_only
def test_refuses_a_cpu():
  with pytest.raises(RuntimeError, match="is not a CUDA GPU"):
    jax_mla.set_l2_fetch_granularity(32)
  with pytest.raises(RuntimeError, match="is not a CUDA GPU"):
    jax_mla.l2_fetch_granularity()


@pytest.mark.gpu
def test_sets_reads_back_and_leaves_results_alone():
  """The limit reads back as set, and the fp8 sparse decode (the gather it is for, 16
  heads) gives bit-equal results under 32 and 64 bytes."""
  case = ("fp8_ds_mla", 3, 2, 16, 200, 11, 64, True, True, None)
  q, cache, idx, kw, _ = decode_inputs(7, case)
  outs = {}
  first = jax_mla.set_l2_fetch_granularity(64)
  try:
    for nbytes in (64, 32, 128):
      previous = jax_mla.set_l2_fetch_granularity(nbytes)
      assert all(v in (32, 64, 128) for v in previous.values())
      assert jax_mla.l2_fetch_granularity() == nbytes
      outs[nbytes] = [np.asarray(x) for x in jax_mla.sparse_mla_decode(q, cache, idx, **kw)]
  finally:
    for device, nbytes in first.items():
      jax_mla.set_l2_fetch_granularity(nbytes, [device])
  assert jax_mla.l2_fetch_granularity() == next(iter(first.values()))
  for nbytes in (32, 128):
    for got, ref in zip(outs[nbytes], outs[64], strict=True):
      np.testing.assert_array_equal(got, ref)
