#!/usr/bin/env bash
# Device check of the CUDA kernels (csrc/cuda/*.cu) for a session lent a GPU for a few minutes.
#
# Expected runtime on an H200 box (16 cores): build ~2-4 min (nvcc compiles 6 .cu files: the
# 4 older ops with 9 dtype pairs each, chunk_encode (2 kernels) and chunk_decode_add (3 out
# dtypes), plus the CPU sources; only sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise),
# tests ~3-5 min (tests/test_kernels_cuda.py runs its oracle on CPU copies, including a few
# 2^24-element cases; its chunk section, ~470 cases, runs the pure-torch ChunkLayout reference
# for every index x value codec pair on 9 geometries, ~1-2 min of it; tests/test_kernels_triton.py
# compiles Triton kernels; tests/test_hook_cuda.py runs the hook under DDP with NCCL on the one
# GPU, selector="chunk" included; tests/test_hsdp_cuda.py the FSDP2 hook on its own CUDA
# stream, on 1 GPU, and on 2 or 4 where the machine has them), benchmark ~1 min. About 7-10 minutes in all: leave room in
# the device budget for one rerun (or run only tests/test_kernels_cuda.py -k chunk first).
# A failed build stops the script; the benchmark runs even if tests fail; the exit status is
# non-zero if the build, a test or the benchmark failed.
#
# Usage, from anywhere:  bash scripts/gpu_check.sh          (PYTHON=... to pick the interpreter)
# Assumes a CUDA build of torch and nvcc (CUDA_HOME) on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
started=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - started ))s)"; }

stamp "versions"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv,noheader || true
if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "nvcc: not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"; fi
"$PYTHON" - <<'PY'
import sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
PY

stamp "build: USE_CUDA=1 SPARSECOMM_BUILD_EXT=1 pip install --no-build-isolation --no-deps -e . (--no-deps: the GPU machine is offline)"
build_log=$(mktemp /tmp/sparsecomm_build.XXXXXX.log)
if ! MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} USE_CUDA=1 SPARSECOMM_BUILD_EXT=1 \
    "$PYTHON" -m pip install --no-build-isolation --no-deps -e . >"$build_log" 2>&1; then
  grep -n -E "error|Error" "$build_log" | head -n 60 || true
  tail -n 60 "$build_log"
  echo "BUILD FAILED (full log: $build_log)"
  exit 1
fi
grep -E "warning" "$build_log" | grep -E "csrc/cuda" | sort -u | head -n 20 || true
"$PYTHON" - <<'PY'
import torch
import sparsecomm._C  # noqa: F401
ops = ("ef_topk_pack", "unpack_add", "chunk_encode", "chunk_decode_add")
print("CUDA kernels:", {op: torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsecomm::{op}", "CUDA") for op in ops})
PY

status=0
stamp "tests"
"$PYTHON" -m pytest -q -rfEs -m "" --durations=10 tests/test_kernels_cuda.py tests/test_kernels_triton.py tests/test_kernels_triton_chunk.py tests/test_kernels_compact.py tests/test_hook_cuda.py tests/test_hsdp_cuda.py tests/test_hsdp_cuda.py || status=$?

stamp "benchmark"
"$PYTHON" experiments/bench_kernels.py --device cuda --sizes 1e6 25e6 100e6 --densities 0.001 0.01 || status=$?

stamp "done (exit $status)"
exit "$status"
