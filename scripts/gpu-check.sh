#!/usr/bin/env bash
# Check a GPU machine within a time budget (default 480 s): the figures of docs/gpu.md's targets first, then
# the test suite on the GPU, then the demo, then the rest; the report opens with one table, target against
# measured. See bench/gpu_check.py for the steps and docs/gpu.md for what each figure is compared against.
#
#     bash scripts/gpu-check.sh [OUT_DIR] [--budget SECONDS]   (default OUT_DIR: gpu-check-<date>-<time>)
#     bash scripts/gpu-check.sh --plan [--budget SECONDS]      the steps and their limits, on any machine
#     bash scripts/gpu-check.sh --only decode-compiled pytest  some steps alone
#     PYTHON=/path/to/python bash scripts/gpu-check.sh         (default: python3)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
export PYTHON
exec "$PYTHON" bench/gpu_check.py "$@"
