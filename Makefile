# Everything a fresh machine needs: `make demo` runs the main job, `make test` the tests.
# Both create the virtual environment on first use. torch 2.13.0 (CPU build) is installed
# first, so the `[runtime]` range is already satisfied and no CUDA build is pulled.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= out

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[runtime,dev]"
	touch $(STAMP)

demo: $(STAMP)
	@mkdir -p $(OUT)
	$(BIN)/pipecc list
	$(BIN)/pipecc compile schedules/zb_h1.sched --ranks 4 --microbatches 8 --format text
	$(BIN)/pipecc compile schedules/dualpipe.sched --ranks 8 --microbatches 20 -o $(OUT)/dualpipe.json
	@echo "wrote $(OUT)/dualpipe.json"

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check pipecc runtime tests benchmarks
	$(BIN)/ruff format --check pipecc runtime tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/compile_scale.py

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
