# `make run` and `make test` each create .venv and install the CPU stack on first use
# (about a minute); later calls find .venv/.installed up to date and start at once.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
METRICS ?= runs

.PHONY: install run test lint bench clean

$(STAMP): pyproject.toml requirements-cpu.txt packaging/fbgemm-gpu-cpushim/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements-cpu.txt
	touch $(STAMP)

install: $(STAMP)

# The main job: train the Criteo Kaggle DLRM (tables capped at 1M rows) and list the runs.
run: $(STAMP)
	$(BIN)/dlrm-lab train --preset kaggle --max-rows 1000000 --steps 300 --batch-size 2048 \
		--precision bf16 --eval-every 100 --metrics-dir $(METRICS)
	$(BIN)/dlrm-lab runs list $(METRICS)

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check dlrm_lab tests benchmarks
	$(BIN)/ruff format --check dlrm_lab tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) build dist *.egg-info
