"""SparseDeltaAverager: local steps, then a sparse error-fed outer sync of the weights.

Oracles: a pure-torch replay of the outer step written here (per-chunk torch.topk of
ef_decay * error + (anchor - weights), the mean of what every rank sent, the outer step),
run on the weights every rank reported before each sync; plain model averaging (the mean
of the replicas) at density 1 and outer_lr 1; an uninterrupted run for checkpoints.
Ranks train on different data (seeded by rank), on 2 and 3 gloo ranks.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from multiprocess import run_on_ranks
from sparsecomm import SparseDeltaAverager

PERIOD, CHUNK = 3, 64


def _model() -> DDP:
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP would broadcast
    return DDP(torch.nn.Sequential(torch.nn.Linear(15, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False)))  # 320 = 5 chunks


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _train(model, optimizer, averager, steps: int, generator, record=None) -> None:
    for _ in range(steps):
        x = torch.randn(8, 15, generator=generator)
        loss = (model(x) - x[:, :4].sin()).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if record is not None and (averager.optimizer_steps + 1) % averager.period == 0:
            record.append(_flat(model))  # the local weights the coming sync starts from
        averager.step()


def _syncs(rank, world_size, settings, steps):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    averager = SparseDeltaAverager(model, **settings)
    generator = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    before, after, initial = [], [], _flat(model)
    for _ in range(steps // averager.period):
        _train(model, optimizer, averager, averager.period, generator, record=before)
        after.append(_flat(model))
    stats, error = averager.stats(), averager.error.clone()
    _train(model, optimizer, averager, 1, generator)  # one local step past the last sync
    local = _flat(model)
    with averager.consensus_weights():
        consensus = _flat(model)
    return {"initial": initial, "before": before, "after": after, "stats": stats, "error": error,
            "consensus": consensus, "local_kept": torch.equal(_flat(model), local)}


def _replay(initial, before_per_rank, settings) -> list[torch.Tensor]:
    """The outer steps, written out with torch.topk per chunk and exact fp32 values."""
    world_size = len(before_per_rank)
    anchor = initial.clone()
    errors = [torch.zeros_like(anchor) for _ in range(world_size)]
    k_per_chunk = round(settings["density"] * CHUNK)
    results = []
    for sync in range(len(before_per_rank[0])):
        total = torch.zeros_like(anchor)
        for rank in range(world_size):
            acc = settings["ef_decay"] * errors[rank] + (anchor - before_per_rank[rank][sync])
            sent = torch.zeros_like(acc)
            chunks = acc.view(-1, CHUNK) if acc.numel() % CHUNK == 0 else None
            assert chunks is not None, "the test model's size is a multiple of the chunk"
            top = chunks.abs().topk(k_per_chunk, dim=1).indices
            sent.view(-1, CHUNK).scatter_(1, top, chunks.gather(1, top))
            errors[rank] = acc - sent
            total += sent
        anchor = anchor - settings["outer_lr"] * (total / world_size)
        results.append(anchor.clone())
    return results, errors


SPARSE = {"period": PERIOD, "density": 8 / CHUNK, "selector": "chunk", "chunk_size": CHUNK, "index_codec": "int32",
          "value_codec": "fp32", "outer_lr": 0.8, "ef_decay": 0.9}


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_sync_is_the_replayed_outer_step_and_replicas_end_bit_identical(world_size):
    results = run_on_ranks(_syncs, SPARSE, 4 * PERIOD, world_size=world_size, timeout=120)
    for sync in range(4):
        synced = [r["after"][sync] for r in results]
        assert all(torch.equal(synced[0], other) for other in synced[1:])  # one model again, bit for bit
        locals_ = [r["before"][sync] for r in results]
        assert not torch.equal(locals_[0], locals_[1])  # between syncs the replicas trained apart
    expected, errors = _replay(results[0]["initial"], [r["before"] for r in results], SPARSE)
    for sync, want in enumerate(expected):
        torch.testing.assert_close(results[0]["after"][sync], want, rtol=1e-6, atol=1e-7)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["error"], errors[rank], rtol=1e-5, atol=1e-6)
    for result in results:  # evaluation sees the last sync's weights; the local ones come back after
        assert torch.equal(result["consensus"], results[0]["after"][-1]) and result["local_kept"]
    stats = results[0]["stats"]
    assert stats["syncs"] == 4 and stats["steps"] == 4 * PERIOD
    assert stats["elements_sent"] == 4 * 8 * (results[0]["initial"].numel() // CHUNK)
    assert stats["bytes_sent_per_step"] == stats["bytes_sent"] / (4 * PERIOD)


def test_density_one_with_outer_lr_one_is_plain_model_averaging():
    dense = {"period": PERIOD, "density": 1.0, "selector": "exact", "index_codec": "int32",
             "value_codec": None, "outer_lr": 1.0, "ef_decay": 0.0}
    results = run_on_ranks(_syncs, dense, 2 * PERIOD, world_size=3, timeout=120)
    for sync in range(2):
        mean = torch.stack([r["before"][sync].double() for r in results]).mean(dim=0)
        torch.testing.assert_close(results[0]["after"][sync].double(), mean, rtol=1e-6, atol=1e-6)
    assert all(float(r["error"].abs().max()) == 0.0 for r in results)  # everything was sent


def _checkpointed(rank, world_size, compact):
    settings = dict(SPARSE, index_codec="rice", value_codec="int2") if compact else SPARSE
    generator = torch.Generator().manual_seed(7 + rank)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    averager = SparseDeltaAverager(model, **settings)
    _train(model, optimizer, averager, 2 * PERIOD + 1, generator)  # saved mid-period, as a checkpoint may be
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": copy.deepcopy(optimizer.state_dict()), "averager": averager.state_dict(),
             "rng": generator.get_state()}
    _train(model, optimizer, averager, 2 * PERIOD, generator)
    uninterrupted = _flat(model)

    resumed = _model()
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.02)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    resumed_averager = SparseDeltaAverager(resumed, **settings)
    resumed_averager.load_state_dict(saved["averager"])
    generator.set_state(saved["rng"])
    _train(resumed, resumed_optimizer, resumed_averager, 2 * PERIOD, generator)
    return {"same": torch.equal(uninterrupted, _flat(resumed)), "keys": sorted(saved["averager"])}


@pytest.mark.parametrize("compact", [False, True])
def test_a_restored_averager_trains_on_bit_for_bit(compact):
    # What a bad state dict gets (refusals by key, all or nothing): tests/test_averager_state_dict.py.
    results = run_on_ranks(_checkpointed, compact, world_size=2, timeout=120)
    for rank, result in enumerate(results):
        assert result["same"]
        assert f"rank{rank}.error" in result["keys"] and f"rank{rank}.anchor" in result["keys"]


def _refusals(rank, world_size):
    model = _model()
    found = {}
    for name, settings in (("period", {"period": 0}), ("outer_lr", {"outer_lr": 0.0}), ("ef_decay", {"ef_decay": 1.5}),
                           ("density", {"density": 0.0}), ("value_codec", {"value_codec": "int3"})):
        try:
            SparseDeltaAverager(model, **settings)
        except (TypeError, ValueError) as error:
            found[name] = str(error)
    try:
        SparseDeltaAverager(model.module)
    except TypeError as error:
        found["model"] = str(error)
    return found


def test_bad_settings_are_refused_by_name():
    found = run_on_ranks(_refusals, world_size=2, timeout=60)[0]
    assert set(found) == {"period", "outer_lr", "ef_decay", "density", "value_codec", "model"}
    for name in ("period", "outer_lr", "ef_decay", "density", "value_codec"):
        assert name in found[name], found[name]
    assert "DistributedDataParallel" in found["model"]
