"""flip_bit and the injectors, without a process group.

Localises: wrong bit numbering per dtype (sign / exponent / mantissa), writes that miss
the storage (a copy flipped instead of the tensor), wrong payload byte offsets, injectors
firing at the wrong step or rank, or more than once.
"""
import math

import pytest
import torch

from sparsecomm import compress
from sparsecomm.compress.packing import payload_nbytes
from sparsecomm.hooks.state.events import HookEvent
from sparsecomm.monitor import BitFlipInjector, ValueInjector, flip_bit


@pytest.mark.parametrize(
    "dtype,bit,expected",
    [
        (torch.float32, 31, -1.5),  # sign
        (torch.float32, 30, math.nan),  # top exponent bit: 1.5 has exponent 127 -> 255 = NaN
        (torch.float32, 23, 0.75),  # lowest exponent bit (set in 1.5): / 2
        (torch.float32, 22, 1.0),  # top mantissa bit: 1.5 = 1.1b -> 1.0b
        (torch.float32, 0, 1.5 + 2.0**-23),  # lowest mantissa bit: one ulp
        (torch.float16, 15, -1.5),
        (torch.float16, 10, 0.75),
        (torch.float16, 9, 1.0),
        (torch.bfloat16, 15, -1.5),
        (torch.bfloat16, 7, 0.75),
        (torch.bfloat16, 6, 1.0),
        (torch.float64, 63, -1.5),
        (torch.float64, 51, 1.0),
    ],
)
def test_flip_bit_hits_the_ieee_field(dtype, bit, expected):
    tensor = torch.full((3, 4), 1.5, dtype=dtype)
    before, after = flip_bit(tensor, 6, bit)
    assert before == 1.5
    if math.isnan(expected):
        assert math.isnan(after) and math.isnan(tensor.view(-1)[6].item())
    else:
        assert after == expected and tensor.view(-1)[6].item() == after
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[6] = False
    assert torch.all(tensor.view(-1)[untouched] == 1.5)
    flip_bit(tensor, 6, bit)  # an involution: the second flip restores the value exactly
    assert torch.all(tensor == 1.5)


def test_flip_bit_top_exponent_of_value_below_one_multiplies_by_2_pow_128():
    tensor = torch.tensor([1e-3, -0.5, 1.0])
    assert flip_bit(tensor, 0, 30)[1] == pytest.approx(1e-3 * 2.0**128, rel=1e-6)
    assert flip_bit(tensor, 1, 30)[1] == -0.5 * 2.0**128
    assert flip_bit(tensor, 2, 30)[1] == math.inf  # exponent 127 -> 255 with a zero mantissa


def test_flip_bit_non_contiguous_uint8_and_errors():
    base = torch.zeros(4, 6)
    view = base.t()  # non-contiguous: flat index 1 is base[1, 0]
    flip_bit(view, 1, 30)
    assert base[1, 0].item() == 2.0 and base.sum().item() == 2.0
    payload = torch.zeros(8, dtype=torch.uint8)
    flip_bit(payload, 3, 7)
    assert payload[3].item() == 128
    scalar = torch.tensor(1.0)
    flip_bit(scalar, 0, 31)
    assert scalar.item() == -1.0
    with pytest.raises(ValueError, match="bit must be in"):
        flip_bit(torch.zeros(2, dtype=torch.float16), 0, 16)
    with pytest.raises(IndexError):
        flip_bit(torch.zeros(2), 2, 0)


def _event(stage, step=5, rank=1, dense=False, **tensors):
    return HookEvent(stage, step, rank, 0, ("a", "b"), (6, 10), dense, tensors)


