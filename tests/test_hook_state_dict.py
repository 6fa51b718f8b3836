"""TopKState.load_state_dict trusts nothing in the dict: each malformed or foreign entry is
refused before anything is restored, with an error naming the key (one rank, in-process);
shares of the model's k that differ between ranks are refused at the next step on every
rank (2 gloo ranks)."""
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm import TopKState
from ddp_models import backward_error
from rank_processes import run_on_ranks


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _bound_state(**kwargs):
    state = TopKState(density=0.05, **kwargs)
    torch.manual_seed(0)
    state.bind(nn.Linear(6, 4))  # weight: 24 elements, bias: 4
    return state


def _saved(**kwargs):
    saved = _bound_state(**kwargs).state_dict()
    saved["rank0.residual.weight"] = torch.arange(24, dtype=torch.float32)  # something to notice if restored
    return saved


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update({"rank0.residual.weight": torch.zeros(6, 4)}), "must be flat (1-D"),  # transposed 2-D
    (lambda d: d.update({"rank0.residual.weight": torch.zeros(24, dtype=torch.int64)}), "floating-point tensor"),
    (lambda d: d.update({"rank0.residual.weight": [0.0] * 24}), "floating-point tensor"),
    (lambda d: d.update({"rank0.bogus": 1}), "key(s) that TopKState.state_dict() never writes"),
    (lambda d: d.update({"rankX.residual.weight": torch.zeros(24)}), "never writes (first: ['rankX.residual.weight']"),
    (lambda d: d.update({"rank.residual": torch.zeros(24)}), "never writes"),
    (lambda d: d.update({"rank0.residual.": torch.zeros(24)}), "never writes"),
    (lambda d: d.update({"rank3.residual.weight": torch.zeros(24)}), "holds rank(s) [3] but says world_size=1"),
    (lambda d: d.update({"step": "3"}), "state_dict['step'] must be an integer >= 0, got '3'"),
    (lambda d: d.update({"step": -1}), "state_dict['step'] must be an integer >= 0, got -1"),
    (lambda d: d.update({"world_size": 0}), "state_dict['world_size'] must be an integer >= 1"),
    (lambda d: d.pop("config"), "lacks ['config']"),
    (lambda d: d.update({"config": None}), "state_dict['config'] must be a dict"),
    (lambda d: d.update({"memory_scale": -2.0}), "memory_scale'] must be None or a positive finite number"),
    (lambda d: d.update({"rank0.stats": "lots"}), "rank0.stats must be a dict"),
    (lambda d: d.update({"budget_shares": {"weight": -1.0}}), "budget_shares'] must be None or a dict"),
    (lambda d: d.update({"budget_shares": {"weight": 1e308, "bias": 1e308}}), "number in [0, 2**53]"),  # sum: inf
], ids=["transposed-2d", "int-residual", "list-residual", "extra-key", "rank-not-a-number", "rank-no-number",
        "empty-name", "rank-beyond-world", "step-string", "step-negative", "world-size-0", "no-config",
        "config-null", "scale-negative", "stats-string", "budget-shares-negative", "budget-shares-huge"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_malformed_state_dicts_are_refused_strict_or_not(edit, message, strict):
    saved = _saved()
    edit(saved)
    state = _bound_state()
    before = state.state_dict()
    with pytest.raises(ValueError, match=re.escape(message)):
        state.load_state_dict(saved, strict=strict)
    after = state.state_dict()  # nothing was restored
    assert all(torch.equal(before[k], after[k]) for k in before if isinstance(before[k], torch.Tensor))


@pytest.mark.parametrize("container", [{}, [], None, "state"], ids=["empty-dict", "list", "none", "string"])
def test_not_a_state_dict_at_all(container):
    with pytest.raises(ValueError, match="format|must be a dict"):
        _bound_state().load_state_dict(container)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update({"rank0.residual.weight": torch.zeros(20)}), "wrong number of elements for 1 parameter(s): "
                                                                      "['weight (20 != 24)']"),
    (lambda d: d.update({"rank0.residual.weight": torch.full((24,), float("nan"))}), "hold Inf or NaN"),
    (lambda d: d.update({"rank0.residual.other.weight": torch.zeros(24)}), "the model does not have (first: "
                                                                            "['other.weight'])"),
    (lambda d: d.pop("rank0.residual.bias"), "missing for 1 parameter(s): ['bias']"),
], ids=["wrong-numel", "nan", "foreign-parameter", "missing-parameter"])
def test_foreign_or_non_finite_memories_are_refused_strictly_and_reset_leniently(edit, message):
    saved = _saved()
    edit(saved)
    with pytest.raises(ValueError, match=re.escape(message)):
        _bound_state().load_state_dict(saved)
    state = _bound_state()
    with pytest.warns(UserWarning, match="resetting error-feedback residuals"):
        state.load_state_dict(saved, strict=False)
    restored = state.state_dict()
    assert state.stats()["residual_reset"] is True
    assert all(not restored[k].any() for k in restored if ".residual." in k)  # reset, not half-loaded


