# Two commands on a fresh machine (Python 3.10+ and the package registries):
#   make demo   quantize the built-in default model (SmolLM2-135M) with the default recipe
#   make test   run the test suite
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
EXTRAS ?= all
SHARED_DATA := $(wildcard ../shared/data)
export QUANTSPEC_DATA ?= $(SHARED_DATA)

.PHONY: demo test test-slow interop bench-kernels clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VENV)/bin/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/quantspec quantize

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q

test-slow: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -m slow

interop: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -m interop

bench-kernels: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/kernel_speed.py --device cpu

clean:
	rm -rf $(VENV) quantspec-out
