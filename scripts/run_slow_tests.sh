#!/usr/bin/env bash
# The tests marked slow (long runs a benchmark or an experiment needs), which the quick
# start's scripts/run_tests.sh leaves out. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -m slow "$@"