def test_a_good_state_dict_round_trips_exactly():
    saved = _saved()
    state = _bound_state()
    state.load_state_dict(saved)
    again = state.state_dict()
    assert torch.equal(again["rank0.residual.weight"], torch.arange(24, dtype=torch.float32))
    assert again.keys() == saved.keys() and again["step"] == saved["step"]


def test_budget_shares_of_parameters_the_model_does_not_have_are_refused_naming_them():
    saved = _bound_state(budget="model").state_dict()
    saved["budget_shares"] = {"weight": 1.0, "bias": 0.5, "other.weight": 2.0, "gone": 1.0}
    with pytest.raises(ValueError, match=re.escape("budget_shares'] name 2 parameter(s) the model does not have "
                                                   "(first: ['gone', 'other.weight'])")):
        _bound_state(budget="model").load_state_dict(saved)


@pytest.mark.parametrize("saved_budget, budget", [("model", "bucket"), ("bucket", "model")])
def test_a_state_of_another_budget_is_refused_naming_budget_and_both_values(saved_budget, budget):
    saved = _bound_state(budget=saved_budget).state_dict()
    with pytest.raises(ValueError, match=re.escape(f"'budget': ({saved_budget!r}, {budget!r})")):
        _bound_state(budget=budget).load_state_dict(saved)


def _unequal_shares(rank, world_size):
    """Every rank loads the state it saved after the warm-up, but the last rank's shares x3:
    its buckets would send payloads of other sizes."""
    import sparsecomm

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(24, 32, bias=False), nn.Tanh(), nn.Linear(32, 8)), bucket_cap_mb=1e-6)
    state = sparsecomm.register_topk_hook(ddp, density=0.05, budget="model", allow_dense_fallback=False)
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(rank))
    errors = [backward_error(ddp, x) for _ in range(state.config.warmup_steps + 2)]
    saved = state.state_dict()
    shares = dict(saved["budget_shares"])
    if rank == world_size - 1:
        saved["budget_shares"] = {name: 3 * share for name, share in shares.items()}
    state.load_state_dict(saved)
    return errors, shares, backward_error(ddp, x)


def test_shares_that_differ_between_ranks_are_refused_on_every_rank_at_the_next_step():
    results = run_on_ranks(_unequal_shares, world_size=2, timeout=60)
    for rank, (errors, shares, message) in enumerate(results):
        assert errors == [""] * len(errors) and shares == results[0][1] and len(shares) == 3  # agreed while training
        found = re.search(r"budget_shares \(rank 0: 'budget shares #([0-9a-f]{8})', "
                          r"rank 1: 'budget shares #([0-9a-f]{8})'\)", message)
        assert found and found.group(1) != found.group(2), f"rank {rank}: {message!r}"
