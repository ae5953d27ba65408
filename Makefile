# cossd: `make demo` runs the main job, `make test` the tests; each installs what it needs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: all demo test test-slow torture system-deps install clean

all: test

# fuse3 (fusermount3), libfuse3-dev and pkg-config are what pyfuse3 needs to build and mount.
system-deps:
	@if ! command -v fusermount3 >/dev/null 2>&1 || ! pkg-config --exists fuse3 2>/dev/null; then \
	  echo "== installing fuse3 libfuse3-dev pkg-config"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq fuse3 libfuse3-dev pkg-config; \
	fi
	@# mkfs.ext4 and losetup: the demo's baselines write through ext4 on a plain NVM namespace.
	@if ! command -v mkfs.ext4 >/dev/null 2>&1 || ! command -v losetup >/dev/null 2>&1; then \
	  echo "== installing e2fsprogs mount"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq e2fsprogs mount; \
	fi

$(STAMP): pyproject.toml setup.py kernels/_build.py kernels/cossd_kernels.c kernels/cossd_kernels.h
	@$(MAKE) --no-print-directory system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	# torch is pinned to the CPU build that lies on this machine's disk.
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m cossd.tools.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The long reliability runs (kill -9, power loss, corruption) plus the fault injections,
# printing each one's trials and failures; docs/reliability.md has the latest figures.
torture: $(STAMP)
	$(PY) -m pytest -q -m "slow or torture" $(PYTEST_ARGS)

test-slow: torture

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis kernels/*.so
