"""sparsecomm.optim.AdamS against an oracle worked from the paper's equations in plain float64
Python, its decoupled weight decay, first step, argument checks, state_dict resume, bfloat16,
a contrast with AdamW; and the lab's ``adams`` arm optimizer."""
import copy
import dataclasses
import io
import math

import pytest
import torch

import sparsecomm
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.named import digits_quick, pydoc_gpt
from sparsecomm.lab.experiment.worker import make_optimizer
from sparsecomm.optim import AdamS

LR, BETA1, BETA2, EPS, WD = 0.01, 0.9, 0.99, 1e-8, 0.1
P0 = [1.0, -0.5, 0.25]
# Three steps of gradients, each element's of one sign, opposite to its parameter's: then the
# momentum sums same-signed terms and the parameter moves away from zero, so no subtraction
# cancels (what keeps the float32 bound below a plain count of roundings).
GRADS = [[-0.5, 0.25, -2.0], [-0.25, 0.5, -1.0], [-1.0, 0.125, -0.5]]
# Every input above is a dyadic fraction: exact in float32 and bfloat16.

# The oracle's numbers (after steps 1, 2, 3), kept written out so that a change of the oracle
# itself shows. Step 1 by hand, bias-corrected: c = 1 - 0.9 = 0.1, m_0 = 0, so
# v = 0.01 g^2, sqrt(v) = 0.1 |g|, m_1 = 0.1 g, m_1 / c = g, and each element moves by
# lr * g / (0.1 |g| + eps) = 0.1 sign(g) (1 - 1e-7 / |g|) after decaying by 1 - lr wd = 0.999:
# element 0: 0.999 * 1.0 + 0.1 * (1 - 2e-7) = 1.09899998.
EXPECTED = {
    True: [([1.0989999800000039, -0.5994999600000159, 0.3497499950000002], [-0.05, 0.025, -0.2]),
           ([1.1119078094823245, -0.6261284046214785, 0.36340707486671014], [-0.07, 0.0725, -0.28]),
           ([1.1326061223357746, -0.6362685756006101, 0.3738709199109458], [-0.163, 0.07775, -0.302])],
    # Without bias correction step 1 moves by lr * 0.1 g / (0.1 |g| + eps) = 0.01 sign(g) (...).
    False: [([1.0089999980000004, -0.5094999960000016, 0.2597499995], [-0.05, 0.025, -0.2]),
            ([1.0205633668858105, -0.5219726766293922, 0.27206262007785814], [-0.07, 0.0725, -0.28]),
            ([1.0329182940954362, -0.5320706051327916, 0.28246013683349086], [-0.163, 0.07775, -0.302])],
}

U32 = 2.0 ** -24  # float32 unit roundoff
# The float32 bound. Per element and step the class rounds about a dozen times in a chain of
# products, quotients, one square root and sums of same-signed terms (m / c, its square, the
# two weighted terms and their sum, the root, + eps, the momentum's two terms and sum, the
# weight decay, the quotient times lr / c, the final sum; and the scalars beta1, beta2, lr / c,
# 1 - lr wd rounded to float32 once each). Without cancellation each rounding adds at most U32
# to the relative error (the root halves what it receives), so one step adds <= ~16 U32 and
# three steps <= ~48 U32 relative, to first order. 64 U32 (3.8e-6) leaves room for the
# second-order terms; the rules this must tell apart differ by 1e-3 or more (tested below).
RTOL32 = 64 * U32
RTOL64 = 64 * 2.0 ** -53  # the same count in float64


def oracle(p, grads, *, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, bias_correction=True,
           normalizer_from_new_m=False):
    """The paper's equations, element by element in float64 Python: [(params, momentum)] per step.

    v_t = beta2 (m_{t-1}/c_t)^2 + (1 - beta2) g_t^2, m_t = beta1 m_{t-1} + (1 - beta1) g_t,
    p_t = (1 - lr wd) p_{t-1} - lr (m_t/c_t) / (sqrt(v_t) + eps), c_t = 1 - beta1^t (or 1).
    ``normalizer_from_new_m``: the wrong order (v from m_t), to show the test tells them apart.
    """
    p, m, out = list(p), [0.0] * len(p), []
    for t, g in enumerate(grads, start=1):
        c = 1.0 - beta1 ** t if bias_correction else 1.0
        for i in range(len(p)):
            m_new = beta1 * m[i] + (1.0 - beta1) * g[i]
            source = m_new if normalizer_from_new_m else m[i]
            v = beta2 * (source / c) ** 2 + (1.0 - beta2) * g[i] ** 2
            p[i] = (1.0 - lr * weight_decay) * p[i] - lr * (m_new / c) / (math.sqrt(v) + eps)
            m[i] = m_new
        out.append((list(p), list(m)))
    return out


