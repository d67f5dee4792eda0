"""Shared test setup: the `gpu` and `cpu_only` markers, the `interpret` fixture and, on
a GPU, the persistent compilation cache and no matmul autotuning."""

import os
import pathlib

import jax
import pytest
from helpers import has_gpu

jax.config.update("jax_enable_x64", False)

# XLA:GPU autotunes each matmul of the references while compiling them (several trial
# compiles per dot); the tests check results, not speed, so the default algorithms do.
# Read when the backend starts (after this), on CPU ignored; a user's own setting wins.
if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()

CACHE_DIR = pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"


def pytest_configure(config):
  # The pytest-xdist controller runs no test: it leaves the GPU to the workers, except to
  # stop `make test-gpu` at once on a machine without one.
  controller = config.getoption("numprocesses", None) and not hasattr(config, "workerinput")
  require_gpu = os.environ.get("JAX_MLA_REQUIRE_GPU")  # set by `make test-gpu`
  if controller and not require_gpu:
    return
  if not has_gpu():
    if require_gpu:
      pytest.exit(f"make test-gpu needs a GPU; JAX found only {jax.devices()}", returncode=1)
    return
  if controller:
    return
  # GPU compilations take most of the GPU suite's time; a later run (or another pytest
  # process) reuses them. Every entry is kept, however fast it compiled or small it is.
  CACHE_DIR.mkdir(exist_ok=True)
  (CACHE_DIR / ".gitignore").write_text("*\n")  # never committed
  jax.config.update("jax_compilation_cache_dir", str(CACHE_DIR))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    # The GPU suite is about compiled kernels; reference-only tests ran on the CPU suite.
    skip = pytest.mark.skip(reason="cpu_only: the CPU suite covers it")
    marker = "cpu_only"
  else:
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make test-gpu` on the device machine")
    marker = "gpu"
  for item in items:
    if marker in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def interpret() -> bool:
  """Pallas kernels compile on a GPU and run in the interpreter elsewhere."""
  return not has_gpu()
