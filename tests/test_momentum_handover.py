"""The integrations' default: the hook's momentum correction takes over the optimizer's momentum.

No framework and no process group: the optimizers are checked through their own
``param_groups`` (what torch's step reads), against the values the test wrote when it
built them, and through a real ``optimizer.step()`` where behaviour matters.
"""
import pytest
import torch

from sparsecomm.hooks.momentum_handover import MOVED_KEY, plan_handover


def _params():
    torch.manual_seed(0)
    return list(torch.nn.Linear(4, 3).parameters())


def _groups(optimizer):
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def test_adamw_gives_its_first_moment_to_the_hook_and_says_so():
    optimizer = torch.optim.AdamW(_params(), lr=1e-3)  # torch's default betas (0.9, 0.999)
    handover = plan_handover("Owner", [optimizer], {"density": 0.01})
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)  # planning changes nothing
    assert handover.hook_options({"density": 0.01}) == {"density": 0.01, "momentum": 0.9, "nesterov": False}
    message = handover.apply()
    assert optimizer.param_groups[0]["betas"] == (0.0, 0.999)
    assert message.startswith("AdamW betas (0.9, 0.999) -> (0.0, 0.999): the hook's momentum correction "
                              "(momentum=0.9) replaces AdamW's first moment")
    assert "momentum=0" in message  # how to keep the optimizer as it is


def test_sgd_gives_momentum_and_nesterov_and_an_adam_group_its_own_beta1():
    sgd = torch.optim.SGD(_params(), lr=0.1, momentum=0.8, nesterov=True)
    handover = plan_handover("Owner", [sgd], {})
    assert (handover.momentum, handover.nesterov) == (0.8, True)
    assert handover.apply().startswith("SGD momentum 0.8 -> 0.0, nesterov True -> False: the hook's momentum "
                                       "correction (momentum=0.8, nesterov=True) replaces SGD's momentum")
    assert (sgd.param_groups[0]["momentum"], sgd.param_groups[0]["nesterov"]) == (0.0, False)
    adam = torch.optim.Adam(_params(), lr=1e-3, betas=(0.5, 0.99))
    assert plan_handover("Owner", [adam], {}).momentum == 0.5


def test_adamw_with_its_first_moment_off_steps_as_the_dgc_optimizer():
    # The changed optimizer is the one the topk-dgc arm builds (sparsecomm.dgc_optimizer):
    # the same update, bit for bit, on the same gradients.
    import sparsecomm

    changed_params, reference_params = _params(), _params()
    changed = torch.optim.AdamW(changed_params, lr=1e-2)
    plan_handover("Owner", [changed], {}).apply()
    reference = sparsecomm.dgc_optimizer(reference_params, "adamw", lr=1e-2, weight_decay=0.01)  # AdamW's default
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(changed_params, reference_params):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        changed.step()
        reference.step()
    assert all(torch.equal(p, q) for p, q in zip(changed_params, reference_params))


def test_a_resumed_optimizer_keeps_the_momentum_it_gave_up():
    # A checkpoint stores the optimizer already changed (betas[0] = 0); resuming must give the
    # hook the same momentum, or the hook state saved with momentum 0.9 would not load.
    optimizer = torch.optim.AdamW(_params(), lr=1e-3)
    plan_handover("Owner", [optimizer], {}).apply()
    resumed = torch.optim.AdamW(_params(), lr=1e-3)
    resumed.load_state_dict(optimizer.state_dict())
    assert resumed.param_groups[0]["betas"] == (0.0, 0.999)
    handover = plan_handover("Owner", [resumed], {})
    assert handover.momentum == 0.9
    assert handover.apply().startswith("AdamW betas (0.9, 0.999) -> (0.0, 0.999)")
    assert resumed.param_groups[0]["betas"] == (0.0, 0.999)
    assert resumed.param_groups[0][MOVED_KEY] == {"momentum": 0.9, "nesterov": False}


def test_explicit_momentum_replaces_the_optimizers_and_zero_leaves_it_alone():
    optimizer = torch.optim.AdamW(_params(), lr=1e-3)
    handover = plan_handover("Owner", [optimizer], {"momentum": 0.5})
    assert handover.momentum == 0.5 and "(momentum=0.5)" in handover.apply()
    assert optimizer.param_groups[0]["betas"] == (0.0, 0.999)
    untouched = torch.optim.AdamW(_params(), lr=1e-3)
    before = _groups(untouched)
    handover = plan_handover("Owner", [untouched], {"momentum": 0})
    assert handover.momentum == 0.0 and handover.apply() is None and _groups(untouched) == before
    # No error feedback: momentum correction is impossible, so "auto" leaves the optimizer alone.
    handover = plan_handover("Owner", [untouched], {"error_feedback": False})
    assert handover.momentum == 0.0 and handover.apply() is None and _groups(untouched) == before


def test_an_optimizer_without_momentum_changes_nothing():
    optimizer = torch.optim.SGD(_params(), lr=0.1)
    before = _groups(optimizer)
    handover = plan_handover("Owner", [optimizer], {})
    assert handover.momentum == 0.0 and handover.apply() is None and _groups(optimizer) == before


@pytest.mark.parametrize("make, options, match", [
    (lambda p: torch.optim.RMSprop(p, lr=1e-3), {}, "cannot move the momentum of RMSprop .* torch.optim.SGD, "
                                                    "Adam, AdamW and transformers' Adafactor only"),
    (lambda p: torch.optim.Adagrad(p, lr=1e-3), {"momentum": 0.9}, "cannot move the momentum of Adagrad"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), {}, "dampening=0.1"),
    (lambda p: torch.optim.SGD([{"params": p[:1], "momentum": 0.9}, {"params": p[1:], "momentum": 0.5}], lr=0.1),
     {}, r"param groups differ \(SGD group 0: momentum 0.9, nesterov False, SGD group 1: momentum 0.5"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), {"momentum": "yes"}, "momentum must be 'auto' .* got 'yes'"),
])
def test_what_cannot_be_adapted_is_refused_before_anything_changes(make, options, match):
    optimizer = make(_params())
    before = _groups(optimizer)
    with pytest.raises(ValueError, match=match):
        plan_handover("Owner", [optimizer], options)
    assert _groups(optimizer) == before


def test_auto_without_an_optimizer_is_refused_and_a_bad_number_named():
    with pytest.raises(ValueError, match="momentum='auto' takes the optimizer's momentum .* there is no optimizer"):
        plan_handover("Owner", [], {})
    with pytest.raises(ValueError, match=r"momentum must be in \[0.0, 1.0\), got 1.0"):
        plan_handover("Owner", [torch.optim.SGD(_params(), lr=0.1)], {"momentum": 1.0})


def test_adafactor_gives_its_beta1():
    transformers = pytest.importorskip("transformers")
    optimizer = transformers.optimization.Adafactor(_params(), lr=1e-3, beta1=0.9, relative_step=False,
                                                    scale_parameter=False, warmup_init=False)
    handover = plan_handover("Owner", [optimizer], {})
    assert handover.momentum == 0.9
    assert handover.apply().startswith("Adafactor beta1 0.9 -> None")
    assert optimizer.param_groups[0]["beta1"] is None
