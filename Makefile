# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build on this machine; a looser spec could pull multi-GB CUDA wheels
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/autopar demo --out autopar_out

# two pytest workers (the CI machine's cores), whole files each so that a module's fixtures run
# once: the suite spends about half its time in one process (planning, tracing, the single-device
# references), where a second worker uses the other core (measured on the 2-core dev VM: 926 s
# with two workers, 1183 s in one process)
test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) autopar_out
