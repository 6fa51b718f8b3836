"""SparseDeltaAverager on an FSDP2 model (fully_shard over mesh["shard"] of a (replicate,
shard) mesh): each rank averages its local shards with the same shards of the other
replicas; between syncs nothing crosses replicas. gloo, 4 and 8 ranks, every rank its own data.

Oracle: at density 1 with float32 values, no error-feedback memory (ef_decay 0) and
outer_lr 1, a sync must give every replica the mean of the replicas' weights, computed here
in float64 from an all-gather, within the float32 rounding of the sync's arithmetic (bound
derived at the assertion)."""
import pytest
import torch
import torch.distributed as dist

from fsdp_models import loss, mesh_of, model_on
from rank_processes import run_on_ranks

pytestmark = pytest.mark.timeout(240)

PERIOD, STEPS = 3, 12


def _replica_copies(model, group, replicas):
    """Every replica's local shards of this rank's shard position, flattened: [replicas, numel]."""
    mine = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(mine) for _ in range(replicas)]
    dist.all_gather(copies, mine, group=group)
    return torch.stack(copies)


def _average_sharded(rank, world_size, replicas, shards, settings):
    import sparsecomm

    mesh = mesh_of(replicas, shards)
    model = model_on(mesh["shard"])
    averager = sparsecomm.SparseDeltaAverager(model, mesh=mesh, period=PERIOD, **settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group = mesh.get_group("replicate")
    generator = torch.Generator().manual_seed(100 + rank)
    x0 = torch.randn(16, 8, generator=generator)
    with torch.no_grad():
        first = loss(model, x0).item()
    record = []
    for step in range(1, STEPS + 1):
        loss(model, torch.randn(4, 8, generator=generator)).backward()
        optimizer.step()
        optimizer.zero_grad()
        before = _replica_copies(model, group, replicas).double()
        anchor = averager.anchor.double().clone()
        synced = averager.step()
        after = _replica_copies(model, group, replicas).double()
        record.append((step, synced, before, anchor, after))
    with torch.no_grad():
        last = loss(model, x0).item()
    return record, first, last, averager.stats()


@pytest.mark.parametrize("replicas,shards", [(2, 2), (4, 2)])
def test_a_dense_sync_gives_every_replica_the_mean_and_local_steps_stay_local(replicas, shards):
    settings = dict(density=1.0, selector="exact", index_codec="int32", value_codec="fp32", outer_lr=1.0, ef_decay=0.0)
    u = 2.0 ** -24  # float32's unit roundoff
    for rank, (record, _, _, stats) in enumerate(
            run_on_ranks(_average_sharded, replicas, shards, settings, world_size=replicas * shards)):
        assert stats["syncs"] == STEPS // PERIOD
        for step, synced, before, anchor, after in record:
            assert synced == (step % PERIOD == 0)
            if not synced:
                # Local steps: every replica trained on its own data, and nothing crossed.
                assert not all(torch.equal(before[0], b) for b in before[1:]), f"rank {rank} step {step}"
                assert torch.equal(before, after)
                continue
            assert all(torch.equal(after[0], a) for a in after[1:]), f"rank {rank} step {step}: replicas differ"
            mean = before.mean(0)
            # delta_r = fl(anchor - w_r) (one rounding each), their sum over R ranks (R - 1
            # roundings), / R (exact: R is a power of two), the new weight anchor - average
            # (one rounding, of a value ~ the mean): |error| <= u (|mean| + sum_r |delta_r|)
            # + O(u^2); twice that covers the second-order terms many times over here.
            deltas = (anchor - before).abs().sum(0)
            bound = 2 * u * (mean.abs() + deltas)
            assert ((after[0] - mean).abs() <= bound).all(), f"rank {rank} step {step}"


def test_sparse_syncs_keep_replicas_identical_and_training_works():
    settings = dict(density=0.25, chunk_size=64)  # the defaults otherwise: chunk top-k, Rice + int2
    for rank, (record, first, last, stats) in enumerate(
            run_on_ranks(_average_sharded, 4, 2, settings, world_size=8)):
        for step, synced, _, _, after in record:
            if synced:
                assert all(torch.equal(after[0], a) for a in after[1:]), f"rank {rank} step {step}"
        assert 0 < stats["bytes_sent"] < stats["bytes_dense"]
        assert last < first, f"rank {rank}: the loss did not fall ({first} -> {last})"


def _refusals(rank, world_size):
    import sparsecomm

    mesh = mesh_of(2, 2)
    messages = {}
    for what, call in {
        "no mesh": lambda: sparsecomm.SparseDeltaAverager(model_on(mesh["shard"])),
        "process group": lambda: sparsecomm.SparseDeltaAverager(model_on(mesh["shard"]), mesh=mesh,
                                                                process_group=dist.group.WORLD),
        "native hsdp": lambda: sparsecomm.SparseDeltaAverager(model_on(mesh), mesh=mesh),
    }.items():
        try:
            call()
            messages[what] = None
        except ValueError as error:
            messages[what] = str(error)
    torch.manual_seed(rank)  # replicas built from different seeds
    model = model_on(mesh["shard"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)  # model_on seeds alike: make the replicas differ
    try:
        sparsecomm.SparseDeltaAverager(model, mesh=mesh)
        messages["different start"] = None
    except ValueError as error:
        messages["different start"] = str(error)
    return messages


def test_misuse_is_refused_by_name():
    for messages in run_on_ranks(_refusals, world_size=4):
        assert "pass mesh" in messages["no mesh"]
        assert "not process_group" in messages["process group"]
        assert "native HSDP" in messages["native hsdp"]
        assert "start from different weights" in messages["different start"]
