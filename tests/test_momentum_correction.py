"""DGC momentum correction in the hook against a pure-torch reference of DGC's update.

Reference (Lin et al., ICLR 2018; synxlin/deep-gradient-compression dgc/memory.py), per
rank, g = local gradient / world_size:
    plain:     u = m u + g;        v = v + u
    Nesterov:  u = m (u + g);      v = v + u + g
    send top-k of v; zero v and u at the sent coordinates (momentum factor masking).
During the dense warm-up the accumulated value is allreduced and nothing is masked.
"""
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sparsecomm
from sparsecomm.ops import reference
from rank_processes import run_on_ranks

pytestmark = pytest.mark.timeout(120)


def _dgc_reference_steps(grads, world_size, momentum, nesterov, k, warmup, clip_norm, decode=None):
    """(expected reduced gradient per step, final velocity, selected entries sent as 0) for
    this rank's grads (needs the process group). ``decode``: what a value codec makes of the
    selected values (None: sent as they are); the velocity starts over where a non-zero value
    went out."""
    u = torch.zeros_like(grads[0])
    v = torch.zeros_like(grads[0])
    expected, sent_as_zero = [], 0
    for step, grad in enumerate(grads):
        g = grad / world_size
        if clip_norm is not None:  # DGC local clipping: norm of the local gradient <= c / sqrt(N)
            limit = clip_norm / math.sqrt(world_size) / world_size
            norm = float(torch.linalg.vector_norm(g.float()))
            if norm > limit:
                g = g * (limit / norm)
        if nesterov:
            u = (u + g) * momentum
            acc = (u + g) + v  # the hook's order of the two float additions (DGC adds v + u first)
        else:
            u = momentum * u + g
            acc = v + u
        if step < warmup:
            sent, v = acc.clone(), torch.zeros_like(acc)
        else:
            selected = torch.sort(reference.topk_by_key(reference.magnitude_key(acc), k)).values
            sent = torch.zeros_like(acc)
            sent[selected] = acc[selected] if decode is None else decode(acc[selected])
            v = acc - sent
            sent_as_zero += int((sent[selected] == 0).sum())
            u[selected[sent[selected] != 0]] = 0
        gathered = [torch.empty_like(sent) for _ in range(world_size)]
        dist.all_gather(gathered, sent)
        expected.append(gathered[0] + gathered[1])
    return expected, u, sent_as_zero


def _worker(rank, world_size, nesterov, clip_norm):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 8, bias=False))  # one parameter, one bucket
    k = 6
    state = sparsecomm.register_topk_hook(model, density=k / 128, momentum=0.9, nesterov=nesterov,
                                          local_clip_norm=clip_norm, allow_dense_fallback=False)
    generator = torch.Generator().manual_seed(10 + rank)  # different data on every rank
    grads, reduced = [], []
    for _ in range(6):
        model.zero_grad()
        x = torch.randn(4, 16, generator=generator)
        # The local gradient, computed without communication, for the reference:
        local = torch.autograd.grad(model.module(x).pow(2).sum(), model.module.weight)[0].flatten()
        grads.append(local)
        model(x).pow(2).sum().backward()
        reduced.append(model.module.weight.grad.flatten().clone())
    expected, expected_velocity, _ = _dgc_reference_steps(grads, world_size, 0.9, nesterov, k, state.warmup_steps,
                                                          clip_norm)
    clipped = clip_norm is not None and any(
        float(torch.linalg.vector_norm(g / world_size)) > clip_norm / math.sqrt(world_size) / world_size for g in grads)
    velocity = state.state_dict()[f"rank{rank}.velocity.weight"]
    return ([torch.equal(a, b) for a, b in zip(reduced, expected)], velocity, torch.equal(velocity, expected_velocity),
            clipped)


@pytest.mark.parametrize("nesterov, clip_norm", [(False, None), (True, None), (False, 2.0)],
                         ids=["momentum", "nesterov", "momentum-local-clipping"])
def test_hook_matches_dgc_reference_exactly(nesterov, clip_norm):
    for matches, velocity, velocity_equal, clipped in run_on_ranks(_worker, nesterov, clip_norm):
        assert matches == [True] * 6
        assert velocity_equal
        assert clipped == (clip_norm is not None)  # the clipping case really clips
        # Masking: after sparse steps, the velocity is zero exactly where values were sent.
        assert int((velocity == 0).sum()) >= 6


def test_dgc_optimizer_has_no_momentum_of_its_own():
    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = sparsecomm.dgc_optimizer(params, "sgd", lr=0.1)
    adamw = sparsecomm.dgc_optimizer(params, "adamw", lr=1e-3, weight_decay=0.1)
    assert sgd.param_groups[0]["momentum"] == 0.0
    assert adamw.param_groups[0]["betas"] == (0.0, 0.999) and isinstance(adamw, torch.optim.AdamW)
    with pytest.raises(ValueError, match="kind must be one of"):
        sparsecomm.dgc_optimizer(params, "lamb", lr=0.1)
    with pytest.raises(ValueError, match=r"lr must be in \(0.0, inf\)"):
        sparsecomm.dgc_optimizer(params, "sgd", lr=0.0)


