"""Arms as data: definitions in a config or on --arms, resolved against the experiment,
checked before anything runs, hashed by what they compute; presets keep their run hashes."""
import dataclasses
import json

import pytest
import torch

import sparsecomm

from sparsecomm.lab.experiment import arm_spec
from sparsecomm.lab.experiment.arms import make_arm_hook
from sparsecomm.lab.compare import parse_arms
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.named import digits_quick, pydoc_gpt
from sparsecomm.lab.experiment.worker import make_optimizer

DEFINED = {"t3": {"reducer": "topk", "options": {"density": 0.003, "momentum": 0.9}, "optimizer": {"lr": 0.002}}}


def _config(**overrides) -> ExperimentConfig:
    return dataclasses.replace(digits_quick(), arms=("dense", "topk-ef", "t3"), arm_definitions=DEFINED, **overrides)


def test_presets_keep_the_run_hashes_they_had_before_arms_were_data():
    # Recorded from the release before arm definitions existed, when the default task had 1 MB
    # buckets: finished runs are reused. The top-k presets since run the hook's model-wide
    # budget (its default), which trains otherwise: those are new runs, with hashes of their own.
    before = {"dense": "ac5a400b8a66", "dense-bf16": "d79a69d51767", "powersgd": "db4b1033ce4b",
              "topk-ef": "f3e505d83feb", "topk-noef": "4d774ab3238b", "topk-dgc": "91b06a9cb1d5"}
    config = dataclasses.replace(pydoc_gpt(), bucket_cap_mb=1.0)
    now = {arm: config.run_hash(arm, 1) for arm in before}
    assert {arm: now[arm] for arm in ("dense", "dense-bf16", "powersgd")} == \
        {arm: before[arm] for arm in ("dense", "dense-bf16", "powersgd")}
    assert {arm: now[arm] for arm in ("topk-ef", "topk-noef", "topk-dgc")} == \
        {"topk-ef": "a811378533cc", "topk-noef": "d9dd163c5748", "topk-dgc": "dc1533fad57e"}
    assert config.arm("topk-dgc").options["budget"] == "model"
    assert digits_quick().run_hash("topk-ef", 0) == "c7e6afb0a174"  # was e0d1ad727b89 with the per-bucket budget
    wire = dataclasses.replace(config, selector="chunk", index_codec="rice", value_codec="int4", exchange="owner")
    assert wire.run_hash("topk-dgc", 2) == "a1018a877792" and wire.run_hash("dense", 2) == "7e99735e0893"


def test_a_defined_arm_resolves_with_the_experiments_values_for_what_it_leaves_out():
    spec = _config().arm("t3")
    assert spec.reducer == "topk" and not spec.preset
    assert spec.options["density"] == 0.003 and spec.options["momentum"] == 0.9
    assert spec.options["warmup_steps"] == digits_quick().warmup_steps and spec.options["selector"] == "exact"
    assert spec.optimizer == {"optimizer": "sgd", "lr": 0.002, "momentum": 0.9, "weight_decay": 0.0}
    assert "density=0.003" in spec.describe() and "no momentum of its own" in spec.describe()


def test_the_hash_of_a_defined_arm_follows_its_options_not_the_report_settings():
    config = _config()
    changed = dataclasses.replace(config, arm_definitions={"t3": {**DEFINED["t3"], "options": {"density": 0.004}}})
    assert config.run_hash("t3", 0) != changed.run_hash("t3", 0)
    assert config.run_hash("dense", 0) == changed.run_hash("dense", 0)  # dense is not the defined arm
    renamed = dataclasses.replace(config, name="other", seeds=(0, 5), target_loss=1.0, metric="val_loss")
    assert renamed.run_hash("t3", 0) == config.run_hash("t3", 0)
    # An experiment-level density reaches a defined arm only when the arm leaves density out.
    assert dataclasses.replace(config, density=0.02).run_hash("t3", 0) == config.run_hash("t3", 0)
    loose = dataclasses.replace(config, arm_definitions={"t3": {"reducer": "topk"}})
    assert dataclasses.replace(loose, density=0.02).run_hash("t3", 0) != loose.run_hash("t3", 0)


