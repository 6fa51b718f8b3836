#!/usr/bin/env bash
# Quick start, part 2: set up .venv, then run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/run_tests.sh -k conservation
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest "$@"
