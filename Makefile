# Two entry points do everything on a fresh machine: `make demo` and `make test`.
# torch is installed first from the pinned CPU build so pip never pulls a CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install model demo full test test-fast clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[dev,lora,ray,trackers]'
	touch $(STAMP)

install: $(STAMP)

model: install
	$(VENV)/bin/turborlhf fetch-model smollm2-135m-instruct

demo: model
	$(VENV)/bin/turborlhf pipeline --config configs/hh_smollm2/demo.yaml

full: model
	$(VENV)/bin/turborlhf pipeline --config configs/hh_smollm2/full.yaml

test: model
	$(VENV)/bin/pytest -q tests

test-fast: install
	$(VENV)/bin/pytest -q tests -m "not slow"

# TRL and OpenRLHF into ~/.cache/turborlhf/peers (PyPI), then the table of turborlhf.algo against
# their code; `make test` installs them too (tests/algo/test_vs_peers.py).
.PHONY: peers
peers: install
	$(PY) benchmarks/peers/compare_algo.py --install

clean:
	rm -rf $(VENV) runs .pytest_cache