def test_a_config_file_may_write_arms_inline_and_round_trips():
    raw = {"name": "x", "task": "digits-mlp", "arms": ["dense", {"name": "p4", "reducer": "powersgd",
                                                                 "options": {"rank": 4}}]}
    config = ExperimentConfig.from_dict(raw)
    assert config.arms == ("dense", "p4") and config.arm("p4").options["rank"] == 4
    again = ExperimentConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.run_hash("p4", 3) == config.run_hash("p4", 3)


@pytest.mark.parametrize("definitions, arms, message", [
    ({"t": {"reducer": "nope"}}, ("dense", "t"), r"reducer must be one of \('allreduce'"),
    ({"t": {"reducer": "topk", "options": {"densty": 0.1}}}, ("dense", "t"), r"unknown keys \['densty'\]"),
    ({"t": {"reducer": "topk", "options": {"density": 2.0}}}, ("dense", "t"), r"arm 't': density"),
    ({"t": {"reducer": "topk", "options": {"value_dtype": "int8"}}}, ("dense", "t"), "value_dtype must be None or one"),
    ({"t": {"reducer": "powersgd", "options": {"rank": 0}}}, ("dense", "t"), "rank must be an integer >= 1"),
    ({"t": {"reducer": "allreduce", "optimizer": {"lr": -1}}}, ("dense", "t"), "optimizer lr must be a finite"),
    ({"topk-ef": {"reducer": "topk"}}, ("dense", "topk-ef"), "is a preset arm"),
    ({}, ("dense", "undefined"), "arms must be distinct names of presets"),
    ({"a/b": {"reducer": "topk"}}, ("dense",), "arm name must be"),
])
def test_bad_definitions_are_refused_naming_what_is_wrong(definitions, arms, message):
    with pytest.raises(ValueError, match=message):
        ExperimentConfig(name="x", task="digits-mlp", arms=arms, arm_definitions=definitions)


def test_command_line_arms_parse_into_definitions():
    names, definitions = parse_arms(["dense", "topk-dgc", "c=topk:density=0.003,selector=chunk,value_codec=int4,"
                                     "density_schedule=[[0,0.1],[50,0.003]],opt.lr=0.001,momentum=0.9,nesterov=true"])
    assert names == ("dense", "topk-dgc", "c")
    assert definitions == {"c": {"reducer": "topk", "options": {
        "density": 0.003, "selector": "chunk", "value_codec": "int4", "density_schedule": [[0, 0.1], [50, 0.003]],
        "momentum": 0.9, "nesterov": True}, "optimizer": {"lr": 0.001}}}
    config = dataclasses.replace(digits_quick(), arms=names, arm_definitions=definitions)
    assert config.arm("c").options["density_schedule"] == [[0, 0.1], [50, 0.003]]
    with pytest.raises(ValueError, match="settings are key=value"):
        arm_spec.parse_cli_arm("c=topk:density")


