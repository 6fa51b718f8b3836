"""Run by tests/test_wire_integrity.py as ``mpiexec -n 2 python wire_integrity.py OUT_DIR``.

transport="mpi" with the wire checksum: one value bit of rank 1's payload is flipped after
encoding at step 3, on the fixed-size Iallgatherv (exact top-k), the variable one (the
sampled selector: payloads of a different size per rank, each sealed) and the owner
exchange's Alltoallv. Each rank writes ``OUT_DIR/rank{r}.json``: per wire, the error every
step raised (None if none) and whether the parameters stayed as they were at that step.
"""
import json
import os
import sys

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.dist import init_distributed, shutdown
from sparsecomm.monitor.fault_injector import BitFlipInjector

STEPS, FAULT_STEP, SENDER = 5, 3, 1
WIRES = {  # options, and the bit flipped in the first sent value (4-bit codes: inside its byte)
    "exact": ({"selector": "exact"}, 22),
    "sampled": ({"selector": "sampled"}, 22),
    "owner": ({"selector": "chunk", "exchange": "owner", "chunk_size": 256, "index_codec": "rice",
               "value_codec": "int4"}, 1),
}


def train(rank: int, options: dict, bit: int) -> dict:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 1)), bucket_cap_mb=0.05)
    state = sparsecomm.register_topk_hook(model, density=0.02, transport="mpi", allow_dense_fallback=False, **options)
    state.add_observer(BitFlipInjector("payload", step=FAULT_STEP, rank=SENDER, bit=bit, index=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    errors, unchanged = [], []
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 1, generator=generator)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        try:
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            errors.append(None)
        except RuntimeError as error:  # DDP re-raises the hook's error from backward()
            errors.append(str(error))
        unchanged.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return {"errors": errors, "unchanged": unchanged}


def main(out_dir: str) -> None:
    info = init_distributed()
    report = {wire: train(info.rank, options, bit) for wire, (options, bit) in WIRES.items()}
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(report, f)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
