"""Argument checks of TopKState and register_topk_hook, without any process group.

Each bad setting must fail at construction with the right exception type (TypeError for
a wrong type, ValueError for a wrong value) and a message naming the argument; valid
edge values must be accepted. Nothing here initialises torch.distributed.
"""
import re

import pytest
import torch
import torch.distributed as dist

from sparsecomm import TopKState, register_topk_hook


@pytest.fixture(autouse=True)
def _process_group_untouched():
    before = dist.is_initialized()
    yield
    assert dist.is_initialized() == before  # construction must not initialise anything


def test_construction_needs_no_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("another test left a process group initialised in this process")
    state = TopKState(density=0.1, module=torch.nn.Linear(2, 2))
    assert state.process_group is None
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "density, error",
    [
        (0, ValueError),
        (0.0, ValueError),
        (-0.1, ValueError),
        (1.5, ValueError),
        (1.0000001, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (float("-inf"), ValueError),
        ("0.1", TypeError),
        (True, TypeError),
        (None, TypeError),
        (torch.tensor(0.1), TypeError),
    ],
)
def test_density_rejected(density, error):
    with pytest.raises(error, match="density"):
        TopKState(density=density)


@pytest.mark.parametrize("density", [1.0, 1, 1e-6, 0.5])
def test_density_accepted(density):
    state = TopKState(density=density)
    assert type(state.density) is float
    assert state.density == float(density)


@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_warmup_below_two_with_error_feedback_rejected(warmup_steps):
    with pytest.raises(ValueError, match="warmup_steps must be >= 2"):
        TopKState(warmup_steps=warmup_steps, error_feedback=True)


@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_short_warmup_without_error_feedback_accepted(warmup_steps):
    assert TopKState(warmup_steps=warmup_steps, error_feedback=False).warmup_steps == warmup_steps


@pytest.mark.parametrize(
    "warmup_steps, error",
    [(2.5, TypeError), (2.0, TypeError), ("2", TypeError), (True, TypeError), (-1, ValueError)],
)
def test_warmup_steps_type_and_range(warmup_steps, error):
    with pytest.raises(error, match="warmup_steps"):
        TopKState(warmup_steps=warmup_steps, error_feedback=False)


def test_selector_rejected_lists_choices():
    with pytest.raises(ValueError, match=re.escape("selector must be one of 'exact', 'sampled', 'random'")):
        TopKState(selector="topk")


@pytest.mark.parametrize("selector", ["exact", "sampled", "random"])
def test_selector_accepted(selector):
    assert TopKState(selector=selector).selector == selector


@pytest.mark.parametrize("value_dtype", [torch.int32, torch.float64, torch.uint8, "float32"])
def test_value_dtype_rejected(value_dtype):
    with pytest.raises(ValueError, match="value_dtype must be one of"):
        TopKState(value_dtype=value_dtype)


@pytest.mark.parametrize("value_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_value_dtype_accepted(value_dtype):
    assert TopKState(value_dtype=value_dtype).value_dtype is value_dtype


@pytest.mark.parametrize(
    "momentum, error",
    [(1.0, ValueError), (1.5, ValueError), (-0.1, ValueError), (float("nan"), ValueError), ("0.9", TypeError)],
)
def test_momentum_rejected(momentum, error):
    with pytest.raises(error, match="momentum"):
        TopKState(momentum=momentum)


def test_momentum_accepted():
    assert TopKState(momentum=0.0).momentum == 0.0
    assert TopKState(momentum=0.9).momentum == 0.9


def test_momentum_requires_error_feedback():
    with pytest.raises(ValueError, match="momentum.*requires error_feedback=True"):
        TopKState(momentum=0.9, error_feedback=False, warmup_steps=0)


def test_residual_dtype_requires_error_feedback():
    with pytest.raises(ValueError, match="residual_dtype=torch.float32 .* error_feedback=False does not keep"):
        TopKState(residual_dtype=torch.float32, error_feedback=False, warmup_steps=0)
    assert TopKState(error_feedback=False, warmup_steps=0).config.residual_dtype is None


def test_verify_conservation_requires_error_feedback():
    with pytest.raises(ValueError, match="verify_conservation.*requires error_feedback=True"):
        TopKState(verify_conservation=True, error_feedback=False)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(error_feedback=1), TypeError, "error_feedback"),
        (dict(error_feedback="yes"), TypeError, "error_feedback"),
        (dict(allow_dense_fallback=None), TypeError, "allow_dense_fallback"),
        (dict(verify_conservation=0), TypeError, "verify_conservation"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=1.0), TypeError, "seed"),
    ],
)
def test_other_arguments_rejected(kwargs, error, name):
    with pytest.raises(error, match=name):
        TopKState(**kwargs)


@pytest.mark.parametrize("process_group", ["gloo", 0, object()])
def test_process_group_must_be_a_process_group(process_group):
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        TopKState(process_group)


@pytest.mark.parametrize("module", ["model", 3, [torch.nn.Linear(2, 2)]])
def test_module_must_be_a_module(module):
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        TopKState(module=module)


def test_defaults_and_module_binding_need_no_process_group():
    state = TopKState(module=torch.nn.Linear(2, 2))
    assert state.process_group is None
    assert (state.density, state.error_feedback, state.momentum, state.warmup_steps) == (0.01, True, 0.0, 2)
    assert (state.selector, state.value_dtype, state.seed, state.step) == ("exact", None, 0, 0)


@pytest.mark.parametrize("kwargs", [{}, {"density": 0.1}, {"state": None}])
def test_register_topk_hook_requires_ddp(kwargs):
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_topk_hook(torch.nn.Linear(2, 2), **kwargs)


def test_register_topk_hook_checks_ddp_before_state_arguments():
    # An invalid density would raise ValueError; the DDP type check must come first.
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_topk_hook(torch.nn.Linear(2, 2), density=-1)
