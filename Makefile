# The two set-up commands of the README. Each creates or reuses .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test test-fast install

train: $(VENV)/.installed
	$(PY) -m covey.cli train $(ARGS)

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q -ra $(ARGS)

# The fast tier, under a minute on two cores: the maths, the config, the rewards and the house rules; no test
# that loads a model (marked `model` by tests/conftest.py).
FAST_TESTS := tests/algos tests/config tests/training/test_presets_maths.py tests/rewards tests/test_layers.py

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -ra -m "not slow and not gpu and not model" $(FAST_TESTS) $(ARGS)

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