def run_class(dtype, grads=GRADS, bias_correction=True, **kwargs):
    param = torch.nn.Parameter(torch.tensor(P0, dtype=dtype))
    optimizer = AdamS([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD,
                      bias_correction=bias_correction, **kwargs)
    out = []
    for g in grads:
        param.grad = torch.tensor(g, dtype=dtype)
        optimizer.step()
        out.append((param.detach().clone(), optimizer.state[param]["exp_avg"].clone()))
    return out, optimizer, param


def _close(actual: torch.Tensor, expected: list, rtol: float) -> float:
    """Largest |actual - expected| / |expected| (every expected value is far from 0 here)."""
    errors = [abs(a - e) / abs(e) for a, e in zip(actual.double().tolist(), expected)]
    assert max(errors) <= rtol, (actual.tolist(), expected, errors, rtol)
    return max(errors)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_the_oracle_reproduces_its_written_out_numbers(bias_correction):
    for (p, m), (p_expected, m_expected) in zip(oracle(P0, GRADS, bias_correction=bias_correction),
                                                EXPECTED[bias_correction]):
        assert p == pytest.approx(p_expected, rel=1e-15, abs=0)
        assert m == pytest.approx(m_expected, rel=1e-15, abs=0)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, RTOL64), (torch.float32, RTOL32)])
def test_three_steps_match_the_oracle_at_the_dtypes_rounding(dtype, rtol, bias_correction):
    steps, _, _ = run_class(dtype, bias_correction=bias_correction)
    for (p, m), (p_expected, m_expected) in zip(steps, oracle(P0, GRADS, bias_correction=bias_correction)):
        _close(p, p_expected, rtol)
        _close(m, m_expected, rtol)


def test_the_normalizer_uses_the_previous_momentum_and_the_correction_matters():
    steps, _, _ = run_class(torch.float32)
    final = steps[-1][0].double()
    for other in (oracle(P0, GRADS, normalizer_from_new_m=True), oracle(P0, GRADS, bias_correction=False)):
        # The other rules land >= 1e-3 relative away: far outside the float32 bound.
        differences = [abs(a - e) / abs(e) for a, e in zip(final.tolist(), other[-1][0])]
        assert min(differences) > 1e-3 > 100 * RTOL32, differences


def test_the_first_step_starts_from_zero_momentum():
    (p1, m1), *_ = run_class(torch.float32, grads=GRADS[:1])[0]
    g = torch.tensor(GRADS[0])
    assert torch.equal(m1, g * (1 - BETA1))  # m_1 = (1 - beta1) g: m_0 = 0
    # m_0 = 0 leaves only the gradient in the normalizer: sqrt((1 - beta2) g^2) = sqrt(1 - beta2) |g|,
    # and m_1 / c_1 = g, so the step is lr g / (sqrt(1 - beta2) |g| + eps) ~ 10 lr sign(g) here.
    expected = [(1 - LR * WD) * p - LR * gi / (math.sqrt(1 - BETA2) * abs(gi) + EPS) for p, gi in zip(P0, GRADS[0])]
    _close(p1, expected, 16 * U32)
    _, optimizer, param = run_class(torch.float32, grads=GRADS[:1])
    assert set(optimizer.state[param]) == {"step", "exp_avg"} and optimizer.state[param]["step"].item() == 1.0


