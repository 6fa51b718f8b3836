"""NaN/Inf guard in the hook (reliability.md E4).

Localises: a guard that looks at the wrong tensor or stage (a NaN in the residual is
only visible in ``acc`` the next step), one that lets the bucket be sent before raising,
one that names the wrong parameter, and NaN reaching the other rank's weights.

Multi-rank: the NaN is injected on rank 0 only. Rank 0 raises before sending; rank 1
waits in that bucket's collective until its group times out (3 s, a DDP group of its
own), then both vote through GradientAgreementMonitor on the healthy default group and
both abandon the step (see test_monitor_conservation.py for what rank 1's backward does
at the timeout). A DDP group that lost a collective is not reused.
"""
import math
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from rank_processes import run_on_ranks
from sparsecomm import TopKState, compress, topk_hook
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.hooks.state.events import HookEvent
from sparsecomm.monitor import (
    CorruptionDetected,
    FiniteGuard,
    GradientAgreementMonitor,
    NonFiniteError,
    StalenessMonitor,
    UpdateSpikeDetector,
    ValueInjector,
)

pytestmark = pytest.mark.timeout(120)

NAMES, NUMELS = ("a", "b"), (6, 10)


def _event(stage, dense=False, **tensors):
    return HookEvent(stage, 9, 0, 2, NAMES, NUMELS, dense, tensors)


# ----- one process: what the guard checks and how it reports ------------------------------


def test_gradient_nan_is_named_by_parameter_and_counted():
    gradient = torch.zeros(16)
    gradient[8] = math.nan
    gradient[12] = math.inf
    with pytest.raises(NonFiniteError) as caught:
        FiniteGuard()(_event("gradient", gradient=gradient))
    error = caught.value
    assert (error.check, error.step, error.ranks) == ("finite", 9, (0,))
    assert (error.stage, error.bucket_index, error.tensor) == ("gradient", 2, "gradient")
    assert (error.parameter, error.element, error.count) == ("b", 2, 2)
    assert "b[2]" in str(error) and "2 non-finite entries" in str(error)


def _packed(acc, residual, k=2, value_dtype=torch.float32):
    payload = torch.empty(payload_nbytes(k, value_dtype), dtype=torch.uint8)
    indices = compress.select_and_pack(acc.clone(), k, compress.SELECTORS["exact"], payload, value_dtype)
    return _event("packed", acc=acc, residual=residual, indices=indices, payload=payload)


def test_packed_stage_checks_acc_residual_and_payload_values():
    acc = torch.arange(16.0)
    FiniteGuard()(_packed(acc, torch.zeros(16)))  # all finite: silent
    bad_acc = acc.clone()
    bad_acc[3] = -math.inf
    with pytest.raises(NonFiniteError) as caught:
        FiniteGuard()(_packed(bad_acc, torch.zeros(16)))
    assert (caught.value.tensor, caught.value.parameter, caught.value.element) == ("acc", "a", 3)
    residual = torch.zeros(16)
    residual[7] = math.nan
    with pytest.raises(NonFiniteError) as caught:
        FiniteGuard()(_packed(acc, residual))
    assert (caught.value.tensor, caught.value.parameter, caught.value.element) == ("residual", "b", 1)
    # A payload value corrupted after packing (acc itself is fine): decoded with the state's layout.
    event = _packed(acc, torch.zeros(16))
    k = 2
    event.tensors["payload"][4 * k + 4 : 4 * k + 8] = torch.tensor([math.nan]).view(torch.uint8)
    FiniteGuard()(event)  # without the state the guard checks acc[indices], which is finite
    with pytest.raises(NonFiniteError) as caught:
        FiniteGuard(state=SimpleNamespace(value_dtype=None))(event)
    selected = int(event.tensors["indices"][1])
    assert caught.value.tensor == "payload" and (caught.value.parameter, caught.value.element) == ("b", selected - 6)


def test_packed_stage_of_the_fused_kernel_checks_the_residual_and_the_sent_values():
    # The fused kernel never writes acc (acc=None): its entries are the sent values and the new residual.
    values = torch.tensor([2.0, 3.0])
    residual = torch.zeros(16)
    event = _event("packed", acc=None, residual=residual, indices=torch.tensor([4, 11]),
                   payload=torch.zeros(16, dtype=torch.uint8), values=values)
    FiniteGuard()(event)  # all finite: silent
    residual[13] = math.inf
    with pytest.raises(NonFiniteError) as caught:
        FiniteGuard()(event)
    assert (caught.value.tensor, caught.value.parameter, caught.value.element) == ("residual", "b", 7)
    residual[13] = 0.0
    values[1] = math.nan
    with pytest.raises(NonFiniteError) as caught:
        FiniteGuard()(event)
    assert (caught.value.tensor, caught.value.parameter, caught.value.element) == ("payload", "b", 5)


def test_dense_and_random_k_payloads_and_record_mode():
    buffer = torch.ones(16)
    FiniteGuard()(_event("packed", dense=True, acc=buffer, residual=None, indices=None, payload=buffer))
    values = torch.tensor([1.0, math.nan])
    guard = FiniteGuard(action="record")
    guard(_event("packed", acc=buffer, residual=None, indices=torch.tensor([4, 11]), payload=values))
    assert len(guard.alarms) == 1 and (guard.alarms[0].parameter, guard.alarms[0].element) == ("b", 5)
    with pytest.raises(ValueError, match="action"):
        FiniteGuard(action="ignore")


