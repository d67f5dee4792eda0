"""Shared test setup: the `gpu` marker and the `interpret` fixture."""

import jax
import pytest
from helpers import has_gpu

jax.config.update("jax_enable_x64", False)


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make test-gpu` on the device machine")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def interpret() -> bool:
  """Pallas kernels compile on a GPU and run in the interpreter elsewhere."""
  return not has_gpu()

