# jax-mla developer entry points. Each works as the first command on a fresh clone.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# The project's python: the venv where there is one, else $(PY) (a GPU machine's own
# python with jax[cuda] and torch).
RUN_PY = $(if $(wildcard $(VPY)),$(VPY),$(PY))
# torch for the bridge tests. This machine's pip finds the CPU wheel of this version in its
# local wheel folder; elsewhere see README ("The torch bridge") for the CPU wheel index.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test test-gpu demo bench bench-smoke lint clean

# The package alone (what the demo needs).
$(VENV)/.package: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e .
	touch $@

# Everything the CPU suite, the bridge and the linter need.
$(VENV)/.installed: $(VENV)/.package
	$(VPY) -m pip install -q "$(TORCH_CPU)"
	$(VPY) -m pip install -q -e ".[test,lint]"
	touch $@

install: $(VENV)/.installed

# One DeepSeek-V3.2-style layer step, every kernel checked (on the CPU: in the interpreter).
demo: $(VENV)/.package
	$(VPY) -m jax_mla.demo

# CPU suite: Pallas kernels run in interpret mode against the jax.numpy references.
test: install
	JAX_PLATFORMS=cpu $(VPY) -m pytest -q -n 2 tests

# GPU suite: the same tests compiled for the GPU, plus the @pytest.mark.gpu ones; the
# cpu_only tests (references against numpy, input validation) are skipped there. Compiling
# dominates, so GPU_WORKERS processes share the one GPU (no memory preallocation; each
# file stays in one process so its shared compiles happen once). Compiled programs persist
# in .jax_cache/ (tests/conftest.py), so a second run skips most compiles.
# The bridge runs in a process of its own (torch and JAX share the GPU); its CPU-tensor
# tests run too: on a GPU machine `implementation=None` decides by where tensors live.
GPU_WORKERS ?= 4
GPU_PYTEST = JAX_MLA_REQUIRE_GPU=1 PYTHONPATH=$(CURDIR) $(if $(filter-out 1,$(GPU_WORKERS)),\
  XLA_PYTHON_CLIENT_PREALLOCATE=false) $(RUN_PY) -m pytest -q \
  $(if $(filter-out 1,$(GPU_WORKERS)),-n $(GPU_WORKERS) --dist loadfile)
test-gpu:
	$(GPU_PYTEST) tests --ignore=tests/test_torch_bridge.py
	$(GPU_PYTEST) tests/test_torch_bridge.py

# GPU benchmarks: every benchmarks/bench_*.py, a per-module time budget, under 10 minutes.
bench:
	@PYTHONPATH=$(CURDIR) $(RUN_PY) -m benchmarks.run --out benchmarks/out

# Every benchmark module on tiny shapes on the CPU: checks the harness, not the speed.
bench-smoke: install
	PYTHONPATH=$(CURDIR) $(VPY) -m benchmarks.run --smoke --out benchmarks/out/smoke

lint: install
	$(VENV)/bin/ruff check jax_mla torch_bridge tests benchmarks examples

clean:
	rm -rf $(VENV) benchmarks/out .pytest_cache .jax_cache
