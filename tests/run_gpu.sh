#!/usr/bin/env bash
# Run every GPU test in one call on a GPU machine: log and JUnit XML go to OUTDIR.
# Usage: tests/run_gpu.sh OUTDIR [extra pytest args]
set -uo pipefail
out=${1:?usage: tests/run_gpu.sh OUTDIR [pytest args]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m pytest -m gpu -q -rfE --durations=15 --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/gpu_tests.log"
exit "${PIPESTATUS[0]}"
