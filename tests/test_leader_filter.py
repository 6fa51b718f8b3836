"""ScaleCom's low-pass filter on the shared-index exchange's memory (``leader_filter``) and the
leader-overlap diagnostic (``diagnose_leader_overlap``), on the hook and on the averager.

Oracles: cases worked by hand (the numbers are in the tests, every one exact in float32: the
gradients are three times dyadic numbers, so that grad / 3 is exact), the filter's update
``m = (1 - beta) m + beta (acc - sent)`` (Chen et al., NeurIPS 2020, Algorithm 1) and which
entries the leader picks, with and without the filter; the overlap against ``torch.topk`` of
the ranks' summed acc, per chunk, computed here from what every rank formed.
"""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from ddp_models import mlp, rank_data
from rank_processes import run_on_ranks
from sparsecomm import SparseDeltaAverager
from sparsecomm.averaging.sparse_delta import check_settings


class _Vector(torch.nn.Module):
    """One parameter ``w``; the loss ``sum(w * x)`` makes ``x`` its gradient, exactly."""

    def __init__(self, numel: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel))

    def forward(self, x):
        return (self.w * x).sum()


# ----- the hook: 3 ranks, one bucket of 6 entries, k = 2 -----------------------------------------

# acc before the memory, grad / 3, per sparse step (2, 3, 4: after the 2 warm-up steps) and rank.
# The leader of bucket 0 at step t is rank t mod 3: rank 2, then 0, then 1.
HOOK_GRAD_OVER_P = {
    2: [[4, 0, 0, 0, 0, 1], [4, 0, 0, 0, 0, 0.5], [0, 0, 2, 1, 0, 0]],
    3: [[0, 2.5, 0, 0, 3, 0], [0, 2.5, 0, 0, 3, 0], [0, 2.5, 0, 0, 3, 0]],
    4: [[0, 0, 0, 0, 0, 0], [0, 0, 0, 1.5, 0, 0], [0, 0, 0, 0, 0, 1]],
}
# Worked by hand. Step 2: the memories are 0, leader 2's top 2 of [0 0 2 1 0 0] is {2, 3}; the
# summed acc [8 0 2 1 0 1.5] has top 2 {0, 2}: overlap 1/2.
#   plain:    m = acc - sent: rank 0 [4 0 0 0 0 1], rank 1 [4 0 0 0 0 .5], rank 2 0.
#   beta 1/2: m = m/2 + (acc - sent)/2: rank 0 [2 0 0 0 0 .5], rank 1 [2 0 0 0 0 .25], rank 2 0.
# Step 3, leader 0. Plain: its acc [4 2.5 0 0 3 1] picks {0, 4}; the sum [8 7.5 0 0 9 1.5] has
#   top 2 {4, 0}: overlap 1. Filtered: its acc [2 2.5 0 0 3 .5] picks {1, 4} (the filtered
#   memory no longer outweighs the fresh 2.5); the sum [4 7.5 0 0 9 .75] has top 2 {4, 1}:
#   overlap 1. Where nothing was sent and nothing came, the filtered memory stays (m/2 + m/2).
# Step 4, leader 1. Plain: its acc [0 2.5 0 1.5 0 .5] picks {1, 3}; the sum [0 7.5 0 1.5 0 2.5]
#   has top 2 {1, 5}: overlap 1/2. Filtered: its acc [2 0 0 1.5 0 .25] picks {0, 3}; the sum
#   [4 0 0 1.5 0 1.75] has top 2 {0, 5}: overlap 1/2.
HOOK_PICKS = {None: {2: [2, 3], 3: [0, 4], 4: [1, 3]}, 0.5: {2: [2, 3], 3: [1, 4], 4: [0, 3]}}
HOOK_MEMORY = {
    None: {2: [[4, 0, 0, 0, 0, 1], [4, 0, 0, 0, 0, 0.5], [0, 0, 0, 0, 0, 0]],
           3: [[0, 2.5, 0, 0, 0, 1], [0, 2.5, 0, 0, 0, 0.5], [0, 2.5, 0, 0, 0, 0]],
           4: [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0.5], [0, 0, 0, 0, 0, 1]]},
    0.5: {2: [[2, 0, 0, 0, 0, 0.5], [2, 0, 0, 0, 0, 0.25], [0, 0, 0, 0, 0, 0]],
          3: [[2, 0, 0, 0, 0, 0.5], [2, 0, 0, 0, 0, 0.25], [0, 0, 0, 0, 0, 0]],
          4: [[1, 0, 0, 0, 0, 0.5], [1, 0, 0, 0, 0, 0.25], [0, 0, 0, 0, 0, 0.5]]},
}
HOOK_OVERLAP = {2: 0.5, 3: 1.0, 4: 0.5}  # the same with and without the filter, here


