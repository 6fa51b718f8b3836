#!/usr/bin/env bash
# Quick start, part 2: set up .venv, then run the whole test suite.
# Extra arguments go to pytest, e.g. scripts/run_tests.sh -k conservation
# Two pytest workers (pytest-xdist), each given whole files (--dist loadfile) so a file's
# shared experiments run once: many tests wait on their ranks' start-up and collectives, so
# one worker keeps a 2-core machine about 60% busy. SPARSECOMM_TEST_WORKERS=0 runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -n "${SPARSECOMM_TEST_WORKERS:-2}" --dist loadfile "$@"
