"""The body of one CPU level's run for the op tests (kernel_implementations.CpuLevelRuns), in
a process forked from the tests' fork server (tests/rank_processes.py), which has imported torch
but not sparsecomm's native library: a process chooses its CPU level when that library loads,
so this module imports nothing of sparsecomm itself, sets the environment
(SPARSECOMM_CPU_CAPABILITY included) and only then imports the op's test module, whose import
loads the library.

Run as a script, it reports what a fresh interpreter does (tests/test_ops_dispatch.py):
``report`` prints the level the CPU kernels run at; ``refuse`` prints, as JSON, the errors of
asking for the level and of calling a kernel (None where there was none).
"""
import importlib
import json
import os
import sys
import traceback


def run(environment: dict, module: str, path: str, precomputed: str) -> None:
    """``module``'s cpu_level_cases() at the level ``environment`` names, saved to ``path``;
    a failure leaves its traceback in ``path + ".error"`` and exit code 1."""
    os.environ.clear()
    os.environ.update(environment)
    try:
        import torch

        import kernel_implementations
        from sparsecomm.ops import native

        kernel_implementations.load_precomputed(precomputed)
        cases = importlib.import_module(module).cpu_level_cases()
        torch.save({"capability": native.cpu_capability(), "results": kernel_implementations.run_cases(cases)}, path)
    except BaseException:
        with open(path + ".error", "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # no interpreter teardown in a forked child (as tests/rank_processes.py's ranks)


def _report_refusal() -> None:
    import torch

    from sparsecomm.ops import native

    messages = {}
    for what, call in (("cpu_capability", native.cpu_capability),
                       ("kernel", lambda: native.crc32c(torch.zeros(3, dtype=torch.uint8)))):
        try:
            call()
            messages[what] = None
        except RuntimeError as error:
            messages[what] = str(error)
    print(json.dumps(messages))


if __name__ == "__main__":
    if sys.argv[1] == "refuse":
        _report_refusal()
    else:  # report
        from sparsecomm.ops import native

        print(native.cpu_capability())
