#!/usr/bin/env bash
# Create or update ./.venv with everything sparsecomm needs. Idempotent.
# torch is installed first and pinned: a bare "torch" requirement resolved from scratch
# would pull a multi-GB CUDA build. Override with SPARSECOMM_TORCH=torch==X.Y.Z.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing ${SPARSECOMM_TORCH:-torch==2.13.0}"
  .venv/bin/pip install --quiet "${SPARSECOMM_TORCH:-torch==2.13.0}"
fi
# The native kernels compile against the installed torch, so no build isolation (an
# isolated build would fetch its own torch); ninja parallelises the compile.
# A current pip (the one venv bundles runs the deprecated `setup.py develop`, which setuptools
# now hands back to an isolated pip build: no torch there).
.venv/bin/pip install --quiet --upgrade pip setuptools wheel ninja
echo "setup: installing sparsecomm (editable, building its native kernels) and its test dependencies"
.venv/bin/pip install --quiet --no-build-isolation --use-pep517 --editable ".[test]"
.venv/bin/python -c "from sparsecomm.ops import native; ok, why = native.load(); print('setup: native kernels', 'built' if ok else f'NOT available: {why}')"
