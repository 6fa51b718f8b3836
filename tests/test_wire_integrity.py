"""Integrity on the wire (``wire_checksum``, on by default).

The defect: one rank's payload corrupted in range after encoding (one value byte, one index
bit) was applied silently. Now every rank checks every payload it received before decoding:

- a fault at the sender, seen by every rank after the all-gather: every rank raises the same
  error (step, bucket, sender) from backward(), before the optimizer step; no parameter
  changed, and a loop that goes on (skipping that batch) equals, bit for bit, the run that
  never saw the batch (the hook's memories were rolled back). Default wire, compact wire
  (rice + int4) and owner exchange, at 2 and 3 ranks. With the opt-out the corrupted
  payload is applied: the parameters leave the clean run's.
- a fault on the way to one receiver of three: with the opt-out the replicas diverge; with
  the checksum that receiver refuses the payload and the others, whose bytes were intact,
  apply exactly the clean update; with ``wire_agreement`` every rank raises the same error
  in that step, and going on equals the run without that batch on every rank.
- the shared-index exchange's index broadcast: a fault at the leader or at one receiver
  makes every rank raise alike (the verdict rides the values allreduce).
- transport="mpi": the fixed and the variable Iallgatherv and the owner exchange's
  Alltoallv carry the checksum too (under mpiexec -n 2: tests/mpi_scripts/wire_integrity.py).
- bytes: the 8-byte trailer is counted in what stats() reports sent and received.
"""
import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.compress.chunk_layout import ChunkLayout
from sparsecomm.compress.layout import PayloadLayout
from sparsecomm.compress.owner_layout import OwnerLayout
from sparsecomm.hooks.wires import allgather as allgather_wire
from sparsecomm.monitor.fault_injector import BitFlipInjector, flip_bit

from ddp_models import backward_error, mlp, params, rank_data
from mpi_launch import run_mpiexec
from rank_processes import run_on_ranks

pytestmark = pytest.mark.timeout(300)

FAULT_STEP = 3  # after the two dense warm-up steps
SENDER = 1  # the rank whose payload is corrupted
STEPS = 5
DENSITY = 0.05
WIRES = {  # options, and the bit the value fault flips (inside the value's first byte for int4 codes)
    "default": ({}, 22),
    "compact": ({"index_codec": "rice", "value_codec": "int4"}, 1),
    "owner": ({"exchange": "owner"}, 22),
}
INTEGRITY = re.compile(r"topk_hook: wire integrity[^\n]*")


