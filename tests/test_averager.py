"""SparseDeltaAverager: local steps, then a sparse error-fed outer sync of the weights.

Oracles: a pure-torch replay of the outer step written here (per-chunk torch.topk of
ef_decay * error + (anchor - weights), the mean of what every rank sent, the outer step),
one sync at a time from the averager's state before it and the weights every rank reported,
bit for bit but for one rounding whose bound is derived there; plain model averaging (the
float64 mean of the replicas, within a derived float32 rounding bound) at density 1 and
outer_lr 1; an uninterrupted run for checkpoints.
Ranks train on different data (seeded by rank), on 2 and 3 gloo ranks.
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rank_processes import run_on_ranks
from sparsecomm import SparseDeltaAverager
from sparsecomm.averaging.sparse_delta import check_settings
from sparsecomm.compress.payload_seal import TRAILER_BYTES

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
    before, after, errors, owned, initial = [], [], [], [], _flat(model)
    for _ in range(steps // averager.period):
        _train(model, optimizer, averager, averager.period, generator, record=before)
        after.append(_flat(model))
        errors.append(averager.error.clone())
        if averager.owner_residual is not None:
            owned.append(averager.owner_residual.clone())
    stats, error = averager.stats(), averager.error.clone()
    _train(model, optimizer, averager, 1, generator)  # one local step past the last sync
    local = _flat(model)
    with averager.consensus_weights():
        consensus = _flat(model)
    return {"initial": initial, "before": before, "after": after, "errors": errors, "owned": owned, "stats": stats,
            "error": error,
            "consensus": consensus, "local_kept": torch.equal(_flat(model), local)}


def _outer_step(anchor, errors, before, settings) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sync written out with torch.topk per chunk, from the anchor and every rank's error
    buffer and local weights: (new anchor, the rounding bound of the averager's against it,
    every rank's new error buffer).

    Every float32 operation here is the averager's, in its order (ef_decay * error, anchor -
    weights, their sum; the values sent exactly (fp32 wire), summed in rank order, divided by
    the world size), so the selections, the error buffers and the mean are bit for bit its,
    except the last one: the averager's ``torch.sub(anchor, mean, alpha=outer_lr)`` may fuse
    the product into the subtraction (one rounding) where this rounds twice. With u = 2^-24,
    x = anchor - lr m exact, and r this replay's fl(anchor - fl(lr m)): |fl(x) - x| <= u |x|
    and |x - r| <= u |lr m| + u |anchor - fl(lr m)|, so the two differ by at most
    u (2 |x| + (1 + u) |lr m|) <= 4 u (|r| + |lr m|) elementwise (|x| <= (1 + u) |r| + u |lr m|)."""
    world_size = len(before)
    k_per_chunk = round(settings["density"] * CHUNK)
    assert anchor.numel() % CHUNK == 0, "the test model's size is a multiple of the chunk"
    total, new_errors = torch.zeros_like(anchor), []
    for rank in range(world_size):
        acc = settings["ef_decay"] * errors[rank] + (anchor - before[rank])
        sent = torch.zeros_like(acc)
        chunks = acc.view(-1, CHUNK)
        top = chunks.abs().topk(k_per_chunk, dim=1).indices
        sent.view(-1, CHUNK).scatter_(1, top, chunks.gather(1, top))
        new_errors.append(acc - sent)
        total += sent
    step = settings["outer_lr"] * (total / world_size)
    new_anchor = anchor - step
    return new_anchor, 2.0 ** -22 * (new_anchor.abs() + step.abs()), new_errors


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
    # Each sync against the oracle from the averager's own state before it (the anchor is the
    # last sync's weights), so no difference is carried from one sync to the next.
    anchor, errors = results[0]["initial"], [torch.zeros_like(results[0]["initial"])] * world_size
    for sync in range(4):
        want, bound, want_errors = _outer_step(anchor, errors, [r["before"][sync] for r in results], SPARSE)
        got = results[0]["after"][sync]
        assert ((got - want).abs() <= bound).all(), float(((got - want).abs() - bound).max())
        errors = [r["errors"][sync] for r in results]
        assert all(torch.equal(error, wanted) for error, wanted in zip(errors, want_errors))
        anchor = got
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
    anchor = results[0]["initial"].double()
    for sync in range(2):
        local = torch.stack([r["before"][sync].double() for r in results])
        mean = local.mean(dim=0)  # exact enough: float64 sums of 3 float32 numbers
        got = results[0]["after"][sync].double()
        # The averager rounds in float32 (u = 2^-24): d_r = anchor - w_r, their sum in rank
        # order, / 3, anchor - that. First order: u |d_r| each, u sum|d| for the sum, and u
        # |mean step| and u |result|; twice that covers the second-order terms.
        deltas = (anchor - local).abs()
        bound = 2.0 ** -23 * (got.abs() + (anchor - mean).abs() + 2 * deltas.sum(dim=0))
        assert ((got - mean).abs() <= bound).all(), float(((got - mean).abs() - bound).max())
        anchor = got
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