def _hook_steps(rank, world_size, leader_filter, diagnose):
    ddp = DDP(_Vector(6))
    settings = {"leader_filter": leader_filter} if leader_filter is not None else {}
    state = sparsecomm.register_topk_hook(ddp, density=1 / 3, momentum=0, exchange="shared-index", budget="bucket",
                                          allow_dense_fallback=False, diagnose_leader_overlap=diagnose, **settings)
    picked = {}

    def observe(event):
        if event.stage == "packed" and not event.dense:
            picked[event.step] = sorted(event.tensors["indices"].tolist())

    state.add_observer(observe)
    memories, overlaps = {}, {}
    for step in range(5):
        x = torch.tensor(HOOK_GRAD_OVER_P[step][rank], dtype=torch.float32) * 3 if step >= 2 else torch.zeros(6)
        ddp.module.w.grad = None
        ddp(x).backward()
        if step >= 2:
            memories[step] = state.memories.residuals.get("w").tolist()
            overlaps[step] = state.stats()["last_step"]["leader_overlap"]
    return picked, memories, overlaps, state.stats()


@pytest.mark.parametrize("leader_filter", [None, 0.5, 1.0])
def test_hook_memory_and_leader_picks_worked_by_hand(leader_filter):
    expected = 0.5 if leader_filter == 0.5 else None  # 1.0 is plain error feedback
    results = run_on_ranks(_hook_steps, leader_filter, True, world_size=3, timeout=120)
    for rank, (picked, memories, overlaps, stats) in enumerate(results):
        assert picked == HOOK_PICKS[expected], rank
        for step in (2, 3, 4):
            assert memories[step] == HOOK_MEMORY[expected][step][rank], (rank, step)
        assert overlaps == HOOK_OVERLAP, rank
        assert stats["leader_overlap_buckets"] == 3 and stats["leader_overlap_sum"] == 2.0
        assert stats["leader_overlap"] == pytest.approx(2 / 3)
        assert stats["shared_index_calls"] == 3


def test_without_the_diagnostic_no_overlap_is_measured():
    picked, memories, overlaps, stats = run_on_ranks(_hook_steps, 0.5, False, world_size=3, timeout=120)[0]
    assert picked == HOOK_PICKS[0.5] and memories[4] == HOOK_MEMORY[0.5][4][0]  # the same steps
    assert overlaps == {2: None, 3: None, 4: None}
    assert stats["leader_overlap"] is None and stats["leader_overlap_buckets"] == 0


def _chunked_overlaps(rank, world_size):
    torch.manual_seed(0)
    ddp = DDP(mlp(width=40, depth=3), bucket_cap_mb=0.004)
    state = sparsecomm.register_topk_hook(ddp, density=0.03, momentum=0, selector="chunk", chunk_size=128,
                                          index_codec="rice", exchange="shared-index", budget="bucket",
                                          leader_filter=0.5, diagnose_leader_overlap=True)
    seen = []

    def observe(event):
        if event.stage == "packed" and not event.dense:
            seen.append((event.step, event.bucket_index, event.tensors["acc"].clone(),
                         event.tensors["indices"].clone()))

    state.add_observer(observe)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    per_step = []
    for x in rank_data(rank, 5, (8, 40)):  # different data on every rank
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x[:, :4].sin()).backward()
        optimizer.step()
        per_step.append(state.stats()["last_step"])
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    return everyone, per_step


