"""The body of one CPU level's run for tests/test_kernels_isa.py, in a process forked from the
tests' fork server (tests/multiprocess.py), which has imported torch but not sparsecomm's
native library: a process chooses its CPU level when that library loads, so this module
imports nothing of sparsecomm itself, sets the environment (SPARSECOMM_CPU_CAPABILITY
included) and only then imports test_kernels_isa, whose import loads the library.
"""
import os
import traceback


def run(environment: dict, path: str, payloads: str) -> None:
    """test_kernels_isa's cases at the level ``environment`` names, saved to ``path``; a
    failure leaves its traceback in ``path + ".error"`` and exit code 1."""
    os.environ.clear()
    os.environ.update(environment)
    try:
        import test_kernels_isa

        test_kernels_isa._run_every_case(path, payloads)
    except BaseException:
        with open(path + ".error", "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # no interpreter teardown in a forked child (as tests/multiprocess.py's ranks)
