# Two commands for a newcomer: `make demo` and `make test`.
# torch/torchvision are pinned to a pair whose (CUDA) builds import and run on CPU-only
# machines too; the CPU-only torch 2.13.0 wheel breaks torchvision.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test test-fast lint bench bench-gpu bench-all bench-test venv clean

$(VENV)/.core: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[demo,plot]"
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(PY) -m pip install -q -e ".[demo,test,plot,lint]"
	touch $@

venv: $(VENV)/.core

demo: $(VENV)/.core
	$(PY) examples/finetune_timm_vit.py

test: $(VENV)/.test
	$(PY) -m pytest -q

# the suite without the tests marked slow (distributed, timm families, red-team rounds, the
# Opacus suite); `make test` (and CI) runs everything
test-fast: $(VENV)/.test
	$(PY) -m pytest -q -m "not slow"

# ruff (configured in pyproject.toml): unused or undefined names, lines of at most 100 characters;
# mypy (configured in pyproject.toml, installed with the test extra): the package's types
lint: $(VENV)/.test
	$(PY) -m ruff check private_engine tests bench examples
	$(PY) -m mypy

# Benchmarks (docs/benchmarks.md). `make bench` = ViT-Tiny on the CPU, core methods; more:
# make bench BENCH_ARGS="--models resnet18 --img-size 64 --methods all"
# `make bench-gpu`: the seven models on CUDA, bf16 autocast, maximum batch sizes, written to
# docs/benchmarks.md;
# `make bench-all`: the same models on the CPU (slow), written to docs/benchmarks.md.
# `make bench-test`: the benchmark's own tests (bench/tests; not part of `make test`).
BENCH_ARGS ?=
BENCH_MODELS := vit_tiny_patch16_224 vit_small_patch16_224 vit_base_patch16_224 resnet18 resnet50 vgg11 text_transformer
bench: $(VENV)/.core
	$(PY) bench/bench_clipping.py $(BENCH_ARGS)

bench-gpu: $(VENV)/.core
	$(PY) bench/bench_clipping.py --device cuda --models $(BENCH_MODELS) --amp bf16 --max-batch --markdown docs/benchmarks.md $(BENCH_ARGS)

bench-all: $(VENV)/.core
	$(PY) bench/bench_clipping.py --device cpu --models $(BENCH_MODELS) --markdown docs/benchmarks.md $(BENCH_ARGS)

bench-test: $(VENV)/.test
	$(PY) -m pytest -q bench/tests

clean:
	rm -rf $(VENV) .pytest_cache