def _top_of_chunks(values: torch.Tensor, chunk: int, density: float) -> set:
    picked = set()
    for start in range(0, values.numel(), chunk):
        piece = values[start: start + chunk].abs()
        k = -(-int(round(density * piece.numel() * 1e6)) // int(1e6))
        picked |= {start + i for i in torch.topk(piece, k).indices.tolist()}
    return picked


def test_the_overlap_is_the_leaders_share_of_the_top_of_the_summed_acc_per_chunk():
    # 2 ranks: a + b is one correctly rounded addition in float32, the sum gloo forms too.
    everyone, per_step = run_on_ranks(_chunked_overlaps, world_size=2, timeout=180)[0]
    accs, picks = {}, {}
    for rank, seen in enumerate(everyone):
        for step, bucket, acc, indices in seen:
            accs.setdefault((step, bucket), {})[rank] = acc
            picks[(step, bucket)] = set(indices.tolist())  # every rank sends the leader's set
    by_step = {}
    for (step, bucket), rows in accs.items():
        top = _top_of_chunks(rows[0] + rows[1], 128, 0.03)
        by_step.setdefault(step, []).append(len(picks[(step, bucket)] & top) / len(top))
    assert len(by_step) == 3 and all(len(v) == 3 for v in by_step.values())  # 3 buckets
    assert any(value < 1 for values in by_step.values() for value in values)  # something to measure
    for last in per_step[2:]:
        expected = by_step[last["step"]]
        assert last["leader_overlap_buckets"] == len(expected)
        assert last["leader_overlap"] == pytest.approx(sum(expected) / len(expected), rel=1e-12)


# ----- the averager: 2 ranks, a model of 4 entries, k = 1, a sync every step ---------------------

# delta = anchor - weights per sync and rank (SGD at lr 1 on gradient delta); sync s is led by
# rank s mod 2. ef_decay 1 and outer_lr 1; every anchor stays dyadic, so delta is exact.
AVERAGER_DELTA = [
    [[4, 1, 0, 0], [0, 1, 0, 2.5]],
    [[0, 1, 0, 0], [0, 1, 0, 0]],
    [[0, 0, 0.5, 0], [0, 0, 0.5, 0]],
]
# Worked by hand. Sync 0 (leader 0): its acc [4 1 0 0] picks {0}; the sum [4 2 0 2.5]: {0}, overlap 1.
#   plain e = acc - sent: [0 1 0 0], [0 1 0 2.5]; beta 1/2: e/2 + (acc - sent)/2: [0 .5 0 0], [0 .5 0 1.25].
# Sync 1 (leader 1). Plain: its acc [0 2 0 2.5] picks {3}; the sum [0 4 0 2.5]: {1}, overlap 0.
#   Filtered: its acc [0 1.5 0 1.25] picks {1}; the sum [0 3 0 1.25]: {1}, overlap 1.
# Sync 2 (leader 0). Plain: its acc [0 2 .5 0] picks {1}; the sum [0 4 1 0]: {1}, overlap 1.
#   Filtered: its acc [0 .25 .5 0] picks {2}; the sum [0 .5 1 1.25]: {3}, overlap 0.
AVERAGER_ERROR = {
    None: [[[0, 1, 0, 0], [0, 1, 0, 2.5]], [[0, 2, 0, 0], [0, 2, 0, 0]], [[0, 0, 0.5, 0], [0, 0, 0.5, 0]]],
    0.5: [[[0, 0.5, 0, 0], [0, 0.5, 0, 1.25]], [[0, 0.25, 0, 0], [0, 0.25, 0, 1.25]],
          [[0, 0.25, 0, 0], [0, 0.25, 0, 1.25]]],
}
AVERAGER_OVERLAP = {None: [1.0, 0.0, 1.0], 0.5: [1.0, 1.0, 0.0]}
# The anchor moves by the mean of what was sent, at the leader's index only.
AVERAGER_ANCHOR = {None: [[-2, 0, 0, 0], [-2, 0, 0, -1.25], [-2, -2, 0, -1.25]],
                   0.5: [[-2, 0, 0, 0], [-2, -1.5, 0, 0], [-2, -1.5, -0.5, 0]]}
FLOAT_SHARED = {"period": 1, "density": 0.25, "selector": "exact", "index_codec": "int32", "value_codec": "fp32",
                "outer_lr": 1.0, "ef_decay": 1.0, "exchange": "shared-index"}


def _averager_syncs(rank, world_size, leader_filter):
    model = DDP(_Vector(4))
    averager = SparseDeltaAverager(model, **FLOAT_SHARED, leader_filter=leader_filter, diagnose_leader_overlap=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    errors, anchors, overlaps = [], [], []
    for deltas in AVERAGER_DELTA:
        optimizer.zero_grad()
        model(torch.tensor(deltas[rank], dtype=torch.float32)).backward()  # local: the averager reduces nothing
        optimizer.step()
        assert averager.step()
        errors.append(averager.error.tolist())
        anchors.append(averager.anchor.tolist())
        overlaps.append(averager.stats()["leader_overlap_last"])
    return errors, anchors, overlaps, averager.stats(), averager.settings()


@pytest.mark.parametrize("leader_filter", [None, 0.5])
def test_averager_error_buffer_and_leader_picks_worked_by_hand(leader_filter):
    results = run_on_ranks(_averager_syncs, leader_filter, world_size=2, timeout=120)
    for rank, (errors, anchors, overlaps, stats, settings) in enumerate(results):
        assert errors == [sync[rank] for sync in AVERAGER_ERROR[leader_filter]], rank
        assert anchors == AVERAGER_ANCHOR[leader_filter], rank
        assert overlaps == AVERAGER_OVERLAP[leader_filter], rank
        assert stats["leader_overlap_syncs"] == 3 and stats["leader_overlap"] == pytest.approx(2 / 3)
        assert settings.get("leader_filter") == leader_filter  # what a checkpoint must match


QUANTIZED_SHARED = {"period": 2, "density": 0.05, "selector": "exact", "index_codec": "rice", "value_codec": "int2",
                    "outer_lr": 1.0, "ef_decay": 0.95, "exchange": "shared-index"}


def _quantized_first_sync(rank, world_size):
    """Two averagers on the same data, plain and filtered: their first sync starts from an error
    buffer of 0, so the leader's selection and what every rank sends (int2, through the owners)
    are the same, and the filtered buffer is half the plain one, entry by entry, exactly."""
    errors, accs, overlaps = {}, {}, {}
    for leader_filter in (None, 0.5):
        torch.manual_seed(0)
        model = DDP(mlp(width=12, depth=2))
        averager = SparseDeltaAverager(model, **QUANTIZED_SHARED, leader_filter=leader_filter,
                                       diagnose_leader_overlap=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            optimizer.zero_grad()
            x = torch.randn(8, 12, generator=generator)
            (model(x) - x[:, :4].sin()).square().mean().backward()
            optimizer.step()
            if averager.optimizer_steps == 1:  # the buffer is 0: acc is the weights' change
                accs[leader_filter] = averager.anchor - torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            averager.step()
        errors[leader_filter], overlaps[leader_filter] = averager.error.clone(), averager.stats()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, accs[None])
    return errors, overlaps, everyone


def test_averager_quantized_shared_index_filters_its_buffer_and_measures_the_overlap():
    results = run_on_ranks(_quantized_first_sync, world_size=3, timeout=180)
    everyone = results[0][2]
    summed = everyone[0] + everyone[1] + everyone[2]
    k = -(-int(round(0.05 * summed.numel() * 1e6)) // int(1e6))
    # gloo adds the three in an order of its own: each float32 sum is within 2 u sum|terms| of
    # this one (u = 2**-24), far less than the gap at the k-th entry, so both have one top k.
    ranked = summed.abs().sort(descending=True).values
    bound = 2 * 2.0**-24 * sum(e.abs() for e in everyone).max()
    assert ranked[k - 1] - ranked[k] > 4 * bound
    top = set(torch.topk(summed.abs(), k).indices.tolist())
    leaders = set(torch.topk(everyone[0].abs(), k).indices.tolist())  # sync 0 is led by rank 0
    expected = len(leaders & top) / k
    for errors, stats, _ in results:
        assert torch.equal(errors[0.5], errors[None] * 0.5)
        assert bool((errors[None] != 0).any())  # something was kept
        for leader_filter in (None, 0.5):
            assert stats[leader_filter]["leader_overlap_syncs"] == 1
            assert stats[leader_filter]["leader_overlap"] == pytest.approx(expected, rel=1e-12)
    assert 0 < expected < 1  # a case that can fail either way


# ----- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("settings,error,message", [
    ({"leader_filter": 0.5}, ValueError, "leader_filter=0.5 is a setting of exchange='shared-index'.*'allgather'"),
    ({"leader_filter": 1.0, "exchange": "owner"}, ValueError, "exchange='shared-index'.*'owner'"),
    ({"diagnose_leader_overlap": True, "exchange": "auto"}, ValueError,
     "diagnose_leader_overlap=True is a setting of exchange='shared-index'.*'auto'"),
    ({"leader_filter": 0.0, "exchange": "shared-index"}, ValueError, r"leader_filter must be in \(0.0, 1.0\]"),
    ({"leader_filter": 1.5, "exchange": "shared-index"}, ValueError, r"leader_filter must be in \(0.0, 1.0\]"),
    ({"leader_filter": "0.5", "exchange": "shared-index"}, TypeError, "leader_filter must be a real number"),
    ({"leader_filter": True, "exchange": "shared-index"}, TypeError, "leader_filter must be a real number"),
    ({"diagnose_leader_overlap": 1, "exchange": "shared-index"}, TypeError, "diagnose_leader_overlap must be True"),
    ({"leader_filter": 0.5, "exchange": "shared-index", "verify_conservation": True}, ValueError,
     "sent \\+ residual == acc no longer holds"),
    ({"leader_filter": 0.5, "exchange": "shared-index", "error_feedback": False}, ValueError,
     "needs error_feedback=True"),
])
def test_the_hook_refuses_bad_settings_by_name(settings, error, message):
    with pytest.raises(error, match=message):
        sparsecomm.TopKState(**settings)


def test_plain_error_feedback_keeps_the_audit():
    # leader_filter=1 is plain error feedback: the conservation audit still applies.
    state = sparsecomm.TopKState(exchange="shared-index", leader_filter=1.0, verify_conservation=True)
    assert state.config.filtered_memory_beta is None


AVERAGER = {"period": 2, "density": 0.05, "selector": "exact", "chunk_size": 4096, "index_codec": "rice",
            "value_codec": "int2", "outer_lr": 1.0, "ef_decay": 0.95}


@pytest.mark.parametrize("settings,error,message", [
    ({"leader_filter": 0.5}, ValueError, "leader_filter=0.5 is a setting of exchange='shared-index'.*'allgather'"),
    ({"diagnose_leader_overlap": True, "exchange": "owner"}, ValueError, "exchange='shared-index'.*'owner'"),
    ({"leader_filter": 0.5, "exchange": "auto"}, ValueError, "exchange='shared-index'.*'auto'"),
    ({"leader_filter": 0, "exchange": "shared-index"}, ValueError, r"leader_filter must be in \(0.0, 1.0\]"),
    ({"diagnose_leader_overlap": "yes", "exchange": "shared-index"}, TypeError, "diagnose_leader_overlap must be"),
])
def test_the_averager_refuses_bad_settings_by_name(settings, error, message):
    with pytest.raises(error, match=message):
        check_settings(**AVERAGER, **settings)
