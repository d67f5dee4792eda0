# jax-mla developer entry points. `make test` works on a fresh machine.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# CPU torch for the bridge tests (a CPU wheel; the GPU machine brings its own torch).
TORCH_CPU ?= torch==2.13.0

.PHONY: install test test-gpu demo bench lint clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[test,lint]" "$(TORCH_CPU)"
	touch $@

install: $(VENV)/.installed

# CPU suite: Pallas kernels run in interpret mode against the jax.numpy references.
test: install
	JAX_PLATFORMS=cpu $(VPY) -m pytest -q -n 2 tests

# GPU suite (device machine, its own python with jax[cuda] and torch): the same tests
# compiled for the GPU, plus the @pytest.mark.gpu ones. The bridge's CPU-tensor tests
# stay on the CPU suite: on a GPU machine `implementation=None` picks Pallas for them.
test-gpu:
	PYTHONPATH=$(CURDIR) $(PY) -m pytest -q tests --ignore=tests/test_torch_bridge.py
	PYTHONPATH=$(CURDIR) $(PY) -m pytest -q tests/test_torch_bridge.py -m gpu

demo:
	@if [ -x $(VPY) ]; then $(VPY) -m jax_mla.demo; else $(PY) -m jax_mla.demo; fi

bench:
	PYTHONPATH=$(CURDIR) $(PY) -m benchmarks.run --out benchmarks/out

lint: install
	$(VENV)/bin/ruff check jax_mla torch_bridge tests benchmarks

clean:
	rm -rf $(VENV) benchmarks/out .pytest_cache