# ----- E4: NaN on rank 0 only, 2 gloo ranks ------------------------------------------------


def _mlp(width=32, out=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, out))


def _run_case(rank, case, group):
    model = _mlp()
    ddp = DDP(model, process_group=group)
    state = TopKState(group, density=0.05, module=ddp)
    ddp.register_comm_hook(state, topk_hook)
    guard = FiniteGuard(state=state)
    if case == "gradient":  # NaN in the local gradient at step 3, before compression
        injector = ValueInjector("gradient", step=3, rank=0, value=math.nan, index=5, name="2.weight")
        observers = [injector, guard]
    else:  # NaN written into the residual memory after step 3's checks: surfaces at step 4
        injector = ValueInjector("residual", step=3, rank=0, value=math.nan, index=5, name="2.weight")
        observers = [guard, injector]
    for observer in observers:
        state.add_observer(observer)
    vote = GradientAgreementMonitor(ddp, every=1)  # a commit vote every step, on the default group
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    for step in range(6):
        optimizer.zero_grad()
        local = None
        try:
            ddp(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()
        except Exception as error:
            local = error
        try:
            vote.check(step, local_error=local)
        except CorruptionDetected as error:
            residuals = [v for k, v in state.memories.residuals.state_dict().items()] if state.memories.residuals else []
            return {
                "step": step,
                "local": None if not isinstance(local, NonFiniteError) else
                (local.stage, local.tensor, local.parameter, local.element, local.count, local.step),
                "vote": (error.check, error.step, error.ranks),
                "params": [p.detach().clone() for p in model.parameters()],
                "residual_finite": all(bool(torch.isfinite(r).all()) for r in residuals),
                "injected": injector.injected,
            }
        optimizer.step()
    return {"step": None}


def _e4_worker(rank, world_size):
    out = {}
    for case in ("gradient", "residual"):
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
        out[case] = _run_case(rank, case, group)
    return out


def test_e4_nan_on_rank0_is_stopped_before_the_collective():
    r0, r1 = run_on_ranks(_e4_worker)
    # Gradient NaN: caught at stage "gradient" of step 3, before compression and sending.
    g0, g1 = r0["gradient"], r1["gradient"]
    assert g0["local"] == ("gradient", "gradient", "2.weight", 5, 1, 3)
    assert g0["step"] == g1["step"] == 3
    # Rank 1's collective then times out and raises too (the transport reports failed
    # collectives), so both ranks bring a local error to the vote and both are named.
    assert g0["vote"] == g1["vote"] == ("gradient_agreement", 3, (0, 1))
    assert g0["residual_finite"] and g1["residual_finite"]  # the NaN never entered a residual
    # Residual NaN: present in memory after step 3, caught at step 4 before sending. The
    # fused kernel (kept: no observer reads acc) never writes acc; the NaN entry of acc is
    # either selected (then it is in the sent values) or kept (in the new residual),
    # depending on where the kernel ranks a NaN.
    n0, n1 = r0["residual"], r1["residual"]
    assert n0["injected"][0]["step"] == 3 and n1["injected"] == []
    stage, tensor, *where = n0["local"]
    assert stage == "packed" and tensor in ("payload", "residual") and where == ["2.weight", 5, 1, 4]
    assert n0["vote"] == n1["vote"] == ("gradient_agreement", 4, (0, 1))
    # Neither NaN reached a weight: identical and finite on both ranks.
    for case in ("gradient", "residual"):
        for p, q in zip(r0[case]["params"], r1[case]["params"]):
            assert torch.isfinite(p).all() and torch.equal(p, q)


# ----- the guards watch the fused kernel without changing what it computes -------------------


def _observed_run(rank, observers):
    model = _mlp()
    ddp = DDP(model)
    state = TopKState(density=0.05, module=ddp, budget="bucket")  # fused from the first sparse step
    ddp.register_comm_hook(state, topk_hook)
    for make in observers:
        state.add_observer(make(state))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    for _ in range(6):
        optimizer.zero_grad()
        ddp(torch.randn(8, 32, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    stats = state.stats()
    return [p.detach().clone() for p in model.parameters()], stats["sparse_calls"], stats["fused_calls"]


def _fused_worker(rank, world_size):
    return {
        "none": _observed_run(rank, []),
        "guards": _observed_run(rank, [lambda s: FiniteGuard(state=s), lambda s: UpdateSpikeDetector(),
                                       lambda s: StalenessMonitor(50),
                                       lambda s: ValueInjector("residual", step=99, rank=0, value=math.nan)]),
        "spike on acc": _observed_run(rank, [lambda s: UpdateSpikeDetector(stage="packed")]),
    }


def test_guards_keep_the_hooks_fused_kernel_and_change_nothing():
    for runs in run_on_ranks(_fused_worker):
        reference, sparse_calls, fused_calls = runs["none"]
        assert sparse_calls == fused_calls > 0
        params, sparse_calls, fused_calls = runs["guards"]
        assert fused_calls == sparse_calls > 0  # none of them needs acc
        assert all(torch.equal(p, q) for p, q in zip(params, reference))
        params, sparse_calls, fused_calls = runs["spike on acc"]
        assert fused_calls == 0 < sparse_calls  # judging acc needs it written: the compensated path
        assert all(torch.equal(p, q) for p, q in zip(params, reference))  # same results, bit for bit
