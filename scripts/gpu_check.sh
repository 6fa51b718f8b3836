#!/usr/bin/env bash
# Device check of the CUDA kernels (csrc/cuda/*.cu) and the Triton kernels on a GPU machine:
# build the extension against the torch installed there, run the GPU tests, then the benchmark.
#
# It runs on the machine as it is, offline, and installs nothing:
# - the interpreter is $PYTHON, else the first of python3 and python that imports torch (an
#   image may have python3 alone);
# - the extension is built in place with that interpreter's torch (`setup.py build_ext
#   --inplace`: no pip, no build isolation, nothing downloaded) and the checkout goes first on
#   PYTHONPATH; a rerun on the same machine reuses the objects under build/;
# - the tests need pytest and pytest-timeout (pytest.ini's per-test deadlines) beside torch,
#   Triton and numpy. Where they are missing the script says so, skips the tests, still runs the
#   benchmark and exits 1; carry them as wheels to run the tests.
#
# Expected runtime on an H200 box (16 cores): build ~2-4 min (nvcc compiles 6 .cu files: the
# 4 older ops with 9 dtype pairs each, chunk_encode (2 kernels) and chunk_decode_add (3 out
# dtypes), plus the CPU sources; only sm_90 unless TORCH_CUDA_ARCH_LIST says otherwise),
# tests ~3-5 min (the CUDA and Triton cases of tests/test_op_*.py, one file per op: the CUDA
# kernels' oracle runs on CPU copies, including a few 2^24-element cases; chunk_encode's and
# chunk_decode_add's, ~900 cases, run the pure-torch ChunkLayout reference for every index x
# value codec pair on 9 geometries, ~1-2 min of it; the Triton cases compile Triton kernels;
# tests/test_hook_cuda.py runs the hook under DDP with NCCL on the one GPU, selector="chunk"
# included; tests/test_hsdp_cuda.py the FSDP2 hook on its own CUDA stream, on 1 GPU, and on 2
# or 4 where the machine has them), torchtitan's trainer with the hook on 2 or 4 GPUs ~1 min
# (skipped on one GPU, or without torchtitan), benchmark ~1 min. About 7-10 minutes in all: leave room for
# one rerun (or run only tests/test_op_chunk_encode.py -k cuda first).
# A failed build stops the script; the benchmark runs even if tests fail; the exit status is
# non-zero if the build, a test or the benchmark failed, or the tests could not run.
#
# Usage, from anywhere:  bash scripts/gpu_check.sh
#   PYTHON=...              the interpreter (it must import a CUDA build of torch)
#   TORCH_CUDA_ARCH_LIST    the GPU targets (default 9.0: H100, H200); MAX_JOBS (default 16)
#   GPU_CHECK_DRY_RUN=1     print the interpreter and every step's command, run none of them
#                           (tests/test_gpu_check_script.py runs the script so on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=${GPU_CHECK_DRY_RUN:-0}
started=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - started ))s)"; }
show() { printf '+'; printf ' %q' "$@"; printf '\n'; }
# run CMD...: run it; in a dry run print it.
run() { if [ "$dry_run" = 1 ]; then show "$@"; else "$@"; fi; }
# run_logged LOG CMD...: run it with its output into LOG; in a dry run print it.
run_logged() {
  local log=$1
  shift
  if [ "$dry_run" = 1 ]; then show "$@"; echo "  (output into $log)"; else "$@" >"$log" 2>&1; fi
}
# run_python WHAT <<'PY' ... PY: run the code with the interpreter; in a dry run print WHAT.
run_python() {
  if [ "$dry_run" = 1 ]; then cat >/dev/null; echo "+ $(printf %q "$PYTHON") - <<'PY'  # $1"; else "$PYTHON" -; fi
}

if [ -z "${PYTHON:-}" ]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
      PYTHON=$candidate
      break
    fi
  done
fi
if [ -z "${PYTHON:-}" ]; then
  echo "gpu_check: neither python3 nor python on PATH imports torch; set PYTHON=/path/to/python" >&2
  exit 1
fi
echo "gpu_check: interpreter $PYTHON ($(command -v "$PYTHON" || echo "not on PATH"))"

