"""owner_dropped: where the owner exchange keeps what an owner's re-selection drops.

"owner" (the default): in the owner's owner residual. "sender" (Ok-Topk, Li and Hoefler,
PPoPP 2022): each sender takes its own dropped entries back into its worker residual, and
the owner residual keeps only the rounding of its reply.

Oracles: one bucket worked by hand at 3 ranks (every number written out below), through the
hook and through the averager; the sum over ranks of what came in against the reduced bucket
plus every memory, in float64, step by step, on a quantized wire; a planted fault that only the
sender-side audit can see.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist

import sparsecomm
from rank_processes import run_on_ranks
from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.wires import owner
from sparsecomm.lab.compare import parse_arms
from sparsecomm.lab.experiment.arms import make_arm_hook
from sparsecomm.lab.experiment.named import digits_quick

# ----- one bucket worked by hand ----------------------------------------------------------
#
# A bucket of 9 entries at 3 ranks: exact top-k per owner's range (ranges [0, 3), [3, 6),
# [6, 9): rank r owns the r-th), density 0.5, so every rank sends the top 2 of each range and
# each owner returns the top 2 of the sum. Rank r's gradient is 3 x ACC[r], so acc = grad / 3
# is ACC[r] exactly (the residuals start at 0: warm-up steps of zero gradient).
ACC = [[5, 4, 1, 2, -7, 3, 1, 0, 8],
       [1, 2, 3, 4, 1, -5, 0, 6, -1],
       [6, 1, -2, -1, -3, 2, 3, -1, 0]]
# What each rank sends (index: value), the top 2 of every range of its acc, and keeps:
#   rank 0 sends 0: 5, 1: 4 | 4: -7, 5: 3 | 6: 1, 8: 8    keeps 2: 1, 3: 2
#   rank 1 sends 1: 2, 2: 3 | 3: 4, 5: -5 | 7: 6, 8: -1   keeps 0: 1, 4: 1
#   rank 2 sends 0: 6, 2: -2 | 4: -3, 5: 2 | 6: 3, 7: -1  keeps 1: 1, 3: -1
SENT = [{0: 5, 1: 4, 4: -7, 5: 3, 6: 1, 8: 8},
        {1: 2, 2: 3, 3: 4, 5: -5, 7: 6, 8: -1},
        {0: 6, 2: -2, 4: -3, 5: 2, 6: 3, 7: -1}]
UNSENT = [[0, 0, 1, 2, 0, 0, 0, 0, 0],
          [1, 0, 0, 0, 1, 0, 0, 0, 0],
          [0, 1, 0, -1, 0, 0, 0, 0, 0]]
# The owners' sums: owner 0 [11, 6, 1], owner 1 [4, -10, 0], owner 2 [4, 5, 7]. Each re-selects
# its top 2 and drops one entry:
#   owner 0 drops 2 (sum 1 = rank 1's 3 + rank 2's -2)
#   owner 1 drops 5 (sum 0 = rank 0's 3 + rank 1's -5 + rank 2's 2: it cancels)
#   owner 2 drops 6 (sum 4 = rank 0's 1 + rank 2's 3)
REDUCED = [11, 6, 0, 4, -10, 0, 0, 5, 7]
# owner_dropped="owner": the dropped sums stay with their owners.
OWNER_KEEPS = {"worker": UNSENT,
               "owner": [[0, 0, 1, 0, 0, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 0, 0],  # rank 1's dropped entry summed to 0
                         [0, 0, 0, 0, 0, 0, 4, 0, 0]]}
# owner_dropped="sender": every sender takes its part back, the owners keep nothing (a float32
# reply has no rounding):
#   rank 0 takes back 5: 3 (owner 1) and 6: 1 (owner 2)
#   rank 1 takes back 2: 3 (owner 0) and 5: -5 (owner 1)
#   rank 2 takes back 2: -2 (owner 0), 5: 2 (owner 1) and 6: 3 (owner 2)
SENDERS_KEEP = {"worker": [[0, 0, 1, 2, 0, 3, 1, 0, 0],
                           [1, 0, 3, 0, 1, -5, 0, 0, 0],
                           [0, 1, -2, -1, 0, 2, 3, 0, 0]],
                "owner": [[0] * 9] * 3}
EXPECTED = {"owner": OWNER_KEEPS, "sender": SENDERS_KEEP}


def test_the_hand_worked_numbers_add_up():
    # The table above against a plain loop: each rank's top 2 per range, each owner's top 2 of
    # the sum, and every input either reduced or in some memory.
    ranges = [range(0, 3), range(3, 6), range(6, 9)]

    def top2(values: dict) -> set:
        return set(sorted(values, key=lambda i: -abs(values[i]))[:2])

    for rank in range(3):
        chosen = set().union(*(top2({i: ACC[rank][i] for i in r}) for r in ranges))
        assert SENT[rank] == {i: ACC[rank][i] for i in sorted(chosen)}
        assert UNSENT[rank] == [0 if i in chosen else ACC[rank][i] for i in range(9)]
    sums = [sum(SENT[rank].get(i, 0) for rank in range(3)) for i in range(9)]
    delivered = set().union(*(top2({i: sums[i] for i in r}) for r in ranges))
    assert REDUCED == [sums[i] if i in delivered else 0 for i in range(9)]
    for rank in range(3):
        taken_back = [SENT[rank].get(i, 0) if i not in delivered else 0 for i in range(9)]
        assert SENDERS_KEEP["worker"][rank] == [u + t for u, t in zip(UNSENT[rank], taken_back)]
        assert OWNER_KEEPS["owner"][rank] == [sums[i] if i in ranges[rank] and i not in delivered else 0
                                              for i in range(9)]
    inputs = [sum(ACC[rank][i] for rank in range(3)) for i in range(9)]
    for mode, kept in EXPECTED.items():
        assert inputs == [REDUCED[i] + sum(kept["worker"][r][i] + kept["owner"][r][i] for r in range(3))
                          for i in range(9)], mode


class Vector(torch.nn.Module):
    """One parameter w, whose gradient is the forward's input."""

    def __init__(self, numel: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel))

    def forward(self, gradient):
        return (self.w * gradient).sum()