def test_optimizer_with_its_own_momentum_is_warned_about():
    params = [torch.nn.Parameter(torch.zeros(3))]
    state = sparsecomm.TopKState(density=0.01, momentum=0.9)
    with pytest.warns(sparsecomm.MomentumMismatchWarning, match="momentum is applied twice"):
        assert state.check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    with pytest.warns(sparsecomm.MomentumMismatchWarning, match="group 0: 0.9"):
        assert state.check_optimizer(torch.optim.AdamW(params, lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not state.check_optimizer(sparsecomm.dgc_optimizer(params, "adamw", lr=1e-3))
        assert not sparsecomm.TopKState(density=0.01).check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))


def test_nesterov_needs_momentum():
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        sparsecomm.TopKState(density=0.01, nesterov=True)
    with pytest.raises(TypeError, match="nesterov must be True or False"):
        sparsecomm.TopKState(density=0.01, momentum=0.9, nesterov=1)


def test_local_clip_norm_must_be_positive():
    with pytest.raises(ValueError, match=r"local_clip_norm must be in \(0.0, inf\), got 0.0"):
        sparsecomm.TopKState(density=0.01, momentum=0.9, local_clip_norm=0)


def test_sign_sgd_moves_each_weight_by_lr_in_the_sign_of_its_gradient():
    from sparsecomm.optim.sign_sgd import SignSGD

    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    weight.grad = torch.tensor([0.3, -1e-8, 0.0, -40.0])  # sizes do not matter, signs do; 0 stays
    SignSGD([weight], lr=0.1, weight_decay=0.5).step()
    decayed = torch.tensor([1.0, -2.0, 3.0, 0.5]) * (1 - 0.1 * 0.5)
    assert torch.equal(weight.detach(), decayed - 0.1 * torch.tensor([1.0, -1.0, 0.0, -1.0]))
    with pytest.raises(ValueError, match="lr"):
        SignSGD([weight], lr=0.0)


def _bf16_at_least(x: float) -> float:
    """The smallest bfloat16 (8 significant bits) >= x > 0, from the number's binary exponent."""
    exponent = math.frexp(x)[1]  # x = f * 2**exponent, 0.5 <= f < 1
    ulp = 2.0 ** (exponent - 8)
    return math.ceil(x / ulp) * ulp


def _int2_decoded(selected_values: torch.Tensor) -> torch.Tensor:
    """int2 of one group of selected values, worked from its definition: scale s = the
    smallest bfloat16 >= (largest magnitude) / 2, each value sent as the nearest of -s, 0, s."""
    s = _bf16_at_least(float(selected_values.abs().max()) / 2)
    return torch.round(selected_values.double() / s).clamp(-1, 1).mul(s).float()


def _quantized_dgc_worker(rank, world_size):
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 8, bias=False))  # one parameter of 128 entries, one bucket
    k = 64  # one scale group (64 selected entries) per payload
    state = sparsecomm.register_topk_hook(model, density=k / 128, momentum=0.9, index_codec="rice",
                                          value_codec="int2", allow_dense_fallback=False)
    generator = torch.Generator().manual_seed(20 + rank)
    grads, reduced = [], []
    for _ in range(6):
        model.zero_grad()
        x = torch.randn(4, 16, generator=generator) * torch.logspace(-2, 1, 16)  # magnitudes spread widely
        grads.append(torch.autograd.grad(model.module(x).pow(2).sum(), model.module.weight)[0].flatten())
        model(x).pow(2).sum().backward()
        reduced.append(model.module.weight.grad.flatten().clone())
    expected, velocity, sent_as_zero = _dgc_reference_steps(grads, world_size, 0.9, False, k, state.warmup_steps,
                                                            None, decode=_int2_decoded)
    matches = [torch.equal(a, b) for a, b in zip(reduced, expected)]
    return matches, torch.equal(state.state_dict()[f"rank{rank}.velocity.weight"], velocity), sent_as_zero


def test_momentum_masking_keeps_the_velocity_of_entries_a_codec_sent_as_zero():
    """int2 decodes selected entries under a quarter of their group's largest to 0: nothing
    of them went out, so their velocity must carry on (only what was sent starts over)."""
    for matches, velocity_equal, sent_as_zero in run_on_ranks(_quantized_dgc_worker):
        assert matches == [True] * 6
        assert velocity_equal
        assert sent_as_zero > 0  # the case is exercised: some selected entries were sent as 0
