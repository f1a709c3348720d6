# `make run` and `make test` each create .venv and install the CPU stack on first use
# (about a minute); later calls find .venv/.installed up to date and start at once.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
METRICS ?= runs
DATA ?= data
CHECKPOINTS ?= checkpoints
KAGGLE := --preset kaggle --max-rows 1000000

.PHONY: install run test lint bench clean

$(STAMP): pyproject.toml requirements-cpu.txt packaging/fbgemm-gpu-cpushim/pyproject.toml $(wildcard dlrm_lab/serve/*.proto) \
		$(wildcard dlrm_lab/model/native/*.cpp) $(wildcard dlrm_lab/model/native/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements-cpu.txt
	$(BIN)/python -m dlrm_lab.model.native
	touch $(STAMP)

install: $(STAMP)

# The main job: this machine's peaks (a quick probe, once per machine), a Criteo-shaped
# synthetic dataset (generated once, checked against its spec), the Kaggle DLRM (tables
# capped at 1M rows) trained on it, the model it trained (its checkpoint) served under MLPerf-sized queries by two
# co-located instances at a load and p99 bound the lab measures this machine can honour
# (with the max batch, batching delay and spin it measures best at that load),
# the runs so far, and the report (plots, tables, manifests) of the two runs just made.
# Precision is --precision auto everywhere: bf16 only where this machine's GEMMs are faster.
run: $(STAMP) $(DATA)/kaggle/_dataset.json
	$(BIN)/dlrm-lab machine probe --quick --if-missing
	$(BIN)/dlrm-lab data stats $(DATA)/kaggle --strict
	$(BIN)/dlrm-lab train $(KAGGLE) --data $(DATA)/kaggle --steps 300 --batch-size 2048 \
		--eval-every 100 --checkpoint-dir $(CHECKPOINTS)/kaggle --metrics-dir $(METRICS)
	$(BIN)/dlrm-lab infer run $(KAGGLE) --checkpoint $(CHECKPOINTS)/kaggle --query-size mlperf --qps auto --sla-ms auto --duration 10 \
		--instances 2 --max-delay-ms auto --spin-ms auto --metrics-dir $(METRICS)
	$(BIN)/dlrm-lab runs list $(METRICS)
	@echo "report of the two runs above (open in a browser):"
	@$(BIN)/dlrm-lab report $(METRICS) --last 2 --out $(METRICS)/report

$(DATA)/kaggle/_dataset.json: | $(STAMP)
	rm -rf $(DATA)/kaggle
	$(BIN)/dlrm-lab data gen $(KAGGLE) --rows 614400 --shards 4 --seed 0 --out $(DATA)/kaggle

# One pytest worker per core (pytest-xdist), a file's tests on one worker; then the tests that launch ranks
# (`multiprocess`), alone: their ranks take every core, and beside another worker they starved its servers
# (a remote search's probes at 270-680 ms). `$(BIN)/python -m pytest tests/FILE.py` runs a file in one process.
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist loadfile -m "not multiprocess"
	$(BIN)/python -m pytest -m multiprocess

lint: $(STAMP)
	$(BIN)/ruff check dlrm_lab tests benchmarks
	$(BIN)/ruff format --check dlrm_lab
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/train_throughput.py
	$(BIN)/python benchmarks/data_gen.py
	$(BIN)/python benchmarks/inference.py
	$(BIN)/python benchmarks/roofline.py
	$(BIN)/python benchmarks/report.py
	$(BIN)/python benchmarks/serve.py

clean:
	rm -rf $(VENV) build dist *.egg-info $(DATA) $(CHECKPOINTS)