def test_defined_arms_build_the_hook_and_optimizer_they_describe():
    definitions = {
        "chunky": {"reducer": "topk", "options": {"selector": "chunk", "index_codec": "rice", "value_codec": "int4",
                                                  "density": 0.02, "residual_dtype": "bfloat16"}},
        "p3": {"reducer": "powersgd", "options": {"rank": 3}},
        "half": {"reducer": "fp16"},
        "floor": {"reducer": "local"},
        "t3": DEFINED["t3"],
    }
    config = dataclasses.replace(pydoc_gpt(), arms=("dense", *definitions), arm_definitions=definitions)
    model = torch.nn.Linear(8, 4)
    chunky = make_arm_hook("chunky", config, model, seed=7).state
    assert (chunky.selector, chunky.index_codec, chunky.value_codec, chunky.density) == ("chunk", "rice", "int4", 0.02)
    assert chunky.config.residual_dtype == torch.bfloat16 and chunky.config.seed == 7
    assert make_arm_hook("p3", config, model, seed=0).state.matrix_approximation_rank == 3
    assert "fp16_compress_hook" in make_arm_hook("half", config, model, seed=0).description
    floor = make_arm_hook("floor", config, model, seed=0)
    assert "nothing sent" in floor.description and floor.hook.__name__ == "local_gradient_hook"
    t3 = make_arm_hook("t3", config, model, seed=0)
    assert t3.state.momentum == 0.9 and t3.state.density == 0.003
    optimizer = make_optimizer(config, model.parameters(), "t3")  # adamw, momentum corrected in the hook
    assert optimizer.param_groups[0]["betas"] == (0.0, 0.999) and optimizer.param_groups[0]["lr"] == 0.002
    assert not t3.state.check_optimizer(optimizer)


def _script_config(tmp_path, definitions) -> ExperimentConfig:
    script = tmp_path / "train.py"
    script.write_text("print('a script')\n")
    return ExperimentConfig(name="s", script=str(script), arms=("dense", *definitions), arm_definitions=definitions)


def test_a_scripts_arm_changes_the_scripts_own_optimizer_in_place(tmp_path):
    from sparsecomm.lab.experiment.script_run import adapt_optimizer

    config = _script_config(tmp_path, {"dgc": {"reducer": "topk", "options": {"momentum": 0.9},
                                               "optimizer": {"lr": 0.5, "weight_decay": 0.01}},
                                       "plain": {"reducer": "topk"}})
    assert config.arm("dgc").optimizer == {"lr": 0.5, "weight_decay": 0.01}  # only what the arm changes
    assert "the script's optimizer lr=0.5" in config.arm("dgc").describe()
    model = torch.nn.Linear(3, 2)
    adam, sgd = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.8)
    adapt_optimizer(adam, config.arm("dgc"))
    adapt_optimizer(sgd, config.arm("dgc"))
    assert adam.param_groups[0]["betas"] == (0.0, 0.999) and adam.param_groups[0]["lr"] == 0.5
    assert sgd.param_groups[0]["momentum"] == 0.0 and sgd.param_groups[0]["weight_decay"] == 0.01
    untouched = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.8)
    adapt_optimizer(untouched, config.arm("plain"))
    assert untouched.param_groups[0]["momentum"] == 0.8 and untouched.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match="Rprop has neither betas nor momentum"):
        adapt_optimizer(torch.optim.Rprop(model.parameters()), config.arm("dgc"))
    adams = sparsecomm.AdamS(model.parameters())
    with pytest.raises(ValueError, match="AdamS builds its normalizer from its momentum"):
        adapt_optimizer(adams, config.arm("dgc"))
    assert adams.param_groups[0]["betas"] == (0.9, 0.999)  # refused before anything changed
    stepped = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    stepped.step()
    with pytest.raises(RuntimeError, match="already stepped"):
        adapt_optimizer(stepped, config.arm("dgc"))
    with pytest.raises(ValueError, match="cannot change the optimizer's kind"):
        _script_config(tmp_path, {"k": {"reducer": "topk", "optimizer": {"optimizer": "sgd"}}})


def test_a_config_names_a_task_or_a_script_not_both(tmp_path):
    with pytest.raises(ValueError, match="task must be given exactly when script is not"):
        ExperimentConfig(name="x", task="digits-mlp", script=str(tmp_path / "t.py"))
    with pytest.raises(ValueError, match="script must be the path of an existing Python file"):
        ExperimentConfig(name="x", script=str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="mode must be one of"):
        ExperimentConfig(name="x", task="digits-mlp", mode="biggest")