def test_weight_decay_is_decoupled():
    # A zero gradient keeps m = 0, so the step is 0 / (0 + eps) = 0: only p * (1 - lr wd) acts.
    param = torch.nn.Parameter(torch.tensor([3.0, -1.5, 0.7, 1e-3]))
    start = param.detach().clone()
    optimizer = AdamS([param], lr=0.05, weight_decay=0.2)
    param.grad = torch.zeros(4)
    optimizer.step()
    assert torch.equal(param.detach(), start * (1 - 0.05 * 0.2))
    # With a gradient, the decay does not pass through the normalizer (as L2 through the
    # gradient would): with and without it the two runs differ by lr wd p_0 alone.
    with_decay, without = [torch.nn.Parameter(torch.tensor(P0)) for _ in range(2)]
    for param, weight_decay in ((with_decay, WD), (without, 0.0)):
        optimizer = AdamS([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=weight_decay)
        param.grad = torch.tensor(GRADS[0])
        optimizer.step()
    torch.testing.assert_close(without - with_decay, LR * WD * torch.tensor(P0), rtol=0, atol=4 * U32)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"lr": -1e-3}, ValueError, r"lr must be in \[0.0, inf\), got -0.001"),
    ({"lr": "0.1"}, TypeError, r"lr must be a real number"),
    ({"betas": (1.0, 0.999)}, ValueError, r"betas\[0\] must be in \[0.0, 1.0\), got 1.0"),
    ({"betas": (0.9, -0.1)}, ValueError, r"betas\[1\] must be in \[0.0, 1.0\), got -0.1"),
    ({"betas": 0.9}, TypeError, r"betas must be a pair \(beta1, beta2\)"),
    ({"betas": (0.9, 0.99, 0.5)}, TypeError, r"betas must be a pair"),
    ({"eps": -1e-8}, ValueError, r"eps must be in \[0.0, inf\)"),
    ({"eps": float("nan")}, ValueError, r"eps must be in \[0.0, inf\), got nan"),
    ({"weight_decay": -0.01}, ValueError, r"weight_decay must be in \[0.0, inf\), got -0.01"),
    ({"bias_correction": 1}, TypeError, r"bias_correction must be True or False"),
])
def test_bad_arguments_are_refused_naming_the_argument_and_its_range(kwargs, error, message):
    with pytest.raises(error, match=message):
        AdamS([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_defaults_are_adamws():
    optimizer = AdamS([torch.nn.Parameter(torch.zeros(2))])
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]).defaults
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert optimizer.defaults[key] == reference[key], key


