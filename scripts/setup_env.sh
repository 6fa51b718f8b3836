#!/usr/bin/env bash
# Create or update ./.venv with everything sparsecomm needs. Idempotent.
# torch is installed first and pinned: a bare "torch" requirement resolved from scratch
# would pull a multi-GB CUDA build. Override with SPARSECOMM_TORCH=torch==X.Y.Z (pip keeps a
# torch that already satisfies it).
# The install (minutes: it compiles the native kernels) runs only when one of its inputs changed
# since the last one (setup.py, this script, a file under csrc/, a build switch, torch or Python:
# scripts/setup_stamp.py lists them and records them in the stamp below) or the installed
# package no longer imports; otherwise set-up takes seconds. Delete the stamp to force an install.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
stamp=.venv/sparsecomm-setup.json
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
# One set-up at a time in a checkout: a second one waits, then finds the first one's stamp.
exec 9>>.venv/sparsecomm-setup.lock
if command -v flock >/dev/null; then flock 9; fi
if reason=$(.venv/bin/python scripts/setup_stamp.py check "$stamp"); then
  echo "setup: .venv is up to date (inputs unchanged since the last install; rm $stamp to install again)"
  exit 0
fi
echo "setup: $reason"
rm -f "$stamp"  # an install that stops half-way leaves no stamp behind
if [ -n "${SPARSECOMM_TORCH:-}" ] || ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing ${SPARSECOMM_TORCH:-torch==2.13.0}"
  .venv/bin/pip install --quiet "${SPARSECOMM_TORCH:-torch==2.13.0}"
fi
# The native kernels compile against the installed torch, so no build isolation (an
# isolated build would fetch its own torch); ninja parallelises the compile.
# A current pip (the one venv bundles runs the deprecated `setup.py develop`, which setuptools
# now hands back to an isolated pip build: no torch there).
.venv/bin/pip install --quiet --upgrade pip setuptools wheel ninja
# The inputs as the build starts: if one changes while it runs, no stamp is written.
inputs=$(.venv/bin/python scripts/setup_stamp.py digest)
echo "setup: installing sparsecomm (editable, building its native kernels) and its test dependencies"
.venv/bin/pip install --quiet --no-build-isolation --use-pep517 --editable ".[test]"
.venv/bin/python scripts/setup_stamp.py write "$stamp" "$inputs"
