# Two commands for a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment it needs when it is missing.
# `make test-itex` runs the lean ITEX-stack suite (TensorFlow 2.15 + Keras 2.15 +
# Intel Extension for TensorFlow) in a second environment, .venv-itex.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ITEX_PYTHON ?= python3.11
ITEX_VENV ?= .venv-itex
ITEX_PY := $(ITEX_VENV)/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test test-itex lint bench bench-quick bench-itex doctor clean screenshot

$(PY): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,cpu]"
	touch $(PY)

# ITEX pins Keras 2, so this stack gets its own environment; the package is
# installed without dependencies (its own list names the Keras 3 stack).
$(ITEX_PY): pyproject.toml constraints-itex.txt
	$(ITEX_PYTHON) -m venv $(ITEX_VENV)
	$(ITEX_PY) -m pip install --quiet --upgrade pip
	$(ITEX_PY) -m pip install --quiet -c constraints-itex.txt \
		"intel-extension-for-tensorflow[cpu]" tensorflow keras pytest
	$(ITEX_PY) -m pip install --quiet --no-deps -e .
	touch $(ITEX_PY)

demo: $(PY)
	$(PY) -m keras_amp_plus demo --log-dir logs/demo

test: $(PY)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest tests
	$(PY) -m pytest --nbmake notebooks

BENCHMARKS := benchmarks/layers.py benchmarks/paths.py benchmarks/variable_length.py \
	benchmarks/batch_switch.py \
	benchmarks/cpu_allocator.py benchmarks/training.py benchmarks/loss_scale.py \
	benchmarks/finite_flags.py benchmarks/fused_update.py benchmarks/monitor.py \
	benchmarks/moments_gradient.py benchmarks/in_xla_sums.py benchmarks/swish_xla.py \
	benchmarks/eager_calls.py

# The whole tests/ directory: conftest.py skips, with the reason, every module
# written against Keras 3 APIs, so what runs is the test_itex_* suite.
test-itex: $(ITEX_PY)
	$(ITEX_PY) -m pytest tests

bench-itex: $(ITEX_PY)
	$(ITEX_PY) benchmarks/itex_stack.py

# The full runs behind the README's "Measured" section and benchmarks/README.md
# (about 30 min, quiet machine).
bench: $(PY)
	$(PY) benchmarks/layers.py --control --floor
	$(PY) benchmarks/paths.py --layers IN LN
	$(PY) benchmarks/moments_gradient.py
	$(PY) benchmarks/in_xla_sums.py
	$(PY) benchmarks/swish_xla.py
	$(PY) benchmarks/swish_in_context.py
	$(PY) benchmarks/variable_length.py
	$(PY) benchmarks/eager_calls.py
	$(PY) benchmarks/batch_switch.py
	TF_ENABLE_ONEDNN_OPTS=0 $(PY) benchmarks/cpu_allocator.py
	$(PY) benchmarks/training.py
	$(PY) benchmarks/loss_scale.py
	$(PY) benchmarks/finite_flags.py
	$(PY) benchmarks/fused_update.py
	$(PY) benchmarks/monitor.py
	$(PY) benchmarks/monitor.py --jit

# CI-sized runs of every benchmark (results go to *_quick.json).
bench-quick: $(PY)
	for script in $(BENCHMARKS); do $(PY) $$script --quick || exit 1; done

# docs/tensorboard_amp.png: the real TensorBoard page of the demo's logs,
# rendered by headless Chromium (Debian: apt-get install -y chromium).
screenshot: $(PY)
	$(PY) -m keras_amp_plus demo --log-dir logs/demo
	$(PY) scripts/tensorboard_screenshot.py --logdir logs/demo --output docs/tensorboard_amp.png

doctor: $(PY)
	$(PY) -m keras_amp_plus doctor

clean:
	rm -rf $(VENV) $(ITEX_VENV) logs .pytest_cache
