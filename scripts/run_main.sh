#!/usr/bin/env bash
# Quick start, part 1: set up .venv, then run the main job on its built-in default.
# Extra arguments go to the job, e.g. scripts/run_main.sh --experiment digits-quick
# It writes its runs to runs/ and its plots to plots/ (both ignored by git: the checkout stays clean).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/sparsecomm compare "$@"