def test_a_sparse_delta_arm_resolves_and_its_period_must_divide_checkpoints_and_replica_checks():
    loco = {"loco": {"reducer": "sparse-delta", "options": {"period": 20}}}
    config = dataclasses.replace(pydoc_gpt(), arms=("dense", "loco"), arm_definitions=loco)  # checkpoints every 100
    spec = config.arm("loco")
    assert spec.options == {"density": 0.01, "period": 20, "selector": "chunk", "chunk_size": 4096,
                            "index_codec": "rice", "value_codec": "int2", "outer_lr": 0.7, "ef_decay": 0.95}
    with pytest.raises(ValueError, match=r"checkpoint_every must be a multiple of its period 30"):
        dataclasses.replace(config, arm_definitions={"loco": {"reducer": "sparse-delta", "options": {"period": 30}}})
    with pytest.raises(ValueError, match=r"arm 'loco': outer_lr"):
        dataclasses.replace(config, arm_definitions={"loco": {"reducer": "sparse-delta", "options": {"outer_lr": 0}}})


def test_the_sign_mode_is_a_topk_arm_with_the_sign_sgd_optimizer():
    from sparsecomm.optim.sign_sgd import SignSGD

    sign = {"sign": {"reducer": "topk", "options": {"density": 0.003, "value_codec": "sign", "selector": "chunk",
                                                    "index_codec": "rice"},
                     "optimizer": {"optimizer": "signsgd", "lr": 0.001}}}
    config = dataclasses.replace(pydoc_gpt(), arms=("dense", "sign"), arm_definitions=sign)
    optimizer = make_optimizer(config, torch.nn.Linear(3, 2).parameters(), "sign")
    assert isinstance(optimizer, SignSGD) and optimizer.param_groups[0]["lr"] == 0.001
    with pytest.raises(ValueError, match=r"optimizer optimizer must be one of \('adamw', 'sgd', 'signsgd', 'adams'\)"):
        dataclasses.replace(config, arm_definitions={"sign": {**sign["sign"], "optimizer": {"optimizer": "lion"}}})


def test_the_fixed_presets_resolve_to_their_own_options_and_hash_them():
    config = pydoc_gpt()
    loco = config.arm("sparseloco")
    assert "sparseloco" in config.arms and loco.reducer == "sparse-delta"
    assert loco.options == {"period": 2, "density": 0.015625, "selector": "exact", "chunk_size": 4096,
                            "index_codec": "rice", "value_codec": "int2", "outer_lr": 1.0, "ef_decay": 0.95}
    # The experiment's density does not reach it (its own is fixed), so its runs are kept.
    assert dataclasses.replace(config, density=0.003).run_hash("sparseloco", 0) == config.run_hash("sparseloco", 0)
    overlapped = dataclasses.replace(config, arms=("dense", "sparseloco-overlap")).arm("sparseloco-overlap")
    assert overlapped.options == {**loco.options, "selector": "chunk", "chunk_size": 65536, "overlap": True}
    assert "overlap=true" in overlapped.describe()
    sign = config.arm("topk-sign")
    assert sign.options["value_codec"] == "sign" and sign.optimizer["optimizer"] == "signsgd"
    assert sign.options["density"] == config.density  # the experiment's density, for frontier sweeps


@pytest.mark.parametrize("item, message", [
    ("c=topk:density=0.1,density=0.2", "density is given twice"),
    ("c=topk:opt.lr=0.1,momentum=0.9,opt.lr=0.2", "opt.lr is given twice"),
])
def test_a_setting_given_twice_in_an_arm_string_is_refused(item, message):
    with pytest.raises(ValueError, match=f"argument --arms: .*{message}"):
        parse_arms(["dense", item])


