# Two commands on a fresh machine: `make demo` and `make test`.
#
# TORCH_CONSTRAINTS pins the CPU build of torch that these machines carry on disk. On a GPU
# machine, override it, e.g. `make test TORCH_CONSTRAINTS=` (then pip picks torch from your
# index) or point it at a file of your own.
PYTHON ?= python3
VENV ?= .venv
TORCH_CONSTRAINTS ?= constraints/cpu.txt
PIP_CONSTRAINT_FLAGS = $(if $(TORCH_CONSTRAINTS),-c $(TORCH_CONSTRAINTS))
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed

.PHONY: install demo test test-fast stress fuzz mutants golden lint bench scale scale-hosts chaos docs docs-serve clean

$(STAMP): pyproject.toml $(TORCH_CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(PIP_CONSTRAINT_FLAGS) -e '.[dev,ft,docs]'
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/scaletrain demo

# Two test processes (pytest-xdist): most tests wait on their own worker processes (start-up,
# rendezvous, failure detection), so a 2-core machine runs two such tests in 12-13 minutes
# where one at a time took 16; every test starts its own processes on free ports and its own
# network namespaces. TEST_WORKERS=0 runs them one at a time.
TEST_WORKERS ?= 2

test: install
	bash scripts/install-chromium.sh
	$(BIN)/pytest --durations=25 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal)

# The fault tests ROUNDS times (default 20), new random draws each round; pass counts per test.
stress: install
	$(BIN)/python scripts/stress.py --rounds $(or $(ROUNDS),20)

# The flag-space fuzzer alone, ROUNDS times (default 10): new combinations checked and
# trained each round (make stress runs it too, with every fault test).
fuzz: install
	$(BIN)/python scripts/stress.py --rounds $(or $(ROUNDS),10) --flag-draws 8 \
		--only tests/unit/test_flag_space.py tests/dist/test_flag_space.py

# The mutation catalog (scripts/mutant_catalog.py): each promise's smallest breaking edit,
# applied to a scratch copy; the tests make test runs for it must fail (runs/mutants/). Then
# mutmut over the pure modules, 90% of its mutants killed in each (runs/mutmut/). Both run
# whatever the first found; about 22 minutes on 2 cores.
mutants: install
	$(BIN)/python scripts/mutants.py; catalog=$$?; \
	$(BIN)/python scripts/mutation_tool.py; tool=$$?; \
	test $$catalog -eq 0 -a $$tool -eq 0

# The golden table (tests/golden/): fixed runs of every mode and their final weights' hash,
# unchanged by any restructure (about 2 minutes; SCALETRAIN_GOLDEN=record writes it anew).
golden: install
	SCALETRAIN_GOLDEN=$(or $(SCALETRAIN_GOLDEN),1) $(BIN)/pytest -q -n 2 tests/golden

test-fast: install
	$(BIN)/pytest tests/unit

# The layering contract (cli -> launch -> trainer -> strategies -> ... nothing imports
# upward) is a test, so `make test` and CI check it too.
lint: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy src
	$(BIN)/pytest -q -p no:cacheprovider tests/unit/test_layers.py

# Every mode at 1-32 processes on sleeping devices, with failures at 8, 16 and 32: where the
# time goes against world size (30-40 minutes on 2 cores, by the host's phase; runs/scale/).
scale: install
	$(BIN)/python benchmarks/scale.py

# 8 emulated hosts x 4 workers over 1 Gbit/s links (the netns lab: needs root), ddp and the
# parameter server, a cable cut for 10 s and a host powered off (about 4 minutes; runs/hosts/).
scale-hosts: install
	$(BIN)/python benchmarks/hosts.py

# 8 in-place replicas through two 5-minute storms of seeded faults (kills, freezes, cable
# cuts, slow devices), each between two runs of the same job without faults (the netns lab:
# needs root; about 32 minutes; runs/chaos/).
chaos: install
	$(BIN)/python benchmarks/chaos.py

bench: install
	$(BIN)/python benchmarks/ddp_overhead.py
	$(BIN)/python benchmarks/compression.py
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python benchmarks/pipeline_bubble.py
	$(BIN)/python benchmarks/costmodel.py
	$(BIN)/python benchmarks/ps_stragglers.py
	$(BIN)/python benchmarks/ps_checkpoint.py
	$(BIN)/python benchmarks/ps_replicas.py
	$(BIN)/python benchmarks/ps_transport.py
	$(BIN)/python benchmarks/activation_memory.py
	$(BIN)/python benchmarks/compile_speed.py
	$(BIN)/python benchmarks/checkpoint_interval.py
	$(BIN)/python benchmarks/balance_speed.py
	$(BIN)/python benchmarks/staleness_rule.py

# The docs site (mkdocs.yml): built strictly, so a broken link or a missing reference fails.
# The command-line and configuration reference pages are generated from the code at each
# build (scripts/docs_reference.py).
docs: install
	$(BIN)/mkdocs build --strict --site-dir site

docs-serve: install
	$(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
