# The two set-up commands of the README. Each creates or reuses .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test install

train: $(VENV)/.installed
	$(PY) -m covey.cli train $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q -ra $(ARGS)

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
