"""Run a function on several gloo (or NCCL, one GPU each) ranks in separate processes, with a hard timeout.

Ranks are forked from a server process that has imported torch once (the ``forkserver``
start method), so a test pays milliseconds per rank instead of a fresh interpreter's import
of torch; each rank gets the parent's environment as it is at the call. Each rank runs ``fn(rank, world_size, *args)`` after joining a gloo group through a
FileStore; return values come back through files. A rank that raises fails the test with
its traceback; ranks still running at the deadline are killed, so a hang never blocks CI.
"""
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

# A collective that does not complete within this time raises inside the rank instead of
# hanging; shorter than the process deadline so the rank's own error is reported.
COLLECTIVE_TIMEOUT = timedelta(seconds=45)
STORE_HOST = "127.0.0.1"


# Imported once by the fork server, before it forks any rank: the costly imports every rank
# shares (DDP's constructor imports torch._dynamo: seconds per rank). Nothing here may read
# the environment a test sets (that arrives with each call):
# sparsecomm.hooks does not load the native library, which reads SPARSECOMM_CPU_CAPABILITY.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "pytest", "sparsecomm.hooks"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(rank, world_size, workdir, store_port, environment, backend, fn, args):
    result_path = os.path.join(workdir, f"rank{rank}.pkl")
    # The fork server's environment is the parent's when the server started; a test may have
    # set variables since (monkeypatch.setenv), so take the parent's at this call.
    os.environ.clear()
    os.environ.update(environment)
    try:
        store = dist.TCPStore(STORE_HOST, store_port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        device = None
        if backend == "nccl":  # one GPU per rank
            import torch

            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=device)
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report everything, including assertion errors, to the parent
        outcome = ("error", traceback.format_exc())
    # Write to a temporary name and rename: the parent never reads half a result.
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(result_path + ".tmp", result_path)
    # Leave without destroy_process_group() or interpreter teardown: tearing gloo down
    # occasionally aborts the process from a background thread ("terminate called without
    # an active exception", "Resource deadlock avoided") after all work is done.
    os._exit(0)


def _spawn(fn, args, world_size: int, timeout: float, backend: str = "gloo"):
    """Run ``fn`` on every rank; (exit codes, outcomes by rank: ("ok"|"error", value) or None
    for a rank that left no result, ranks still running at the deadline, killed)."""
    with tempfile.TemporaryDirectory() as workdir:
        ctx = _context()
        environment = dict(os.environ)
        # The parent serves the ranks' store on a port the system picks: no port to collide on,
        # and no polling of a shared file (a FileStore made gloo's connection set-up take
        # tens of seconds at 8 ranks on 2 cores).
        store = dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=COLLECTIVE_TIMEOUT)
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, workdir, store.port, environment, backend, fn, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r in range(world_size):
            path = os.path.join(workdir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes.append(pickle.load(f))
            else:
                outcomes.append(None)
        return [p.exitcode for p in procs], outcomes, hung


def run_on_ranks(fn, *args, world_size: int = 2, timeout: float = 90.0, backend: str = "gloo") -> list:
    """Results of ``fn(rank, world_size, *args)`` on each rank, in rank order; ``backend="nccl"``
    gives rank r the GPU cuda:r."""
    exit_codes, outcomes, hung = _spawn(fn, args, world_size, timeout, backend)
    results, errors = [], []
    for r, outcome in enumerate(outcomes):
        if outcome is None:
            errors.append(f"rank {r}: no result (exit code {exit_codes[r]})")
            continue
        status, value = outcome
        if status == "error":
            errors.append(f"rank {r} raised:\n{value}")
        results.append(value)
    if hung:
        errors.insert(0, f"ranks {hung} still running after {timeout}s and were killed")
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def run_on_ranks_allowing_deaths(fn, *args, world_size: int = 2, timeout: float = 90.0) -> dict:
    """Like :func:`run_on_ranks`, but a rank may die (be killed): {rank: (exit code, result
    or None)}. A rank that raised, or one still running at the deadline, fails the test."""
    exit_codes, outcomes, hung = _spawn(fn, args, world_size, timeout)
    assert not hung, f"ranks {hung} still running after {timeout}s (a survivor hung)"
    out = {}
    for r, outcome in enumerate(outcomes):
        if outcome is not None:
            assert outcome[0] == "ok", outcome[1]
        out[r] = (exit_codes[r], None if outcome is None else outcome[1])
    return out