stamp "versions"
run nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv,noheader || true
if command -v nvcc >/dev/null; then run nvcc --version || true; else echo "nvcc: not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"; fi
run_python "versions of Python, torch, CUDA, Triton" <<'PY'
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

stamp "build: sparsecomm._C in place against $PYTHON's torch (CPU + CUDA sources, a failed compile is an error)"
build_log=${TMPDIR:-/tmp}/sparsecomm_build.$$.log
if ! run_logged "$build_log" env MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    USE_CUDA=1 SPARSECOMM_BUILD_EXT=1 "$PYTHON" setup.py build_ext --inplace; then
  grep -n -E "error|Error" "$build_log" | head -n 60 || true
  tail -n 60 "$build_log"
  echo "BUILD FAILED (full log: $build_log)"
  exit 1
fi
if [ "$dry_run" != 1 ]; then
  grep -E "warning" "$build_log" | grep -E "csrc/cuda" | sort -u | head -n 20 || true
fi
# The package is imported from the checkout (nothing is installed), in every process the tests start.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "PYTHONPATH=$PYTHONPATH"
run_python "which ops have CUDA kernels" <<'PY'
import torch
import sparsecomm._C  # noqa: F401
ops = ("ef_topk_pack", "unpack_add", "chunk_encode", "chunk_decode_add")
print("CUDA kernels:", {op: torch._C._dispatch_has_kernel_for_dispatch_key(f"sparsecomm::{op}", "CUDA") for op in ops})
PY

status=0
stamp "tests"
# The op tests with CUDA or Triton implementations, and the GPU hooks' tests.
tests=(tests/test_op_ef_topk_pack.py tests/test_op_unpack_add.py tests/test_op_chunk_encode.py
       tests/test_op_chunk_decode_add.py tests/test_op_exact_topk_encode.py tests/test_op_exact_topk_decode_add.py
       tests/test_hook_cuda.py tests/test_hsdp_cuda.py)
if "$PYTHON" -c "import pytest, pytest_timeout" 2>/dev/null; then
  # -m "": the tests marked slow too (Triton's 16-bit cases); -k: the CUDA and Triton cases
  # (implementation ids cuda, triton-cuda, triton-interpreter; the hook files all), not the CPU ones.
  run "$PYTHON" -m pytest -q -rfEs -m "" -k "cuda or triton" --durations=10 "${tests[@]}" || status=$?
else
  echo "tests SKIPPED: $PYTHON cannot import pytest and pytest_timeout (carry their wheels to run ${tests[*]})"
  status=1
fi

stamp "torchtitan: its trainer with the hook across replicas (its launcher, FlexAttention, NCCL)"
# The worked example at 2 replicas (x 2 shards on 4 GPUs): torchtitan's own attention and
# collectives, which the CPU tests replace (docs/torchtitan.md, "On CPU"). NCCL needs a GPU per
# process, so a one-GPU machine cannot hold two replicas.
if [ "$dry_run" = 1 ]; then
  gpus=4 titan=1
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
  titan=$("$PYTHON" -c "import torchtitan" 2>/dev/null && echo 1 || echo 0)
fi
if [ "$titan" != 1 ]; then
  echo "torchtitan SKIPPED: $PYTHON cannot import torchtitan (carry the torchtitan==0.3.0 wheel and its dependencies)"
elif [ "${gpus:-0}" -lt 2 ]; then
  echo "torchtitan SKIPPED: 2 replicas need 2 GPUs (NCCL: one per process); this machine has ${gpus:-0}"
else
  run "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$(( gpus >= 4 ? 4 : 2 ))" \
    experiments/examples/torchtitan_hsdp.py --sparsecomm.enable --sparsecomm.density 0.035 \
    --sparsecomm.index_codec rice --sparsecomm.value_codec int2 --training.steps 30 --metrics.log_freq 10 \
    --dump_folder "${TMPDIR:-/tmp}/sparsecomm_torchtitan.$$" || status=$?
fi

stamp "benchmark"
run "$PYTHON" experiments/bench_kernels.py --device cuda --sizes 1e6 25e6 100e6 --densities 0.001 0.01 || status=$?

stamp "done (exit $status)"
exit "$status"
