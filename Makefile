# Every target builds its own virtualenv in .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test lint typecheck pytest demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: lint pytest

lint: $(STAMP)
	$(BIN)/ruff check stm ferry tests examples
	$(BIN)/ruff format --check stm ferry tests examples
	$(BIN)/mypy stm ferry examples tests

pytest: $(STAMP)
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/python examples/bank.py

bench: $(STAMP)
	$(BIN)/python -m tests.bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
