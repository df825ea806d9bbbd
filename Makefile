# Everything runs from .venv in the repo root; `make setup` builds it (idempotent).
PY := .venv/bin/python

# Keep all traffic on loopback (docs/guides/cpu.md, 'Run-time environment'): Ray, vLLM, gloo and DeepSpeed.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export VLLM_HOST_IP := 127.0.0.1
export MASTER_ADDR := 127.0.0.1
export GLOO_SOCKET_IFNAME := lo
export DS_ACCELERATOR := cpu
export WANDB_MODE := offline
export VLLM_CPU_KVCACHE_SPACE := 1
export VLLM_ENABLE_V1_MULTIPROCESSING := 0
export VLLM_CPU_OMP_THREADS_BIND := nobind
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
# DeepSpeed's CPU ops are compiled on first use into this folder. Per checkout: two checkouts sharing the default
# ~/.cache folder rebuild each other's build (its hash includes the venv's path), 30 s or more at every start.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.venv/torch_extensions

.PHONY: setup test test-unit lint format

setup:
	bash scripts/setup_env.sh

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

test: setup lint
	$(PY) -m pytest -q -rs --durations=40 tests

test-unit: setup
	$(PY) -m pytest -q tests/unit

.PHONY: demo
# A short KL-Cov run of SmolLM2-135M-Instruct on the built-in task, submitted to a Ray head on 127.0.0.1.
demo: setup
	bash scripts/demo.sh $(ARGS)