SHARED = {**SPARSE, "exchange": "shared-index"}


def _shared_outer_step(anchor, errors, before, settings, sync):
    """One shared-index sync written out: the leader (sync mod p) takes the top entries of
    every chunk of its own acc (torch.topk; random data, no ties), every rank sends its acc
    there (fp32: exactly), the mean of their rank-order sum is the step. Returns (indices,
    new anchor, every rank's new error buffer, sum over ranks of |sent|)."""
    world_size = len(before)
    accs = [settings["ef_decay"] * errors[rank] + (anchor - before[rank]) for rank in range(world_size)]
    k_per_chunk = round(settings["density"] * CHUNK)
    chunks = accs[sync % world_size].view(-1, CHUNK)
    top = chunks.abs().topk(k_per_chunk, dim=1).indices + torch.arange(0, anchor.numel(), CHUNK).view(-1, 1)
    indices = torch.sort(top.flatten()).values
    total, magnitude = torch.zeros(indices.numel()), torch.zeros(indices.numel())
    for acc in accs:
        total += acc[indices]
        magnitude += acc[indices].abs()
    new_anchor = anchor.clone()
    new_anchor[indices] -= settings["outer_lr"] * (total / world_size)
    new_errors = []
    for acc in accs:
        acc = acc.clone()
        acc[indices] = 0.0  # sent in full: an fp32 wire carries the value exactly
        new_errors.append(acc)
    return indices, new_anchor, new_errors, magnitude


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_shared_index_sync_is_the_leaders_selection_summed(world_size):
    """exchange="shared-index": each sync against the replay above from the averager's state
    before it. At 2 ranks gloo's one addition is the replay's (commutative): bit for bit. At 3
    its ring adds in an order of its own: each order is within gamma_2 = 2u/(1-2u) of the exact
    sum of |sent|, so the two sums differ by at most ~4u sum|sent|; the mean (/p), the product
    by outer_lr and the subtraction add at most u each, relative to their results: within
    8u (|anchor'| + outer_lr sum|sent| / p) elementwise (u = 2^-24)."""
    results = run_on_ranks(_syncs, SHARED, 4 * PERIOD, world_size=world_size, timeout=120)
    anchor, errors = results[0]["initial"], [torch.zeros_like(results[0]["initial"])] * world_size
    for sync in range(4):
        synced = [r["after"][sync] for r in results]
        assert all(torch.equal(synced[0], other) for other in synced[1:])
        indices, want, want_errors, magnitude = _shared_outer_step(
            anchor, errors, [r["before"][sync] for r in results], SHARED, sync)
        got = synced[0]
        outside = torch.ones_like(got, dtype=torch.bool)
        outside[indices] = False
        assert torch.equal(got[outside], anchor[outside])  # only the shared indices moved
        if world_size == 2:
            assert torch.equal(got, want)
        else:
            bound = 2.0 ** -21 * (want[indices].abs() + SHARED["outer_lr"] * magnitude / world_size)
            assert ((got[indices] - want[indices]).abs() <= bound).all()
        errors = [r["errors"][sync] for r in results]
        assert all(torch.equal(error, wanted) for error, wanted in zip(errors, want_errors))
        anchor = got
    # Bytes: k fp32 values, and the ranks' verdict on the index broadcast (one more fp32:
    # wire_checksum), each way around the ring; the leader's int32 index region once, sealed
    # (its trailer).
    k = 8 * (results[0]["initial"].numel() // CHUNK)
    ring = round(2 * (world_size - 1) * 4 * (k + 1) / world_size)
    for rank, result in enumerate(results):
        led = sum(1 for sync in range(4) if sync % world_size == rank)
        stats = result["stats"]
        assert stats["bytes_sent"] == 4 * (4 * (k + 1)) + led * (4 * k + TRAILER_BYTES)
        assert stats["bytes_received"] == 4 * ring + (4 - led) * (4 * k + TRAILER_BYTES)


OWNER = {**SPARSE, "exchange": "owner"}


def _chunk_top(acc: torch.Tensor, k_per_chunk: int) -> torch.Tensor:
    """``acc`` at the top |entries| of every chunk (torch.topk; random data, no ties), 0 elsewhere."""
    sent, chunks = torch.zeros_like(acc), acc.view(-1, CHUNK)
    top = chunks.abs().topk(k_per_chunk, dim=1).indices
    sent.view(-1, CHUNK).scatter_(1, top, chunks.gather(1, top))
    return sent


def _owner_outer_step(anchor, errors, owned, before, settings):
    """One owner sync written out: every rank's chunked top-k of its acc (fp32: sent exactly),
    summed in rank order; each owner (contiguous chunks: the first chunks % p owners hold one
    more) adds its owner residual and takes the chunked top-k of that again; the mean of the
    replies is the step. Returns (new anchor, its rounding bound as _outer_step's, every
    rank's new error buffer, every rank's new owner residual)."""
    world_size, k_per_chunk = len(before), round(settings["density"] * CHUNK)
    total, new_errors = torch.zeros_like(anchor), []
    for rank in range(world_size):
        acc = settings["ef_decay"] * errors[rank] + (anchor - before[rank])
        sent = _chunk_top(acc, k_per_chunk)
        new_errors.append(acc - sent)
        total += sent
    per_owner, extra = divmod(anchor.numel() // CHUNK, world_size)
    replies, new_owned, start = torch.zeros_like(anchor), [], 0
    for owner in range(world_size):
        span = slice(start, start + CHUNK * (per_owner + (owner < extra)))
        owner_acc = total[span] + owned[owner][span]
        reply = _chunk_top(owner_acc, k_per_chunk)
        replies[span] = reply
        residual = torch.zeros_like(anchor)
        residual[span] = owner_acc - reply
        new_owned.append(residual)
        start = span.stop
    step = settings["outer_lr"] * (replies / world_size)
    new_anchor = anchor - step
    return new_anchor, 2.0 ** -22 * (new_anchor.abs() + step.abs()), new_errors, new_owned


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_owner_sync_is_the_owners_reselection_of_the_sum(world_size):
    """exchange="owner": each sync against the replay above from the averager's state before
    it; conservation at both levels (what a rank kept plus what it sent is its acc; what an
    owner kept plus its reply is the sum plus its old residual) holds bit for bit on the fp32 wire."""
    results = run_on_ranks(_syncs, OWNER, 4 * PERIOD, world_size=world_size, timeout=120)
    numel = results[0]["initial"].numel()
    anchor = results[0]["initial"]
    errors = owned = [torch.zeros_like(anchor)] * world_size
    for sync in range(4):
        synced = [r["after"][sync] for r in results]
        assert all(torch.equal(synced[0], other) for other in synced[1:])
        want, bound, want_errors, want_owned = _owner_outer_step(
            anchor, errors, owned, [r["before"][sync] for r in results], OWNER)
        got = synced[0]
        assert ((got - want).abs() <= bound).all(), float(((got - want).abs() - bound).max())
        errors, owned = [r["errors"][sync] for r in results], [r["owned"][sync] for r in results]
        assert all(torch.equal(e, w) for e, w in zip(errors, want_errors))
        assert all(torch.equal(o, w) for o, w in zip(owned, want_owned))
        assert sync == 0 or any(bool(o.abs().sum() > 0) for o in owned)  # the second level keeps something
        anchor = got
    # Bytes, by hand: 8 entries per chunk of 64 at 4 + 4 bytes; each owner's range is whole
    # chunks (p = 2: 3 and 2 of the 5; p = 3: 2, 2, 1); every message sealed (its trailer); the
    # reply slot is the largest range's, sealed too.
    chunks = [3, 2] if world_size == 2 else [2, 2, 1]
    message = [64 * c + TRAILER_BYTES for c in chunks]
    for rank, result in enumerate(results):
        stats = result["stats"]
        assert stats["bytes_sent"] == 4 * (sum(message) - message[rank] + max(message))
        assert stats["bytes_received"] == 4 * (world_size - 1) * (message[rank] + max(message))
        assert stats["elements_sent"] == 4 * 8 * numel // CHUNK


def _owner_state_round_trip(rank, world_size):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    averager = SparseDeltaAverager(model, **OWNER)
    generator = torch.Generator().manual_seed(7 + rank)
    _train(model, optimizer, averager, 2 * PERIOD, generator)
    state = averager.state_dict()
    refusals = {}
    for name, broken in (("missing", {k: v for k, v in state.items() if not k.endswith("owner_residual")}),
                         ("nan", {**state, f"rank{rank}.owner_residual": torch.full_like(averager.owner_residual,
                                                                                        float("nan"))})):
        try:
            averager.load_state_dict(broken)
        except ValueError as error:
            refusals[name] = str(error)
    fresh = SparseDeltaAverager(_model(), **OWNER)
    fresh.load_state_dict(state)
    return {"keys": sorted(state), "refusals": refusals,
            "same": torch.equal(fresh.owner_residual, averager.owner_residual)
            and bool(averager.owner_residual.abs().sum() > 0)}


def test_the_owner_residual_is_saved_checked_and_restored():
    for rank, result in enumerate(run_on_ranks(_owner_state_round_trip, world_size=2, timeout=120)):
        assert f"rank{rank}.owner_residual" in result["keys"] and result["same"]
        assert f"rank{rank}.owner_residual" in result["refusals"]["missing"]
        assert "Inf or NaN" in result["refusals"]["nan"]


def test_shared_index_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="value_codec"):
        check_settings(**{**SHARED, "value_codec": "int3"})
    with pytest.raises(ValueError, match="exchange must be one of"):
        check_settings(**{**SHARED, "exchange": "owners"})
    check_settings(**{**SHARED, "value_codec": "int2"})  # quantized values go through the owners


QUANTIZED = {**SHARED, "value_codec": "int8"}


def _int8_bound(values: torch.Tensor) -> torch.Tensor:
    """What int8 with one bf16 scale per (at most 64) values may leave: the step s is the
    largest magnitude / 2^7 rounded up to bf16 (relative 2^-7) and the levels q s, |q| <= 127:
    half a step for |v| <= 127.5 s, at most one step for the largest (v / s up to 128 is
    clamped to 127); so s <= max 2^-7 (1 + 2^-7)."""
    return values.abs().max() * 2.0 ** -7 * (1 + 2.0 ** -7)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_quantized_shared_index_sync_goes_through_the_owners_and_conserves_at_both_levels(world_size):
    """exchange="shared-index" with int8 values, each sync replayed from the averager's state
    before it: the leader's indices (torch.topk per chunk of its acc); every rank keeps acc -
    sent (sent within one int8 step of acc, per owner slice); each owner (model entries
    [o n / p, (o+1) n / p)) sums what the ranks sent in rank order, adds its owner residual
    and keeps what its reply leaves (within one step); the anchor moves by outer_lr x the
    replies' sum / p, bit for bit (the sum's order and every rounding are the replay's)."""
    results = run_on_ranks(_syncs, QUANTIZED, 4 * PERIOD, world_size=world_size, timeout=120)
    anchor = results[0]["initial"]
    numel, k_per_chunk = anchor.numel(), round(QUANTIZED["density"] * CHUNK)
    errors = owned = [torch.zeros_like(anchor)] * world_size
    bounds = [o * numel // world_size for o in range(world_size + 1)]
    counts = []  # per sync, the shared indices in every owner's range
    for sync in range(4):
        synced = [r["after"][sync] for r in results]
        assert all(torch.equal(synced[0], other) for other in synced[1:])
        accs = [QUANTIZED["ef_decay"] * errors[r] + (anchor - results[r]["before"][sync]) for r in range(world_size)]
        chunks = accs[sync % world_size].view(-1, CHUNK)
        top = chunks.abs().topk(k_per_chunk, dim=1).indices + torch.arange(0, numel, CHUNK).view(-1, 1)
        indices = torch.sort(top.flatten()).values
        new_errors = [r["errors"][sync] for r in results]
        new_owned = [r["owned"][sync] for r in results]
        outside = torch.ones(numel, dtype=torch.bool)
        outside[indices] = False
        replies = torch.zeros(numel)
        sent = [acc - new for acc, new in zip(accs, new_errors)]
        for owner in range(world_size):
            mine = indices[(indices >= bounds[owner]) & (indices < bounds[owner + 1])]
            counts.append((sync, owner, mine.numel()))
            total = torch.zeros(mine.numel())
            for rank in range(world_size):
                assert (new_errors[rank][mine].abs() <= _int8_bound(accs[rank][mine])).all()
                total += sent[rank][mine]
            owner_acc = total + owned[owner][mine]
            assert (new_owned[owner][mine].abs() <= _int8_bound(owner_acc)).all()
            replies[mine] = owner_acc - new_owned[owner][mine]
            kept = torch.ones(numel, dtype=torch.bool)
            kept[mine] = False
            assert torch.equal(new_owned[owner][kept], owned[owner][kept])
        for acc, new in zip(accs, new_errors):
            assert torch.equal(new[outside], acc[outside])  # only the shared indices were sent
        want = anchor.clone()
        want[indices] -= QUANTIZED["outer_lr"] * (replies[indices] / world_size)
        assert torch.equal(synced[0], want)
        assert sync == 0 or any(bool(o.abs().sum() > 0) for o in new_owned)
        anchor, errors, owned = synced[0], new_errors, new_owned
    # Bytes, by hand: an owner slice of n int8 values is a 2-byte scale + n bytes (n < 64 here)
    # and its seal; the leader's int32 index region is 4 k bytes and its seal; each reply
    # travels at its own size.
    k = k_per_chunk * numel // CHUNK
    for rank, result in enumerate(results):
        sent = received = 0
        for sync in range(4):
            sizes = [2 * -(-n // 64) + n + TRAILER_BYTES for s_, _, n in counts if s_ == sync]
            led = sync % world_size == rank
            index_set = 4 * k + TRAILER_BYTES
            sent += sum(sizes) + (index_set if led else 0)
            received += (world_size - 1) * sizes[rank] + sum(sizes) - sizes[rank] + (0 if led else index_set)
        stats = result["stats"]
        assert (stats["bytes_sent"], stats["bytes_received"], stats["elements_sent"]) == (sent, received, 4 * k)


def _auto_choices(rank, world_size):
    chosen = {}
    for link in ("10gbit@20ms", "100mbit@1us"):
        averager = SparseDeltaAverager(_model(), **{**SPARSE, "value_codec": "int2", "exchange": "auto", "link": link})
        chosen[link] = (averager.exchange, averager.settings()["exchange"], averager.settings()["link"],
                        "owner_residual" in "".join(averager.state_dict()))
    try:
        SparseDeltaAverager(_model(), **{**SPARSE, "link": "1gbit"})
    except ValueError as error:
        chosen["refused"] = str(error)
    return chosen


def test_auto_picks_by_the_links_latency_and_bandwidth_alike_on_every_rank():
    """At p = 4 the all-gather costs (p-1) alpha + (p-1) s / B and the owner exchange
    2 (p-1) alpha + 2 (p-1)/p s / B (int2 values: no shared-index): a 20 ms message latency
    dwarfs a payload of a few hundred bytes at 10 Gb/s (fewest messages: all-gather), while at
    100 Mb/s with 1 us per message the owner's half of the bytes wins."""
    results = run_on_ranks(_auto_choices, world_size=4, timeout=120)
    for result in results:
        assert result["10gbit@20ms"] == ("allgather", "auto", "10gbit@20ms", False)
        assert result["100mbit@1us"] == ("owner", "auto", "100mbit@1us", True)
        assert "link" in result["refused"] and "auto" in result["refused"]


OVERLAPPED = {**SPARSE, "overlap": True}


def _overlapped_syncs(rank, world_size, settings):
    """4 syncs with overlap: the weights when each starts, the local weights when the next
    step() applies it, and the weights, anchor, error buffer (and owner residual) after that."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    averager = SparseDeltaAverager(model, **settings)
    generator = torch.Generator().manual_seed(100 + rank)
    record = {"initial": _flat(model), "started": [], "local": [], "after": [], "anchor": [], "error": [], "owned": []}
    for step in range(1, 4 * PERIOD + 2):
        x = torch.randn(8, 15, generator=generator)
        loss = (model(x) - x[:, :4].sin()).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        applying = averager.pending_collectives == 1
        if step % PERIOD == 0:
            record["started"].append(_flat(model))
        if applying:
            record["local"].append(_flat(model))
        averager.step()
        if applying:
            record["after"].append(_flat(model))
            record["anchor"].append(averager.anchor.clone())
            record["error"].append(averager.error.clone())
            if averager.owner_residual is not None:
                record["owned"].append(averager.owner_residual.clone())
        if step == 4 * PERIOD:  # a sync in flight: no state dict until it is applied
            try:
                averager.state_dict()
            except RuntimeError as error:
                record["refused"] = str(error)
    # A last sync, flushed right away: the replicas hold one model again.
    for _ in range(PERIOD - 1):
        x = torch.randn(8, 15, generator=generator)
        optimizer.zero_grad()
        (model(x) - x[:, :4].sin()).square().mean().backward()
        optimizer.step()
        averager.step()
    averager.flush()
    record["flushed"] = _flat(model)
    record["stats"] = averager.stats()
    return record


def _replay(settings, anchor, errors, owned, started, sync):
    """The replay of one sync for ``settings``' exchange: (new anchor, the rounding bound of
    the averager's against it, every rank's new error buffer, every rank's new owner residual
    or None); the bounds are the replays' own (derived in their docstrings and tests)."""
    exchange = settings.get("exchange", "allgather")
    if exchange == "owner":
        return _owner_outer_step(anchor, errors, owned, started, settings)
    if exchange == "shared-index":
        indices, want, want_errors, magnitude = _shared_outer_step(anchor, errors, started, settings, sync)
        bound = torch.zeros_like(want)
        if len(started) > 2:  # gloo's ring sums in an order of its own (see the shared-index test)
            bound[indices] = 2.0 ** -21 * (want[indices].abs() + settings["outer_lr"] * magnitude / len(started))
        return want, bound, want_errors, None
    return (*_outer_step(anchor, errors, started, settings), None)


@pytest.mark.parametrize("exchange", ["allgather", "owner", "shared-index"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_overlapped_sync_is_applied_one_step_late_with_the_local_step_kept(world_size, exchange):
    """overlap=True: the sync started at step t (its last collective not waited for) is
    applied by the step() of step t + 1: its anchor and buffers are the exchange's replay
    from the weights at t, and the weights are that anchor plus the local step taken
    meanwhile, fl(anchor' + fl(w_{t+1} - w_t)) bit for bit."""
    settings = {**OVERLAPPED, "exchange": exchange}
    results = run_on_ranks(_overlapped_syncs, settings, world_size=world_size, timeout=120)
    anchor = results[0]["initial"]
    errors = owned = [torch.zeros_like(anchor)] * world_size
    for sync in range(4):
        want, bound, want_errors, want_owned = _replay(settings, anchor, errors, owned,
                                                       [r["started"][sync] for r in results], sync)
        got = results[0]["anchor"][sync]
        assert all(torch.equal(got, r["anchor"][sync]) for r in results)  # one anchor on every rank
        assert ((got - want).abs() <= bound).all()
        for rank, result in enumerate(results):
            assert torch.equal(result["error"][sync], want_errors[rank])
            if want_owned is not None:
                assert torch.equal(result["owned"][sync], want_owned[rank])
            kept = got + (result["local"][sync] - result["started"][sync])
            assert torch.equal(result["after"][sync], kept)
        assert not torch.equal(results[0]["after"][sync], results[1]["after"][sync])  # each keeps its own step
        anchor, errors = got, [r["error"][sync] for r in results]
        owned = [r["owned"][sync] for r in results] if want_owned is not None else owned
    assert all("flush()" in r["refused"] for r in results)
    assert all(torch.equal(r["flushed"], results[0]["flushed"]) for r in results)
    assert results[0]["stats"]["syncs"] == 5


def test_overlap_must_be_a_bool():
    with pytest.raises(TypeError, match="overlap must be True or False"):
        check_settings(**{**SPARSE, "overlap": "yes"})


def _overlapped_refusal(rank, world_size):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    averager = SparseDeltaAverager(model, **OVERLAPPED)
    generator = torch.Generator().manual_seed(100 + rank)
    _train(model, optimizer, averager, PERIOD - 1, generator)
    anchor, error = averager.anchor.clone(), averager.error.clone()
    x = torch.randn(8, 15, generator=generator)
    optimizer.zero_grad()
    (model(x) - x[:, :4].sin()).square().mean().backward()
    optimizer.step()
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).view(-1)[3] = float("nan")
    averager.step()  # the sync starts with rank 1's NaN in it
    started = averager.pending_collectives
    local = _flat(model)
    try:
        averager.step()  # (no optimizer step: the weights are the ones it started from)
        outcome = None
    except Exception as failure:  # noqa: BLE001 - the type is what the test checks
        outcome = (type(failure).__name__, str(failure))
    return {"started": started, "outcome": outcome, "pending": averager.pending_collectives,
            "steps": averager.optimizer_steps, "anchor_kept": torch.equal(averager.anchor, anchor),
            "error_kept": torch.equal(averager.error, error),
            "weights_kept": torch.equal(_flat(model).nan_to_num(7.0), local.nan_to_num(7.0))}


def test_an_overlapped_sync_with_a_non_finite_value_is_refused_by_the_step_that_applies_it():
    results = run_on_ranks(_overlapped_refusal, world_size=3, timeout=120)
    messages = {r["outcome"][1] for r in results}
    assert len(messages) == 1 and "rank(s) [1]" in messages.pop()
    for r in results:
        assert r["started"] == 1 and r["outcome"][0] == "NonFiniteSyncError"
        assert (r["pending"], r["steps"]) == (0, PERIOD)  # dropped; the refusing step not counted
        assert r["anchor_kept"] and r["error_kept"] and r["weights_kept"]