def _memories(state, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(worker residual, owner residual) of a one-parameter model, from the state's dict (zeros
    before the first sparse step has made them)."""
    saved = state.state_dict()
    worker = [v for k, v in saved.items() if ".residual." in k and ".owner_residual." not in k]
    owned = [v for k, v in saved.items() if ".owner_residual." in k]
    return tuple(found[0].flatten().clone() if found else torch.zeros(numel) for found in (worker, owned))


def _hand_worked_step(rank, world_size, owner_dropped):
    ddp = torch.nn.parallel.DistributedDataParallel(Vector(9))
    state = sparsecomm.register_topk_hook(ddp, density=0.5, selector="exact", exchange="owner",
                                          owner_dropped=owner_dropped, budget="bucket", warmup_steps=2,
                                          allow_dense_fallback=False, verify_conservation=True)
    for gradient in (torch.zeros(9), torch.zeros(9), 3 * torch.tensor(ACC[rank], dtype=torch.float32)):
        ddp.zero_grad()
        ddp(gradient).backward()
    worker, owned = _memories(state, 9)
    return ddp.module.w.grad.clone(), worker, owned, state.stats()["owner_calls"]


@pytest.mark.parametrize("owner_dropped", ["owner", "sender"])
def test_the_hand_worked_bucket_through_the_hook(owner_dropped):
    results = run_on_ranks(_hand_worked_step, owner_dropped, world_size=3, timeout=120)
    expected = EXPECTED[owner_dropped]
    for rank, (reduced, worker, owned, owner_calls) in enumerate(results):
        assert owner_calls == 1
        assert reduced.tolist() == REDUCED, rank
        assert worker.tolist() == expected["worker"][rank], rank
        assert owned.tolist() == expected["owner"][rank], rank


def _averager_sync(rank, world_size, owner_dropped):
    # The same bucket as the averager's one sync: delta = anchor - weights = 3 x ACC[rank], every
    # rank's error buffer and owner residual then hold 3 x the table's memories, and the new
    # anchor is 0 - (3 x REDUCED) / 3.
    ddp = torch.nn.parallel.DistributedDataParallel(Vector(9))
    averager = sparsecomm.SparseDeltaAverager(ddp, period=1, density=0.5, selector="exact", index_codec="int32",
                                              value_codec="fp32", outer_lr=1.0, ef_decay=1.0, exchange="owner",
                                              owner_dropped=owner_dropped)
    with torch.no_grad():
        ddp.module.w.copy_(-3 * torch.tensor(ACC[rank], dtype=torch.float32))
    assert averager.step()
    return averager.anchor.clone(), averager.error.clone(), averager.owner_residual.clone(), averager.settings()


@pytest.mark.parametrize("owner_dropped", ["owner", "sender"])
def test_the_hand_worked_bucket_through_the_averager(owner_dropped):
    results = run_on_ranks(_averager_sync, owner_dropped, world_size=3, timeout=120)
    expected = EXPECTED[owner_dropped]
    for rank, (anchor, error, owned, settings) in enumerate(results):
        assert anchor.tolist() == [-v for v in REDUCED], rank
        assert error.tolist() == [3 * v for v in expected["worker"][rank]], rank
        assert owned.tolist() == [3 * v for v in expected["owner"][rank]], rank
        assert settings.get("owner_dropped") == (None if owner_dropped == "owner" else "sender")


# ----- conservation, step by step, on a quantized wire --------------------------------------


def _conservation_steps(rank, world_size, owner_dropped, selector, value_codec):
    """Per sparse step: (sum over ranks of the old memories and of grad / p, the reduced
    bucket, the sum over ranks of the new memories), in float64; and the owner residuals."""
    numel = 600
    ddp = torch.nn.parallel.DistributedDataParallel(Vector(numel))
    chunking = {"chunk_size": 128} if selector == "chunk" else {}
    state = sparsecomm.register_topk_hook(ddp, density=0.05, selector=selector, index_codec="rice",
                                          value_codec=value_codec, exchange="owner", owner_dropped=owner_dropped,
                                          budget="bucket", allow_dense_fallback=False, verify_conservation=True,
                                          **chunking)
    generator = torch.Generator().manual_seed(50 + rank)
    rows = []
    for step in range(7):
        # Small integers times p: grad / p is an integer, and every sum the hook forms is exact
        # in float32, so the float64 books below must balance to the bit.
        gradient = 3.0 * torch.randint(-20, 21, (numel,), generator=generator).float()
        worker, owned = _memories(state, numel)
        ddp.zero_grad()
        ddp(gradient).backward()
        new_worker, new_owned = _memories(state, numel)
        came_in = torch.stack([worker, owned, gradient / world_size]).double().sum(0)
        kept = torch.stack([new_worker, new_owned]).double().sum(0)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (came_in, kept))
        if step >= 2:
            rows.append((sum(c for c, _ in everyone), ddp.module.w.grad.double().clone(), sum(k for _, k in everyone),
                         new_owned))
    return rows, state.stats()["owner_calls"]


@pytest.mark.parametrize("selector,value_codec", [("exact", "int4"), ("chunk", "int2"), ("exact", "fp32")])
@pytest.mark.parametrize("owner_dropped", ["owner", "sender"])
def test_what_came_in_is_reduced_or_kept_to_the_bit(owner_dropped, selector, value_codec):
    results = run_on_ranks(_conservation_steps, owner_dropped, selector, value_codec, world_size=3, timeout=240)
    rows, owner_calls = results[0]
    assert owner_calls == len(rows) == 5
    for came_in, reduced, kept, _ in rows:
        assert torch.equal(reduced + kept, came_in)
        assert bool(kept.ne(0).any()) and bool(reduced.ne(0).any())  # (nothing trivially empty)
    owned = [row[3] for rank_rows, _ in results for row in rank_rows]
    if owner_dropped == "sender" and value_codec == "fp32":
        assert all(not bool(t.ne(0).any()) for t in owned)  # a float32 reply rounds nothing: no owner residual
    else:
        assert any(bool(t.ne(0).any()) for t in owned)  # the dropped sums (owner), the replies' rounding (sender)


# ----- the audit's model of what was sent ---------------------------------------------------


def _take_back_twice(rank, world_size):
    """A sender that takes back more than it sent must be caught by the audit."""
    take_back = owner.take_back_undelivered

    def too_much(out, packed, residual):
        returned = take_back(out, packed, residual)
        residual.index_add_(0, returned, torch.ones(returned.numel(), dtype=residual.dtype))
        return returned

    owner.take_back_undelivered = too_much
    ddp = torch.nn.parallel.DistributedDataParallel(Vector(9))
    sparsecomm.register_topk_hook(ddp, density=0.5, selector="exact", exchange="owner", owner_dropped="sender",
                                  budget="bucket", allow_dense_fallback=False, verify_conservation=True)
    try:
        for gradient in (torch.zeros(9), torch.zeros(9), 3 * torch.tensor(ACC[rank], dtype=torch.float32)):
            ddp(gradient).backward()
    except Exception as error:  # DDP re-raises the hook's ConservationError from backward()
        return str(error)
    return ""


def test_the_audit_catches_a_sender_that_takes_back_too_much():
    messages = run_on_ranks(_take_back_twice, world_size=3, timeout=120)
    assert all("sent + residual != grad/ws + old_residual" in message for message in messages), messages


# ----- settings ----------------------------------------------------------------------------


@pytest.mark.parametrize("settings,message", [
    ({"owner_dropped": "sender"}, "owner_dropped='sender' .* needs exchange='owner' or 'auto', got "
                                  "exchange='allgather'"),
    ({"owner_dropped": "sender", "exchange": "shared-index"}, "got exchange='shared-index'"),
    ({"owner_dropped": "receiver", "exchange": "owner"}, "owner_dropped must be one of 'owner', 'sender'"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        sparsecomm.TopKState(**settings)
    with pytest.raises(ValueError, match=message):
        TopKConfig.build(**settings)


def test_the_averager_refuses_it_without_owners():
    from sparsecomm.averaging.sparse_delta import check_settings

    settings = dict(period=2, density=0.05, selector="exact", chunk_size=4096, index_codec="rice",
                    value_codec="int2", outer_lr=1.0, ef_decay=0.95)
    with pytest.raises(ValueError, match="owner_dropped='sender'"):
        check_settings(**settings, owner_dropped="sender")
    assert check_settings(**settings, exchange="auto", owner_dropped="sender").owner_dropped == "sender"


def test_the_default_keeps_checkpoints_and_auto_takes_it():
    assert "owner_dropped" not in TopKConfig.build(exchange="owner").checkpoint_dict()
    assert TopKConfig.build(exchange="owner", owner_dropped="sender").checkpoint_dict()["owner_dropped"] == "sender"
    assert sparsecomm.TopKState(exchange="auto", selector="chunk", owner_dropped="sender").owner_dropped == "sender"


def test_the_lab_arms_of_both_modes():
    arms = ["topk-dgc-owner=topk:density=0.01,momentum=0.9,exchange=owner",
            "topk-dgc-owner-sender=topk:density=0.01,momentum=0.9,exchange=owner,owner_dropped=sender"]
    names, definitions = parse_arms(["dense", *arms])
    config = dataclasses.replace(digits_quick(), arms=names, arm_definitions=definitions)
    names = names[1:]
    model = torch.nn.Linear(8, 4)
    for name, mode in zip(names, ("owner", "sender")):
        state = make_arm_hook(name, config, model, seed=0).state
        assert (state.exchange, state.owner_dropped, state.momentum, state.density) == ("owner", mode, 0.9, 0.01)
    assert "owner_dropped" not in config.arm(names[0]).options  # (the arm the lab has always run, its hash kept)
    assert config.run_hash(names[0], 0) != config.run_hash(names[1], 0)