@pytest.mark.parametrize("definition, message", [
    ({"reducer": "topk", "options": {"momentum": 0.9}, "optimizer": {"momentum": 0.5}},
     r"arm 'm': optimizer momentum 0.5 cannot apply: the arm's hook corrects momentum \(momentum=0.9\)"),
    ({"reducer": "topk", "optimizer": {"optimizer": "adamw", "momentum": 0.5}},
     r"arm 'm': optimizer momentum 0.5 cannot apply: only optimizer sgd has a momentum setting.*'adamw'"),
    ({"reducer": "allreduce", "optimizer": {"optimizer": "signsgd", "momentum": 0.5}},
     r"arm 'm': optimizer momentum 0.5 cannot apply: only optimizer sgd"),
])
def test_an_optimizer_momentum_the_arm_cannot_apply_is_refused_naming_arm_and_option(definition, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(digits_quick(), arms=("dense", "m"), arm_definitions={"m": definition})


def test_an_optimizer_momentum_the_arm_can_apply_reaches_its_optimizer(tmp_path):
    from sparsecomm.lab.experiment.script_run import adapt_optimizer

    config = dataclasses.replace(digits_quick(), arms=("dense", "m"),
                                 arm_definitions={"m": {"reducer": "topk", "optimizer": {"momentum": 0.5}}})
    model = torch.nn.Linear(3, 2)
    assert make_optimizer(config, model.parameters(), "m").param_groups[0]["momentum"] == 0.5  # digits: sgd
    script = _script_config(tmp_path, {"m": {"reducer": "topk", "optimizer": {"momentum": 0.5}}})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adapt_optimizer(sgd, script.arm("m"))
    assert sgd.param_groups[0]["momentum"] == 0.5
    adam = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="arm 'm' sets the optimizer's momentum to 0.5, but the script's AdamW has no "
                                         "momentum setting"):
        adapt_optimizer(adam, script.arm("m"))
    assert adam.param_groups[0]["betas"] == (0.9, 0.999)  # refused before anything changed


def test_an_arms_beta2_reaches_adamw_and_adams_and_is_refused_elsewhere(tmp_path):
    from sparsecomm.lab.experiment.script_run import adapt_optimizer

    definitions = {"s": {"reducer": "allreduce", "optimizer": {"optimizer": "adams", "beta2": 0.95}},
                   "w": {"reducer": "allreduce", "optimizer": {"optimizer": "adamw", "beta2": 0.98}},
                   "d": {"reducer": "topk", "options": {"momentum": 0.9}, "optimizer": {"beta2": 0.9}}}
    config = dataclasses.replace(pydoc_gpt(), arms=("dense", *definitions), arm_definitions=definitions)
    model = torch.nn.Linear(3, 2)
    adams = make_optimizer(config, model.parameters(), "s")
    assert isinstance(adams, sparsecomm.AdamS) and adams.param_groups[0]["betas"] == (0.9, 0.95)
    assert make_optimizer(config, model.parameters(), "w").param_groups[0]["betas"] == (0.9, 0.98)
    assert make_optimizer(config, model.parameters(), "d").param_groups[0]["betas"] == (0.0, 0.9)  # DGC: no beta1
    assert "adams lr=0.003 beta2=0.95" in config.arm("s").describe()
    # An arm that does not set beta2 keeps torch's default and its run hash (no beta2 key).
    assert "beta2" not in config.arm("dense").optimizer
    assert make_optimizer(config, model.parameters(), "dense").param_groups[0]["betas"] == (0.9, 0.999)
    for bad, message in (({"optimizer": "sgd", "beta2": 0.9}, r"beta2 applies to adamw and adams only.*'sgd'"),
                         ({"beta2": 1.0}, r"optimizer beta2 must be in \[0, 1\), got 1.0")):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(pydoc_gpt(), arms=("dense", "b"), arm_definitions={"b": {"reducer": "allreduce",
                                                                                          "optimizer": bad}})
    script = _script_config(tmp_path, {"b": {"reducer": "topk", "optimizer": {"beta2": 0.95}}})
    adamw = torch.optim.AdamW(model.parameters())
    adapt_optimizer(adamw, script.arm("b"))
    assert adamw.param_groups[0]["betas"] == (0.9, 0.95)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="arm 'b' sets the optimizer's beta2 to 0.95, but the script's SGD has no betas"):
        adapt_optimizer(sgd, script.arm("b"))
