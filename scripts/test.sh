#!/usr/bin/env bash
# Creates .venv if missing, installs tfdp with its test dependencies, runs the whole test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k launch`).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/_venv.sh
tfdp_venv "[test]"

# The multi-host test builds network namespaces with iproute2 (root only; it skips elsewhere).
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "==> installing iproute2 for the network-namespace test"
  (apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null) || echo "could not install iproute2; the namespace test will skip"
fi

# Byte-compile the repo's own modules once: where PYTHONDONTWRITEBYTECODE is set (as in many
# containers) Python never writes them, and each of the suite's ~250 processes would compile
# tfdp's modules again (0.3-0.4 CPU-s each). A file edited later is compiled in memory as usual.
.venv/bin/python -m compileall -q tfdp tests scripts models >/dev/null

echo "==> running the test suite"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
set +e
.venv/bin/python -m pytest tests/ -q -p no:cacheprovider --durations=15 "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit "$code"
