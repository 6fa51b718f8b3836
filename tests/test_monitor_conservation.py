"""Error-feedback conservation under injected bit flips (reliability.md E2).

``TopKState(verify_conservation=True)`` checks ``sent + residual == grad/ws + old_residual``
bit for bit before the bucket is sent. A flip in a payload value or in the new residual
between selection and send must fail that check in the same step, on the rank where it
happened. Two cases, in one pair of processes:

A. The payload flip on both ranks: both raise before sending, no collective is pending
   anywhere, nothing can hang.
B. The realistic case, a residual flip on rank 1 only. Rank 1 raises before sending; rank
   0 has already sent and waits in the all-gather for rank 1's payload, which never
   comes, until the DDP process group's timeout (3 s here, on a group of its own). What
   happens then depends on the transport: an earlier ``sparsecomm.comm.allgather_future``
   swallowed the timeout and backward returned with the previous step's
   gathered payloads (a bug since fixed), with a correct transport it raises. Either way
   both ranks then take part in ``GradientAgreementMonitor``'s vote, which raises on both,
   so no rank commits the step and the replicas stay identical.
"""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from rank_processes import run_on_ranks
from sparsecomm import ConservationError, TopKState, topk_hook
from sparsecomm.monitor import BitFlipInjector, CorruptionDetected, GradientAgreementMonitor

pytestmark = pytest.mark.timeout(120)

FAULT_STEP = 3  # the first sparse steps are 2, 3, ... (2 warm-up steps)
HOOK_GROUP_TIMEOUT = timedelta(seconds=3)


def _mlp(width=32, out=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, out))


def _train_until_failure(rank, injector, group):
    model = _mlp()
    ddp = DDP(model, process_group=group)
    state = TopKState(group, density=0.05, module=ddp, verify_conservation=True)
    ddp.register_comm_hook(state, topk_hook)
    state.add_observer(injector)
    vote = GradientAgreementMonitor(ddp, every=1)  # a commit vote every step, on the default group (stays healthy)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    for step in range(FAULT_STEP + 2):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        local = None
        try:
            ddp(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()
        except Exception as error:  # DDP re-raises the hook's error from backward()
            local = error
        try:
            vote.check(step, local_error=local)
        except CorruptionDetected as error:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            return {
                "step": step,
                "local": None if local is None else (type(local).__name__, str(local)),
                "vote": (error.check, error.step, error.ranks),
                "params_unchanged": unchanged,
                "params": [p.detach().clone() for p in model.parameters()],
                "injected": injector.injected,
            }
        optimizer.step()
    return {"step": None, "injected": injector.injected}


def _e2_worker(rank, world_size):
    payload_flip = BitFlipInjector("payload", step=FAULT_STEP, rank=None, bit=3, index=0)
    case_a = _train_until_failure(rank, payload_flip, None)
    group = dist.new_group(backend="gloo", timeout=HOOK_GROUP_TIMEOUT)
    residual_flip = BitFlipInjector("residual", step=FAULT_STEP, rank=1, bit=30, index=10, name="2.weight")
    case_b = _train_until_failure(rank, residual_flip, group)
    return case_a, case_b


def test_e2_bit_flip_in_payload_or_residual_fails_conservation_in_the_same_step():
    (a0, b0), (a1, b1) = run_on_ranks(_e2_worker)
    # A: mantissa flip in a sent value, both ranks: both fail their own check at that step.
    for a in (a0, a1):
        assert a["step"] == FAULT_STEP and len(a["injected"]) == 1
        assert a["local"][0] == ConservationError.__name__
        assert "sent + residual != grad/ws + old_residual" in a["local"][1]
        assert a["vote"] == ("gradient_agreement", FAULT_STEP, (0, 1)) and a["params_unchanged"]
    # B: exponent flip in rank 1's new residual only.
    assert b0["injected"] == [] and len(b1["injected"]) == 1
    assert b1["step"] == FAULT_STEP and b1["local"][0] == ConservationError.__name__
    assert b0["step"] == FAULT_STEP  # rank 0 stopped in the same step
    # Rank 0's all-gather times out and raises (the transport reports failed collectives),
    # so both ranks bring a local error to the vote and both are named.
    assert b0["local"] is not None and b0["local"][0] != ConservationError.__name__
    assert b0["vote"] == b1["vote"] == ("gradient_agreement", FAULT_STEP, (0, 1))
    assert b0["params_unchanged"] and b1["params_unchanged"]
    for p, q in zip(b0["params"], b1["params"]):
        assert torch.equal(p, q)
