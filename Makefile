# Two commands for a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment it needs when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test lint bench bench-quick doctor clean screenshot

$(PY): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(PY)

demo: $(PY)
	$(PY) -m keras_amp_plus demo --log-dir logs/demo

test: $(PY)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest tests
	$(PY) -m pytest --nbmake notebooks

BENCHMARKS := benchmarks/layers.py benchmarks/training.py benchmarks/loss_scale.py \
	benchmarks/monitor.py

bench: $(PY)
	for script in $(BENCHMARKS); do $(PY) $$script || exit 1; done

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
	rm -rf $(VENV) logs .pytest_cache
