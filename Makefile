# Two entry points do everything on a fresh machine: `make demo` and `make test`.
# torch is installed first from the pinned CPU build so pip never pulls a CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CORE   := $(VENV)/.core
STAMP  := $(VENV)/.installed

.PHONY: install model demo demo-math full test test-fast clean

# pip byte-compiles what it installs one file at a time; compiling the environment afterwards on
# every core, $(CORE) below took 130 instead of 163 s on a 2-core AVX2-only EPYC (warm pip cache). Not
# compiling at all is slower: with PYTHONDONTWRITEBYTECODE set, every process would compile the
# modules it imports again (~12 s more per training process there). compileall's exit status is
# ignored as pip ignores its own: some wheels ship files that are not Python 3 (templates, tests).
COMPILE := $(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
           > /dev/null || true

# What `make demo` runs on: torch and the package's own dependencies. The extras below (LoRA, Ray,
# trackers, verifiers, pytest) took 89 of 192 s of a fresh install on a 2-core AVX2-only EPYC.
$(CORE): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --no-compile torch==2.13.0
	$(PIP) install --quiet --no-compile -c constraints.txt -e .
	$(COMPILE)
	touch $(CORE)

# Everything the tests use.
$(STAMP): $(CORE)
	$(PIP) install --quiet --no-compile -c constraints.txt -e '.[dev,lora,ray,trackers,math]'
	# reasoning-gym builds pycosat from source (needs a C compiler): optional, its tests skip without it
	$(PIP) install --quiet --no-compile -c constraints.txt -e '.[reasoning-gym]' || echo "warning: reasoning-gym not installed"
	$(COMPILE)
	touch $(STAMP)

install: $(STAMP)

model: $(CORE)
	$(VENV)/bin/turborlhf fetch-model smollm2-135m-instruct

demo: model
	$(VENV)/bin/turborlhf pipeline --config configs/hh_smollm2/demo.yaml

# RL with verifiable rewards on GSM8K: cold-start SFT, then GRPO, evaluated on held-out test
# problems before, after the SFT and after GRPO (so each stage's part is visible). eval-math gives
# every policy GSM8K's calculator (inert for a model that never calls it); the last line also
# evaluates the trained policy without it.
MATH_EVAL := --data data/gsm8k/test-1000.jsonl.gz --n 200 --max-new-tokens 256 --batch-size 64 --json
demo-math: install model
	$(VENV)/bin/turborlhf prepare-data gsm8k --input data/gsm8k/train.jsonl.gz --output-dir runs/gsm8k/data
	$(VENV)/bin/turborlhf eval-math --policy smollm2-135m-instruct $(MATH_EVAL) > runs/gsm8k/eval_before.json
	$(VENV)/bin/turborlhf sft --config configs/gsm8k_smollm2/sft.yaml
	$(VENV)/bin/turborlhf eval-math --policy runs/gsm8k/sft $(MATH_EVAL) > runs/gsm8k/eval_sft.json
	$(VENV)/bin/turborlhf ppo --config configs/gsm8k_smollm2/grpo.yaml
	$(VENV)/bin/turborlhf eval-math --policy runs/gsm8k/policy $(MATH_EVAL) > runs/gsm8k/eval_after.json
	$(VENV)/bin/turborlhf eval-math --policy runs/gsm8k/policy $(MATH_EVAL) --tool none > runs/gsm8k/eval_after_no_tool.json
	@echo "before:    $$(cat runs/gsm8k/eval_before.json)"
	@echo "after SFT: $$(cat runs/gsm8k/eval_sft.json)"
	@echo "after:     $$(cat runs/gsm8k/eval_after.json)"
	@echo "after, without the calculator: $$(cat runs/gsm8k/eval_after_no_tool.json)"

full: model
	$(VENV)/bin/turborlhf pipeline --config configs/hh_smollm2/full.yaml

test: install model
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
