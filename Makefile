# The README's quick start uses `make demo` and `make test`; .ci/run uses `make test` and
# `make docs` and `make wheel-check`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test docs wheel-check bench lint typecheck clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; fi
	@# Debian's Chromium and its WebDriver: the browser test of `pflkit report --html`
	@if ! command -v chromedriver >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq chromium chromium-driver; fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pflkit compare configs/quickstart.yaml --out runs/quickstart-$$(date +%Y%m%d-%H%M%S)

# one pytest worker per core (pytest-xdist); each test then runs on one torch thread or in its
# own subprocesses, and the idle time of the process tests (Flower, signals) is filled
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist worksteal

# the wheel alone: built, installed into a fresh venv outside the repository, run from a
# folder without pflkit's source on the bundled digits data (.ci/wheel-check says what it checks)
wheel-check: $(STAMP)
	.ci/wheel-check $(PY) $(PYTHON)

# the API site into site/; --strict: a broken link or cross-reference, or a documented public
# object without a docstring (docs/griffe_pflkit.py), fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) benchmarks/bench_fedavg.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# the type check of the engine and the algorithms (.ci/run runs it after the tests)
typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict src/pflkit/engine src/pflkit/algorithms

clean:
	rm -rf $(VENV) runs site .pytest_cache
