# Everything a fresh machine needs: `make demo` runs the main job, `make test` the tests.
# Both create the virtual environment on first use. torch 2.13.0 (CPU build) is installed
# first, so the `[runtime]` range is already satisfied and no CUDA build is pulled; the
# `exact` extra (OR-Tools) runs the exact-solver tests. A change to pyproject.toml or to this
# file installs again.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= out

.PHONY: demo test test-fast lint typecheck bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[runtime,dev,exact]"
	touch $(STAMP)

# The main job on a bundled schedule: compile it, verify it under every comm model, simulate
# it with a cost model (and draw it), then run it on 4 CPU processes (gloo) and check the
# loss and every gradient against a single-process reference.
demo: $(STAMP)
	@mkdir -p $(OUT)
	$(BIN)/pipecc list
	$(BIN)/pipecc compile schedules/zb_h1.sched --ranks 4 --microbatches 8 --format text
	$(BIN)/pipecc compile schedules/zb_h1.sched --ranks 4 --microbatches 8 -o $(OUT)/zb_h1.json
	$(BIN)/pipecc verify $(OUT)/zb_h1.json --comm all
	$(BIN)/pipecc simulate $(OUT)/zb_h1.json --cost F=1,I=1,W=1,comm=0.1 --svg $(OUT)/zb_h1.svg
	$(BIN)/pipecc run $(OUT)/zb_h1.json --nproc 4 --model examples/mlp.py --check
	@echo "wrote $(OUT)/zb_h1.json and $(OUT)/zb_h1.svg"

# What CI gates (.ci/run runs `make test`): lint, format, types, then every test, and the
# 25 slowest of them.
test: lint typecheck
	$(BIN)/python -m pytest -q --durations=25

# The inner loop: every test that starts no process and joins no torch process group
# (`slow` marks the others: tests/conftest.py, docs/architecture.md#tests), on two workers.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n 2

lint: $(STAMP)
	$(BIN)/ruff check pipecc runtime tests benchmarks examples
	$(BIN)/ruff format --check pipecc runtime tests benchmarks examples

# mypy --strict with no errors, and at most 10 `# type: ignore` (each with its reason on the
# line): tests/test_typing.py checks the count and the reasons
typecheck: $(STAMP)
	$(BIN)/mypy --strict pipecc runtime

bench: $(STAMP)
	$(BIN)/python benchmarks/compile_scale.py

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
