# Two commands for a newcomer: `make demo` and `make test`.
# torch/torchvision are pinned to a pair whose (CUDA) builds import and run on CPU-only
# machines too; the CPU-only torch 2.13.0 wheel breaks torchvision.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test bench venv clean

$(VENV)/.core: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[plot]"
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $@

venv: $(VENV)/.core

demo: $(VENV)/.core
	$(PY) examples/finetune_timm_vit.py

test: $(VENV)/.test
	$(PY) -m pytest -q

# `make bench` = ViT-Tiny on CPU (ViT-Tiny/-Small/-Base on a GPU); more: make bench BENCH_ARGS="--models resnet18 --img-size 64"
BENCH_ARGS ?=
bench: $(VENV)/.core
	$(PY) bench/bench_clipping.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