def test_sparse_gradients_are_refused_and_missing_gradients_skipped():
    embedding = torch.nn.Embedding(5, 2, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    with pytest.raises(RuntimeError, match="AdamS does not support sparse gradients"):
        AdamS(embedding.parameters()).step()
    used, unused = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = AdamS([used, unused])
    used.grad = torch.ones(2)
    optimizer.step()
    assert torch.equal(unused.detach(), torch.ones(2)) and unused not in optimizer.state
    assert optimizer.state[used]["step"].item() == 1.0


def _model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    batches = [(torch.randn(6, 4), torch.randn(6, 1)) for _ in range(4)]
    return model, batches


def _train(model, optimizer, batches):
    for inputs, targets in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def test_a_state_dict_round_trip_resumes_bit_for_bit():
    model, batches = _model_and_batches()
    straight = copy.deepcopy(model)
    _train(straight, AdamS(straight.parameters(), lr=0.01, weight_decay=0.05), batches)

    # Another runs 2 steps and saves its weights and optimizer state (through bytes, as to a file).
    first = copy.deepcopy(model)
    first_optimizer = AdamS(first.parameters(), lr=0.01, weight_decay=0.05)
    _train(first, first_optimizer, batches[:2])
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()}, saved)
    saved.seek(0)

    resumed = copy.deepcopy(model)  # fresh weights, overwritten by the checkpoint's
    loaded = torch.load(saved)
    resumed.load_state_dict(loaded["model"])
    optimizer = AdamS(resumed.parameters(), lr=0.01, weight_decay=0.05)
    optimizer.load_state_dict(loaded["optimizer"])
    assert all(s["step"].item() == 2.0 for s in optimizer.state.values())
    _train(resumed, optimizer, batches[2:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    # The state is what makes it so: the same weights with a fresh optimizer land elsewhere.
    restarted = copy.deepcopy(model)
    restarted.load_state_dict(loaded["model"])
    _train(restarted, AdamS(restarted.parameters(), lr=0.01, weight_decay=0.05), batches[2:])
    assert not all(torch.equal(a, b) for a, b in zip(straight.parameters(), restarted.parameters()))


def test_it_is_not_adamw():
    model, batches = _model_and_batches()
    adams, adamw = copy.deepcopy(model), copy.deepcopy(model)
    _train(adams, AdamS(adams.parameters(), lr=1e-3), batches[:3])
    adamw_optimizer = torch.optim.AdamW(adamw.parameters(), lr=1e-3)
    _train(adamw, adamw_optimizer, batches[:3])
    start = list(model.parameters())
    for s, a, w in zip(start, adams.parameters(), adamw.parameters()):
        # Both moved; AdamS's first step alone is 31.6 lr per element (1 / sqrt(1 - 0.999)),
        # AdamW's is lr: their moves differ by far more than rounding.
        assert (a - s).abs().max() > 10 * (w - s).abs().max() > 0
    assert "exp_avg_sq" in adamw_optimizer.state[next(adamw.parameters())]


def test_bfloat16_parameters_compute_in_float32_and_keep_a_bfloat16_momentum():
    steps16, optimizer, param = run_class(torch.bfloat16)
    assert param.dtype == torch.bfloat16 and optimizer.state[param]["exp_avg"].dtype == torch.bfloat16
    steps32, _, _ = run_class(torch.float32)
    # Step 1: same inputs (all exact in bfloat16), the float32 arithmetic rounded once.
    assert torch.equal(steps16[0][0], steps32[0][0].to(torch.bfloat16))
    assert torch.equal(steps16[0][1], steps32[0][1].to(torch.bfloat16))
    # Later steps start from bfloat16-rounded values (8 significant bits: 2^-8 relative per
    # rounding, a few per step): within 2^-5 of the oracle after three steps.
    for (p, m), (p_expected, m_expected) in zip(steps16, oracle(P0, GRADS)):
        _close(p, p_expected, 2.0 ** -5)
        _close(m, m_expected, 2.0 ** -5)


def test_it_is_exported_from_the_package():
    assert sparsecomm.AdamS is AdamS and "AdamS" in sparsecomm.__all__


# ---- the lab: an arm (or an experiment) may choose "adams" ----


def test_an_arm_with_adams_validates_and_builds_adams_with_its_lr_and_weight_decay():
    definitions = {"a": {"reducer": "allreduce", "optimizer": {"optimizer": "adams", "lr": 0.002,
                                                               "weight_decay": 0.05}},
                   "t": {"reducer": "topk", "options": {"density": 0.1}, "optimizer": {"optimizer": "adams"}}}
    config = dataclasses.replace(digits_quick(), arms=("dense", "a", "t"), arm_definitions=definitions)
    optimizer = make_optimizer(config, torch.nn.Linear(3, 2).parameters(), "a")
    assert type(optimizer) is AdamS
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (0.002, 0.05, (0.9, 0.999), 1e-8)
    assert "adams lr=0.002 weight_decay=0.05" in config.arm("a").describe()
    assert type(make_optimizer(config, torch.nn.Linear(3, 2).parameters(), "t")) is AdamS  # topk, no correction
    # The dense arm keeps the experiment's optimizer; an experiment may choose adams for all.
    assert type(make_optimizer(config, torch.nn.Linear(3, 2).parameters(), "dense")) is torch.optim.SGD
    everywhere = dataclasses.replace(digits_quick(), optimizer="adams")
    assert type(make_optimizer(everywhere, torch.nn.Linear(3, 2).parameters(), "topk-ef")) is AdamS
    assert ExperimentConfig.from_dict(everywhere.to_dict()).arm("dense").optimizer["optimizer"] == "adams"


def test_adams_under_the_hooks_momentum_correction_is_refused_naming_the_option():
    definition = {"reducer": "topk", "options": {"momentum": 0.9}, "optimizer": {"optimizer": "adams"}}
    with pytest.raises(ValueError, match=r"arm 'm': optimizer 'adams' cannot run under the hook's momentum "
                                         r"correction \(option momentum=0.9\).*set the arm's option momentum to 0"):
        dataclasses.replace(digits_quick(), arms=("dense", "m"), arm_definitions={"m": definition})
    # The experiment's optimizer reaches the topk-dgc preset, whose hook corrects momentum.
    with pytest.raises(ValueError, match=r"arm 'topk-dgc': optimizer 'adams' cannot run under the hook's momentum"):
        dataclasses.replace(pydoc_gpt(), optimizer="adams")
    # An unknown optimizer still names the accepted ones, adams among them.
    with pytest.raises(ValueError, match=r"optimizer must be one of \('adamw', 'sgd', 'adams'\)"):
        dataclasses.replace(digits_quick(), optimizer="lion")
