# Quick start: `make demo` and `make test`. Both create .venv when missing and install what they need.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch first, pinned, so pip does not pick a newer multi-GB build by itself; override with TORCH_SPEC=...
TORCH_SPEC ?= torch==2.13.0
# verl (range in pyproject.toml's verl extra) goes in with --no-deps; these are what its V1 trainer modules import
# beyond our dev extra (tests/test_integrations_verl.py loads the sampler through them); torch stays as installed
VERL_TEST_DEPS := codetiming orjson cachetools uvicorn fastapi starlette peft datasets

.PHONY: demo test test-slow lint typecheck docs bench clean install install-dev

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q "torch>=2.4"
	touch $@

$(VENV)/.installed-base: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e ".[plot]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps "$$(sed -n 's/^verl = \["\([^"]*\)".*/\1/p' pyproject.toml)"
	$(PIP) install -q $(VERL_TEST_DEPS) "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	@# verl's wheel also installs its own test suite as a top-level package `tests`, which would shadow ours
	$(PY) -c "import importlib.metadata as m, shutil; d = m.distribution('verl'); t = d.locate_file('tests'); fs = [str(f) for f in d.files or []]; 'tests/__init__.py' in fs and shutil.rmtree(str(t), ignore_errors=True)"
	touch $@ $(VENV)/.installed-base

install: $(VENV)/.installed-base
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed-base
	$(PY) -m benchmarks demo

# The suite without the tests marked slow (type check, cross-process path counts, long soaks); CI runs those after.
test: $(VENV)/.installed-dev
	@$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 -m "not slow"; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

test-slow: $(VENV)/.installed-dev
	@$(PY) -m pytest -q -n 2 --dist loadfile --durations=10 -m slow; rc=$$?; if [ $$rc -eq 5 ]; then echo "no slow tests"; exit 0; fi; exit $$rc

# The documentation site (docs/, mkdocs.yml) into site/; --strict: any warning fails.
docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# mypy on the knitdata package and the benchmarks (settings in setup.cfg); tests/test_typecheck.py runs it in `make test`.
typecheck: $(VENV)/.installed-dev
	$(PY) -m mypy knitdata benchmarks

lint: $(VENV)/.installed-dev
	$(PY) -m ruff check knitdata tests benchmarks examples
	$(PY) benchmarks/report.py --check

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .mypy_cache