def test_gradient_injector_fires_once_at_its_step_and_rank():
    injector = BitFlipInjector("gradient", step=5, rank=1, bit=30, index=2, name="b")
    gradient = torch.full((16,), 0.25)
    injector(_event("gradient", step=4, gradient=gradient))  # wrong step
    injector(_event("gradient", rank=0, gradient=gradient))  # wrong rank
    injector(_event("packed", acc=gradient, residual=None, indices=None, payload=gradient))  # wrong stage
    assert not injector.fired and torch.all(gradient == 0.25)
    injector(_event("gradient", gradient=gradient))
    injector(_event("gradient", gradient=gradient))  # fires once only
    assert injector.injected == [
        {"target": "gradient", "step": 5, "rank": 1, "bit": 30, "bucket_index": 0, "dense": False,
         "parameter": "b", "element": 2, "before": 0.25, "after": 0.25 * 2.0**128}
    ]
    assert (gradient != 0.25).nonzero().flatten().tolist() == [6 + 2]


def test_payload_injector_flips_a_packed_value_not_an_index():
    acc = torch.linspace(-1, 1, 16)
    k, value_dtype = 3, torch.float32
    payload = torch.empty(payload_nbytes(k, value_dtype), dtype=torch.uint8)
    indices = compress.select_and_pack(acc, k, compress.SELECTORS["exact"], payload, value_dtype)
    clean = payload.clone()
    injector = BitFlipInjector("payload", step=5, rank=None, bit=22, index=1)
    injector(_event("packed", acc=acc, residual=None, indices=indices, payload=payload))
    changed = (payload != clean).nonzero().flatten().tolist()
    assert len(changed) == 1 and changed[0] // 4 == k + 1  # one byte, inside the second value
    decoded = compress.unpack_add(payload.view(1, -1), torch.zeros(16), k, value_dtype)
    reference = compress.unpack_add(clean.view(1, -1), torch.zeros(16), k, value_dtype)
    differs = (decoded != reference).nonzero().flatten().tolist()
    assert differs == [int(indices[1])]  # same index, different value
    record = injector.injected[0]
    assert record["payload_position"] == 1 and record["before"] == acc[indices[1]].item()
    assert record["after"] == decoded[indices[1]].item()


def test_residual_injector_waits_for_a_residual_and_value_injector_writes_nan():
    injector = ValueInjector("residual", step=5, rank=1, value=float("nan"), index=1, name="a")
    acc = torch.ones(16)
    injector(_event("packed", dense=True, acc=acc, residual=None, indices=None, payload=acc))  # warm-up: none
    assert not injector.fired
    residual = torch.zeros(16)
    injector(_event("packed", acc=acc, residual=residual, indices=torch.tensor([0]), payload=torch.zeros(8, dtype=torch.uint8)))
    assert torch.isnan(residual[1]) and torch.isnan(residual).sum() == 1
    assert injector.injected[0]["parameter"] == "a" and injector.injected[0]["element"] == 1


def test_parameter_injector_flips_the_named_parameter_after_the_step():
    model = torch.nn.Linear(3, 2)
    injector = BitFlipInjector("parameter", step=7, rank=0, bit=31, index=1, name="bias")
    before = model.bias.detach().clone()
    assert not injector.maybe_inject_parameters(model, 6, 0)
    assert not injector.maybe_inject_parameters(model, 7, 1)
    assert injector.maybe_inject_parameters(model, 7, 0)
    assert not injector.maybe_inject_parameters(model, 7, 0)
    assert model.bias[1].item() == -before[1].item() and model.bias[0].item() == before[0].item()
    with pytest.raises(ValueError, match="target must be one of"):
        BitFlipInjector("optimizer", step=0, rank=0, bit=0)


def test_reduced_injector_flips_the_received_bucket_of_one_rank_after_the_collective():
    injector = BitFlipInjector("reduced", step=5, rank=1, bit=31, index=3, name="b")
    reduced = torch.full((16,), 0.5)
    injector(_event("gradient", gradient=reduced))  # the local gradient, before the collective: not this target
    injector(_event("reduced", rank=0, reduced=reduced))  # another rank's copy
    assert not injector.fired and torch.all(reduced == 0.5)
    injector(_event("reduced", reduced=reduced))
    assert (reduced != 0.5).nonzero().flatten().tolist() == [6 + 3] and reduced[9].item() == -0.5
    assert injector.injected[0]["parameter"] == "b" and injector.injected[0]["element"] == 3
