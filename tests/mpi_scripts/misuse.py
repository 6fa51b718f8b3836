"""Run by tests/test_mpi_transport.py as ``mpiexec -n 2 python misuse.py OUT_DIR``.

Each misuse must raise the same clear error on every rank, before any collective of the
hook (a rank that raised while the other went on would hang the job). Each rank writes
``OUT_DIR/rank{r}.json``: case -> [exception type, message] or None if nothing was raised.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.dist import init_distributed


def outcome(call):
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return [type(error).__name__, str(error)]
    return None


def main(out_dir: str) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    report = {}

    # init_distributed: explicit RANK/WORLD_SIZE that disagree with MPI and no MASTER_ADDR.
    os.environ.update(RANK=str(rank), WORLD_SIZE="3")
    report["init_mismatch"] = outcome(init_distributed)
    del os.environ["RANK"], os.environ["WORLD_SIZE"]

    # A torch world of one process per MPI rank: sizes differ (2 MPI processes, 1 torch rank).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    report["size_mismatch"] = outcome(lambda: sparsecomm.TopKState(transport="mpi"))
    dist.destroy_process_group()

    # torch ranks reversed with respect to MPI ranks.
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    port = MPI.COMM_WORLD.bcast(store.port if store else None, root=0)
    store = store or dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=1 - rank, world_size=2)
    subgroup = dist.new_group([0, 1])
    report["non_default_group"] = outcome(lambda: sparsecomm.TopKState(subgroup, transport="mpi"))

    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    state = sparsecomm.register_topk_hook(model, density=0.1, transport="mpi")

    def first_step():
        model(torch.randn(4, 8)).sum().backward()

    report["rank_permutation"] = outcome(first_step)
    report["pending_after_error"] = state.pending_collectives
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    # No destroy_process_group(): DDP's reducer is mid-backward after the hook raised.
    MPI.COMM_WORLD.Barrier()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
