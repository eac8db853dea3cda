# gradsync: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv on first use. torch is pinned to the CPU build that
# installs offline on the project's machines; see README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gradsync train

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
