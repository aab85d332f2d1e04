# The two commands that do everything: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: install run test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# The torch engine serves best under continuous batching (docs/measurements.md); the
# fixed backend's default policy is the KEYBATCH_POLICY setting.
run: install
	$(BIN)/keybatch up --policy continuous

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

# Under a minute on two cores: the pure-Python units, the broker's scripts and replicas
# on a real Valkey, and the layers.
test-fast: install
	$(BIN)/pytest -q -x tests/unit tests/broker tests/tools/test_layers.py

bench: install
	$(BIN)/keybatch bench serving --json docs/bench/serving.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
