# cossd: `make demo` runs the main job, `make test` the tests; each installs what it needs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: all demo test test-slow torture system-deps install frameworks clean bytecode

all: test

# fuse3 (fusermount3), libfuse3-dev and pkg-config are what pyfuse3 needs to build and mount.
system-deps:
	@if ! command -v fusermount3 >/dev/null 2>&1 || ! pkg-config --exists fuse3 2>/dev/null; then \
	  echo "== installing fuse3 libfuse3-dev pkg-config"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq fuse3 libfuse3-dev pkg-config; \
	fi
	@# mkfs.ext4 and losetup: the demo's baselines write through ext4 on a plain NVM namespace.
	@# rsync and fio: the tests run them against a mount, as users do.
	@if ! command -v mkfs.ext4 >/dev/null 2>&1 || ! command -v losetup >/dev/null 2>&1 || \
	    ! command -v rsync >/dev/null 2>&1 || ! command -v fio >/dev/null 2>&1; then \
	  echo "== installing e2fsprogs mount rsync fio"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq e2fsprogs mount rsync fio; \
	fi

# Every C file and header of the kernels (kernels/_build.py lists the sources); cffi's
# generated _cossd_kernels.c is left out, since the build writes it.
$(STAMP): pyproject.toml setup.py kernels/_build.py \
          $(filter-out kernels/_cossd_kernels.c,$(wildcard kernels/*.c kernels/*.h))
	@$(MAKE) --no-print-directory system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	# torch is pinned to the CPU build that lies on this machine's disk.
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

install: $(STAMP) bytecode

# The package's bytecode, compiled ahead (only what changed since): where
# PYTHONDONTWRITEBYTECODE is set, as on this project's machines, Python would otherwise
# compile every module of cossd again in each new process, 0.14-0.2 s here at each
# mount daemon's start (a restart's cost; docs/benchmarks.md) and in every test's child.
PACKAGE_DIRS := cossd_pkg protocol client kernels model emulator fs server tools trainer integrations harness
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 $(PACKAGE_DIRS) >/dev/null

# The optional test tier: the frameworks users run cossd under (DeepSpeed, Hugging Face
# transformers and accelerate, Lightning). `make test` runs their tests where they are
# installed and skips them, saying why, where not; .ci/run installs them first.
# DeepSpeed has no wheel: it builds from its source distribution, with ninja for the JIT ops.
# libaio-dev: DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload, `cossd bench --sections
# peers`) links against libaio when it JIT-builds.
FRAMEWORKS_STAMP := $(VENV)/.stamp-frameworks
$(FRAMEWORKS_STAMP): $(STAMP)
	@if ! [ -e /usr/include/libaio.h ]; then \
	  echo "== installing libaio-dev"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq libaio-dev; \
	fi
	$(PY) -m pip install -q ninja
	$(PY) -m pip install -q --no-build-isolation -e '.[test,frameworks]'
	$(PY) -m pip install -q --no-build-isolation 'deepspeed==0.19.8'
	touch $(FRAMEWORKS_STAMP)

frameworks: $(FRAMEWORKS_STAMP)

# torchtitan 0.3.0 in a virtualenv of its own (.venv-titan): its dependencies would upgrade
# datasets, huggingface_hub and pandas in .venv. torch is the same CPU build; triton only
# because torchtitan imports it at start-up (nothing runs it on the CPU). tests/e2e/
# test_torchtitan.py runs its jobs in this interpreter and skips, saying why, without it.
TITAN_VENV  := .venv-titan
TITAN_STAMP := $(TITAN_VENV)/.stamp-torchtitan
$(TITAN_STAMP): $(STAMP)
	test -x $(TITAN_VENV)/bin/python || $(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/python -m pip install -q --upgrade pip 'setuptools>=77' wheel cffi
	$(TITAN_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TITAN_VENV)/bin/python -m pip install -q torchtitan==0.3.0 triton==3.9.0
	$(TITAN_VENV)/bin/python -m pip install -q --no-build-isolation -e .
	touch $(TITAN_STAMP)

.PHONY: torchtitan
torchtitan: $(TITAN_STAMP)

demo: $(STAMP) bytecode
	$(PY) -m cossd.tools.cli demo

test: $(STAMP) bytecode
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The long reliability runs (kill -9, power loss, corruption) plus the fault injections,
# printing each one's trials and failures; docs/reliability.md has the latest figures.
torture: $(STAMP) bytecode
	$(PY) -m pytest -q -m "slow or torture" $(PYTEST_ARGS)

test-slow: torture

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis kernels/*.so
	find $(PACKAGE_DIRS) tests -name __pycache__ -type d -prune -exec rm -rf {} +

# A GPU node that reaches no package index (docs/benchmarks.md, "A GPU node without a package
# index"): `make gpu-bundle` puts the wheels and fuse3 .debs it needs into build/gpu-bundle/;
# `make gpu-bundle-check` runs the node's script here as a CPU dry run, from the bundle only,
# with no network, under a stand-in for the node's Python (a venv with torch alone).
GPU_BUNDLE  := build/gpu-bundle
GPU_STANDIN := build/gpu-node-standin
NO_NETWORK  := $(shell unshare --net true 2>/dev/null && echo unshare --net)
.PHONY: gpu-bundle gpu-bundle-check

gpu-bundle: $(STAMP)
	PY=$(PY) bash tools/gpu_bundle.sh $(GPU_BUNDLE)

$(GPU_STANDIN)/.stamp-torch:
	test -x $(GPU_STANDIN)/bin/python || $(PYTHON) -m venv $(GPU_STANDIN)
	$(GPU_STANDIN)/bin/python -m pip install -q torch==2.13.0
	touch $@

gpu-bundle-check: gpu-bundle $(GPU_STANDIN)/.stamp-torch
	rm -rf build/gpu-node-dry-run
	PIP_NO_INDEX=1 $(NO_NETWORK) $(GPU_STANDIN)/bin/python tools/gpu_node_run.py $(GPU_BUNDLE) \
	  --cpu-dry-run --bundled-fuse --out build/gpu-node-dry-run

# The CUDA Adam step without a GPU: nvcc's builds for sm_80/sm_90 and its lane functions run
# on the host against the C kernel (docs/kernels.md, "CUDA"); skipped where nvcc is missing.
.PHONY: cuda-check
cuda-check: $(STAMP) bytecode
	$(PY) -m pytest -q tests/unit/test_cuda_kernel.py $(PYTEST_ARGS)
