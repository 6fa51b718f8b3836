"""The averager's outer sync travels on the hook's own wires: the native kernels, and every payload
sealed and checked (``wire_checksum``), on every exchange; a payload corrupted after its seal is
refused on every rank and the sync changes nothing (the owner exchange, and the shared index whose
quantized values go through the owners)."""
import pytest
import torch

from rank_processes import run_on_ranks
from sparsecomm import SparseDeltaAverager, WireIntegrityError
from sparsecomm.ops import native
from test_averager import QUANTIZED, SPARSE, _model, _train

needs_native = pytest.mark.skipif(not native.load()[0], reason="the native extension is not built")


def _counting(module, name, calls):
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, counted)


def _one_sync_counting_kernels(rank, world_size, settings):
    from sparsecomm.ops import dispatch, reference

    calls = {}
    for name in ("chunk_encode", "chunk_decode_add"):
        _counting(native, name, calls)
        setattr(reference, name, lambda *args, **kwargs: pytest.fail("the reference ran where a kernel should"))
    _counting(dispatch, "crc32c", calls)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    averager = SparseDeltaAverager(model, **settings)
    _train(model, optimizer, averager, averager.period, torch.Generator().manual_seed(100 + rank))
    return calls, averager.stats()["syncs"]


@needs_native
@pytest.mark.parametrize("exchange", ["allgather", "owner"])
def test_the_averagers_sync_runs_the_native_kernels_and_seals_every_payload(exchange):
    results = run_on_ranks(_one_sync_counting_kernels, {**SPARSE, "exchange": exchange}, world_size=3, timeout=120)
    for calls, syncs in results:
        assert syncs == 1
        assert calls.get("chunk_encode", 0) >= 1 and calls.get("chunk_decode_add", 0) >= 1
        # Sealed by the sender, checked by the receivers: at least one CRC each way.
        assert calls.get("crc32c", 0) >= 2


def _one_shared_index_sync_counting_crcs(rank, world_size):
    from sparsecomm.ops import dispatch

    calls = {}
    _counting(dispatch, "crc32c", calls)
    model = _model()
    averager = SparseDeltaAverager(model, **{**SPARSE, "exchange": "shared-index"})
    _train(model, torch.optim.AdamW(model.parameters(), lr=0.02), averager, averager.period,
           torch.Generator().manual_seed(100 + rank))
    return calls.get("crc32c", 0)


def test_the_shared_index_sync_seals_the_leaders_broadcast():
    # The first sync is led by rank 0: it seals its index broadcast, and every rank checks its copy.
    leader_seals_and_checks, *others_check = run_on_ranks(_one_shared_index_sync_counting_crcs, world_size=3,
                                                          timeout=120)
    assert leader_seals_and_checks >= 2 and all(count >= 1 for count in others_check)


def _corrupt_one_owner_message(rank, world_size, settings, wire_module):
    import importlib

    owner = importlib.import_module(wire_module)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    averager = SparseDeltaAverager(model, **settings)
    generator = torch.Generator().manual_seed(100 + rank)
    _train(model, optimizer, averager, averager.period - 1, generator)  # up to the step before the sync
    if rank == 1:  # its message to owner 0 changes after it was sealed (in memory, on the way)
        scatter = owner.all_to_all_bytes

        def corrupting(received, send, *args):
            send[0] ^= 0x10
            return scatter(received, send, *args)

        owner.all_to_all_bytes = corrupting
    x = torch.randn(8, 15, generator=generator)  # the sync step's local step (as _train takes it)
    (model(x) - x[:, :4].sin()).square().mean().backward()
    optimizer.step()
    anchor, error = averager.anchor.clone(), averager.error.clone()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(WireIntegrityError) as raised:
        averager.step()
    unchanged = (torch.equal(averager.anchor, anchor) and torch.equal(averager.error, error)
                 and all(torch.equal(p, w) for p, w in zip(model.parameters(), weights)))
    return str(raised.value), unchanged, averager.optimizer_steps


@pytest.mark.parametrize("settings,wire_module", [
    ({**SPARSE, "exchange": "owner"}, "sparsecomm.hooks.wires.owner"),
    ({**QUANTIZED}, "sparsecomm.hooks.wires.shared_index_owners"),
], ids=["owner", "shared-index-int8"])
def test_an_owner_message_corrupted_after_its_seal_is_refused_on_every_rank_and_changes_nothing(settings,
                                                                                                wire_module):
    results = run_on_ranks(_corrupt_one_owner_message, settings, wire_module, world_size=3, timeout=120)
    messages = {message for message, _, _ in results}
    assert len(messages) == 1, messages  # every rank raises the same error
    (message,) = messages
    assert "SparseDeltaAverager: wire integrity" in message
    assert "owner 0 received a message from rank 1 that does not match its CRC-32C" in message
    assert all(unchanged for _, unchanged, _ in results)
    assert {steps for _, _, steps in results} == {SPARSE["period"] - 1}  # the refused step is not counted