class IndexBitFlip:
    """Flip, once, at one (step, rank), one bit of the index region of the payload about to be
    sent (the first region of owner 0's message with the owner exchange): the first bit whose
    flip still decodes to distinct positions inside the bucket, other than the sent ones, so
    no decoder could notice. Observes the hook's ``packed`` event, after encoding."""

    needs_acc = False

    def __init__(self, step: int, rank: int):
        self.step, self.rank, self.flipped = step, rank, None

    def __call__(self, event) -> None:
        if (event.stage != "packed" or event.dense or event.step != self.step or event.rank != self.rank
                or self.flipped is not None):
            return
        payload = event.tensors["payload"]
        start, stop, numel, positions = _index_region(event.layout)
        sent = positions(payload)
        for bit in range(start * 8, stop * 8):
            trial = payload.clone()
            flip_bit(trial, bit // 8, bit % 8)
            try:
                moved = positions(trial)
            except Exception:  # noqa: BLE001  (a code that no longer parses: not an in-range fault)
                continue
            if (moved.numel() == sent.numel() and bool(((moved >= 0) & (moved < numel)).all())
                    and moved.unique().numel() == moved.numel() and not torch.equal(moved, sent)):
                flip_bit(payload, bit // 8, bit % 8)
                self.flipped = bit
                return
        raise AssertionError("no in-range index bit to flip")


def _index_region(layout):
    """(first byte, end byte, positions allowed, decoder of the positions) of a payload's indices."""
    if isinstance(layout, PayloadLayout):
        return 0, layout.index_bytes, 2**31 - 1, lambda p: layout.payload_views(p)[0].long()
    if isinstance(layout, ChunkLayout):
        return (layout.scale_bytes, layout.scale_bytes + layout.index_bytes, layout.numel,
                lambda p: layout.decode(p)[0])
    assert isinstance(layout, OwnerLayout)
    part, offset = layout.parts[0], layout.part_offsets[0]
    return (offset + part.scale_bytes, offset + part.scale_bytes + part.index_bytes, part.numel,
            lambda p: part.decode(layout.part_of(p, 0))[0])


def test_the_options_are_checked_when_the_state_is_built():
    with pytest.raises(ValueError, match="wire_agreement=True agrees on what the checksum finds: it needs "
                                         "wire_checksum=True"):
        sparsecomm.TopKState(wire_checksum=False, wire_agreement=True)
    for name in ("wire_checksum", "wire_agreement"):
        with pytest.raises(TypeError, match=name):
            sparsecomm.TopKState(**{name: "yes"})
    assert sparsecomm.TopKState().config.wire_checksum and not sparsecomm.TopKState().config.wire_agreement


def _integrity_error(message: str) -> str | None:
    """The hook's own message inside DDP's wrapper (which adds a traceback that differs by rank)."""
    found = INTEGRITY.search(message)
    return found.group(0) if found else None


def _train(rank, options, *, checksum=True, observers=(), skip=None, steps=STEPS):
    """Train ``steps`` steps (SGD with momentum); a step whose backward raises is skipped, as is
    batch ``skip``. Returns the errors by step, the parameters after every step, the stats."""
    ddp = DDP(mlp())
    state = sparsecomm.register_topk_hook(ddp, density=DENSITY, allow_dense_fallback=False, wire_checksum=checksum,
                                          **options)
    for observer in observers:
        state.add_observer(observer)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    errors, trace = [], []
    for step, x in enumerate(rank_data(rank, steps, (8, 32))):
        error = None
        if step != skip:
            optimizer.zero_grad()
            error = backward_error(ddp, x) or None
            if error is None:
                optimizer.step()
        errors.append(error)
        trace.append(params(ddp.module))
    return {"errors": errors, "trace": trace, "stats": state.stats()}


def _sender_faults_worker(rank, world_size):
    out = {}
    for wire, (options, value_bit) in WIRES.items():
        out[wire, "clean"] = _train(rank, options)
        out[wire, "skipped"] = _train(rank, options, skip=FAULT_STEP)
        for checksum in (True, False):
            value_fault = BitFlipInjector("payload", step=FAULT_STEP, rank=SENDER, bit=value_bit, index=0)
            out[wire, "value", checksum] = _train(rank, options, checksum=checksum, observers=[value_fault])
            out[wire, "value", checksum]["fired"] = value_fault.fired
            index_fault = IndexBitFlip(FAULT_STEP, SENDER)
            out[wire, "index", checksum] = _train(rank, options, checksum=checksum, observers=[index_fault])
            out[wire, "index", checksum]["fired"] = index_fault.flipped is not None
    # The owner's report of a bad message, through the step's agreement (wire_agreement).
    options, value_bit = WIRES["owner"]
    value_fault = BitFlipInjector("payload", step=FAULT_STEP, rank=SENDER, bit=value_bit, index=0)
    out["owner", "value", "agreed"] = _train(rank, {**options, "wire_agreement": True}, observers=[value_fault])
    return out


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"{p}ranks")
def sender_runs(request):
    """Every rank's runs of _sender_faults_worker, at 2 and 3 ranks (one job each)."""
    return run_on_ranks(_sender_faults_worker, world_size=request.param, timeout=280)


def test_a_payload_corrupted_at_its_sender_stops_every_rank_before_the_optimizer_step(sender_runs):
    ranks = sender_runs
    for wire in WIRES:
        for fault in ("value", "index"):
            on = [r[wire, fault, True] for r in ranks]
            assert on[SENDER]["fired"], (wire, fault)
            # Every rank raised, at the fault step only, the same error naming step, bucket and sender.
            messages = [_integrity_error(r["errors"][FAULT_STEP] or "") for r in on]
            assert messages[0] is not None and len(set(messages)) == 1, (wire, fault, [r["errors"] for r in on])
            sender = (f"owner 0 received a message from rank {SENDER}" if wire == "owner" else
                      f"the payload from rank {SENDER} does not match its CRC-32C")
            assert f"step {FAULT_STEP}, bucket 0:" in messages[0] and sender in messages[0], messages[0]
            for r in on:
                assert [e is not None for e in r["errors"]] == [s == FAULT_STEP for s in range(STEPS)], r["errors"]
                # Nothing changed at the fault step, and going on equals the run without that batch.
                assert _same(r["trace"][FAULT_STEP], r["trace"][FAULT_STEP - 1])
            for r, skipped in zip(on, (r[wire, "skipped"] for r in ranks)):
                for step in range(STEPS):
                    assert _same(r["trace"][step], skipped["trace"][step]), (wire, fault, step)
            # With the step's agreement: the same error, the same outcome.
            if (wire, fault) == ("owner", "value"):
                agreed = [r[wire, fault, "agreed"] for r in ranks]
                assert {_integrity_error(r["errors"][FAULT_STEP] or "") for r in agreed} == {messages[0]}
                for r, skipped in zip(agreed, (r[wire, "skipped"] for r in ranks)):
                    assert all(_same(a, b) for a, b in zip(r["trace"], skipped["trace"]))
            # The opt-out: the corrupted payload is applied silently.
            off = [r[wire, fault, False] for r in ranks]
            assert all(e is None for r in off for e in r["errors"]), (wire, fault)
            for r, clean in zip(off, (r[wire, "clean"] for r in ranks)):
                assert _same(r["trace"][FAULT_STEP - 1], clean["trace"][FAULT_STEP - 1])
                assert not _same(r["trace"][FAULT_STEP], clean["trace"][FAULT_STEP]), (wire, fault)


def _sent_and_received(run) -> tuple[int, int]:
    last = run["stats"]["last_step"]  # step STEPS - 1: a clean sparse step in every run
    return last["bytes_sent"], last["bytes_received"]


def test_the_trailer_is_counted_in_the_bytes_sent_and_received(sender_runs):
    """8 more bytes per payload a rank sends, and per payload it receives from another rank,
    than the opt-out sends on the same step (same layout, same sizes)."""
    p = len(sender_runs)
    # Payloads per rank and step: the all-gather sends 1 and receives p - 1; the owner exchange
    # sends p - 1 messages and a reply and receives p - 1 of each (every owner has a range here).
    sent_payloads = {"default": 1, "compact": 1, "owner": p}
    received_payloads = {"default": p - 1, "compact": p - 1, "owner": 2 * (p - 1)}
    for wire in WIRES:
        for rank, r in enumerate(sender_runs):
            sent_on, received_on = _sent_and_received(r[wire, "value", True])
            sent_off, received_off = _sent_and_received(r[wire, "value", False])
            assert sent_on - sent_off == 8 * sent_payloads[wire], (wire, rank)
            assert received_on - received_off == 8 * received_payloads[wire], (wire, rank)
            assert r[wire, "value", True]["stats"]["seconds_wire_checksum"] > 0
            assert r[wire, "value", False]["stats"]["seconds_wire_checksum"] == 0


# ----- a fault on the way to one receiver ---------------------------------------------------

RECEIVER = 2


class _StepWatch:
    """Keeps the hook's current step where a patched collective can read it."""

    needs_acc = False

    def __init__(self):
        self.step = None

    def __call__(self, event):
        self.step = event.step


def _arrives_corrupted(original, rank, watch, trailer):
    """``allgather_wire.allgather_future`` that flips, on RECEIVER at FAULT_STEP, one value bit of
    SENDER's payload after it arrived: a fault in transit only that receiver sees."""

    done = []

    def allgather(out, payload, group):
        fut = original(out, payload, group)
        if rank != RECEIVER or watch.step != FAULT_STEP or done:
            return fut
        done.append(True)  # once: the rolled-back step runs again with the next batch
        row = payload.numel()  # the default wire: [k int32 | k float32 | trailer]
        k = (row - trailer) // 8

        def corrupt(done):
            gathered = done.value()
            # Byte 2 of the float32 value at position k // 2: its bit 6 is the top mantissa bit.
            flip_bit(gathered, SENDER * row + 4 * k + 4 * (k // 2) + 2, 6)
            return gathered

        return fut.then(corrupt)

    return allgather


def _transit_worker(rank, world_size):
    original = allgather_wire.allgather_future
    out = {"clean": _train(rank, {}), "skipped": _train(rank, {}, skip=FAULT_STEP)}
    # (name, checksum, options, steps): without the agreement the receiver stops at the fault.
    for name, checksum, options, steps in (("off", False, {}, STEPS), ("checksum", True, {}, FAULT_STEP + 1),
                                           ("agreed", True, {"wire_agreement": True}, STEPS)):
        watch = _StepWatch()
        allgather_wire.allgather_future = _arrives_corrupted(original, rank, watch, trailer=8 if checksum else 0)
        try:
            out[name] = _train(rank, options, checksum=checksum, observers=[watch], steps=steps)
        finally:
            allgather_wire.allgather_future = original
    return out


def test_a_payload_corrupted_on_its_way_to_one_receiver_is_applied_by_nobody():
    ranks = run_on_ranks(_transit_worker, world_size=3, timeout=200)
    clean = [r["clean"]["trace"][FAULT_STEP] for r in ranks]
    # The opt-out (the defect): the receiver applies the corrupted value, the replicas diverge.
    off = [r["off"] for r in ranks]
    assert all(e is None for r in off for e in r["errors"])
    assert _same(off[0]["trace"][FAULT_STEP], clean[0]) and _same(off[SENDER]["trace"][FAULT_STEP], clean[SENDER])
    assert not _same(off[RECEIVER]["trace"][FAULT_STEP], off[0]["trace"][FAULT_STEP])
    # The checksum: the receiver refuses it before decoding (its parameters stay as they were);
    # the others received intact bytes and apply exactly the clean update.
    on = [r["checksum"] for r in ranks]
    message = _integrity_error(on[RECEIVER]["errors"][FAULT_STEP] or "")
    assert message is not None and f"the payload from rank {SENDER} does not match its CRC-32C" in message
    assert _same(on[RECEIVER]["trace"][FAULT_STEP], on[RECEIVER]["trace"][FAULT_STEP - 1])
    for rank in (0, SENDER):
        assert on[rank]["errors"][FAULT_STEP] is None and _same(on[rank]["trace"][FAULT_STEP], clean[rank])
    # wire_agreement: only the receiver's check fails, the step's agreement makes every rank
    # raise the same error before the optimizer step, and going on equals the run without
    # that batch, on every rank: the replicas stay together.
    agreed = [r["agreed"] for r in ranks]
    messages = {_integrity_error(r["errors"][FAULT_STEP] or "") for r in agreed}
    assert len(messages) == 1 and None not in messages, [r["errors"] for r in on]
    assert f"step {FAULT_STEP}, bucket 0: the payload from rank {SENDER} does not match its CRC-32C" in messages.pop()
    for r, skipped in zip(agreed, (r["skipped"] for r in ranks)):
        assert [e is not None for e in r["errors"]] == [s == FAULT_STEP for s in range(STEPS)]
        for step in range(STEPS):
            assert _same(r["trace"][step], skipped["trace"][step]), step


# ----- the shared-index exchange: the leader's index broadcast --------------------------------


def _corrupting_broadcast(original, rank, watch, where):
    """``dist.broadcast`` that flips, once, at FAULT_STEP, bit 0 of the broadcast index bytes: in
    the leader's buffer before it is sent ("leader"), or in RECEIVER's copy after it arrived."""
    done = []

    def broadcast(tensor, src, group=None, async_op=False):
        at_fault = watch.step == FAULT_STEP and tensor.dtype == torch.uint8 and not done
        if at_fault:
            done.append(True)  # the rolled-back step runs again with the next batch: once only
        if at_fault and where == "leader" and rank == src:
            flip_bit(tensor, 0, 0)
        work = original(tensor, src=src, group=group, async_op=async_op)
        if at_fault and where == "receiver" and rank == RECEIVER:
            flip_bit(tensor, 0, 0)
        return work

    return broadcast


def _shared_index_worker(rank, world_size):
    options = {"exchange": "shared-index"}
    original = dist.broadcast
    out = {"skipped": _train(rank, options, skip=FAULT_STEP)}
    for where in ("leader", "receiver"):
        watch = _StepWatch()
        dist.broadcast = _corrupting_broadcast(original, rank, watch, where)
        try:
            out[where] = _train(rank, options, observers=[watch])
        finally:
            dist.broadcast = original
    return out


def test_a_corrupted_index_broadcast_stops_every_rank_alike():
    ranks = run_on_ranks(_shared_index_worker, world_size=3, timeout=200)
    leader = FAULT_STEP % 3  # bucket 0 of step t is led by rank t mod p
    assert leader not in (RECEIVER,)
    for where, seen_by in (("leader", 3), ("receiver", 1)):
        runs = [r[where] for r in ranks]
        messages = {_integrity_error(r["errors"][FAULT_STEP] or "") for r in runs}
        assert len(messages) == 1 and None not in messages, [r["errors"] for r in runs]
        assert (f"the index broadcast of the leader, rank {leader}, does not match its CRC-32C on {seen_by} of 3 "
                f"ranks") in messages.pop()
        for r, skipped in zip(runs, (r["skipped"] for r in ranks)):
            assert [e is not None for e in r["errors"]] == [s == FAULT_STEP for s in range(STEPS)]
            for step in range(STEPS):
                assert _same(r["trace"][step], skipped["trace"][step]), (where, step)


# ----- transport="mpi" -------------------------------------------------------------------------


def test_the_mpi_transports_carry_the_checksum_too(tmp_path):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts", "wire_integrity.py")
    run_mpiexec([script, str(tmp_path)], num_ranks=2, timeout=150)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for wire, sender in (("exact", "the payload from rank 1 does not match its CRC-32C"),
                         ("sampled", "the payload from rank 1 does not match its CRC-32C"),
                         ("owner", "owner 0 received a message from rank 1 that does not match its CRC-32C")):
        messages = [_integrity_error(report[wire]["errors"][FAULT_STEP] or "") for report in reports]
        assert messages[0] is not None and messages[0] == messages[1], (wire, reports)
        assert f"step {FAULT_STEP}, bucket 0:" in messages[0] and sender in messages[0], messages[0]
        for report in reports:
            assert [e is not None for e in report[wire]["errors"]] == [s == FAULT_STEP for s in range(STEPS)]
            assert report[wire]["unchanged"][FAULT_STEP]
