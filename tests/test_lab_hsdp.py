"""The lab's parallelism setting: paired experiments whose arms act on the cross-replica
reduction of FSDP2 hybrid sharding ("hsdp:RxS").

Oracle: with one shard per replica (hsdp:2x1) FSDP's reduce-scatter is a copy and the dense
arm's plain all-reduce (divide by 2, sum) is DDP's allreduce_hook, so its final loss must equal
the DDP dense run's to every digit (the DDP runs: the shared digits compare of
tests/digits_point.py). Runs are real launches (torchrun, gloo), few steps."""
import json

import pytest

import digits_point
from sparsecomm.lab import compare
from sparsecomm.lab.experiment.named import digits_quick
from sparsecomm.lab.results import load_runs

pytestmark = pytest.mark.timeout(400)


def _finals(out, name):
    return {r.arm: r for r in load_runs(out / name)}


@pytest.mark.slow  # CI time: the script test below checks the same equality through the same hsdp_arm
def test_hsdp_with_one_shard_per_replica_trains_dense_as_ddp_does_to_every_digit(tmp_path, tmp_path_factory):
    # The DDP runs: the shared digits compare (tests/digits_point.py), the same settings but parallelism.
    ddp = {(r.arm, r.seed): r for r in load_runs(digits_point.compare_point(tmp_path_factory).experiment_dir)}
    config = tmp_path / "hsdp.json"
    config.write_text(json.dumps(digits_point.point_config().with_overrides(
        name="hsdp", parallelism="hsdp:2x1", seeds=(0,)).to_dict()))
    assert compare.main(["--config", str(config), "--out", str(tmp_path / "runs"),
                         "--plots", str(tmp_path / "plots")]) == 0
    hsdp = _finals(tmp_path / "runs", "hsdp")
    assert hsdp["dense"].final_val_loss == ddp[("dense", 0)].final_val_loss
    assert hsdp["dense"].config_hash != ddp[("dense", 0)].config_hash  # another computation, another run
    # The top-k arm selects per FSDP module instead of per DDP bucket: its own run, sparse.
    assert hsdp["topk-ef"].status == "ok" and 0 < hsdp["topk-ef"].bytes_sent_per_step < 0.01 * hsdp[
        "topk-ef"].bytes_dense_per_step


def test_the_averager_and_dense_run_at_two_replicas_of_two_shards(tmp_path):
    # The hook's arms at hsdp:2x1 above (FSDP's layout is the same code at any shard count:
    # tests/test_fsdp_hsdp_hook.py); here the averager over replicas of real shards.
    assert compare.main(["--experiment", "digits-quick", "--parallelism", "hsdp:2x2", "--world-size", "4",
                         "--arms", "dense", "sparseloco", "--seeds", "0", "--steps", "6",
                         "--out", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots"),
                         "--name", "hsdp"]) == 0
    runs = _finals(tmp_path / "runs", "hsdp")
    dense_bytes = runs["dense"].bytes_dense_per_step
    assert runs["dense"].bytes_sent_per_step == dense_bytes > 0  # this rank's shard, every step
    assert runs["sparseloco"].status == "ok" and 0 < runs["sparseloco"].bytes_sent_per_step < 0.05 * dense_bytes


@pytest.mark.parametrize("overrides, field, fragment", [
    (dict(parallelism="hsdp:2x2"), "parallelism", "R x S = world_size (2)"),
    (dict(parallelism="hsdp:1x2"), "parallelism", "R >= 2"),
    (dict(parallelism="fsdp"), "parallelism", '"ddp" or "hsdp:RxS"'),
    # One spelling per shape: int() and str.isdigit() take these, and each would hash to runs of its own.
    (dict(parallelism="hsdp:\u00b2x2", world_size=4), "parallelism", "ASCII digits without a leading zero"),
    (dict(parallelism="hsdp:02x2", world_size=4), "parallelism", "ASCII digits without a leading zero"),
    (dict(parallelism="hsdp:\u0662x\u0662", world_size=4), "parallelism", "ASCII digits without a leading zero"),
    (dict(parallelism="hsdp:2x1", checkpoint_every=10), "checkpoint_every", "0 with parallelism 'hsdp:2x1'"),
    (dict(parallelism="hsdp:2x1", monitor_every=5, on_corruption="stop"), "monitor_every", "not in the lab's HSDP runs yet"),
    (dict(parallelism="hsdp:2x1", arms=("dense", "powersgd")), "arms", "arm 'powersgd' is 'powersgd'"),
])
def test_hsdp_settings_out_of_range_are_refused_by_name(overrides, field, fragment):
    with pytest.raises(ValueError) as refused:
        digits_quick().with_overrides(**overrides)
    assert f"{field} must be" in str(refused.value) and fragment in str(refused.value)


@pytest.mark.parametrize("parallelism", ["hsdp:\u00b2x2", "hsdp:02x2", "hsdp:\u0662x\u0662", "hsdp:2x2 ", "hsdp:2X2"])
def test_another_spelling_of_parallelism_is_refused_naming_the_argument_and_its_form(parallelism, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        compare.main(["--experiment", "digits-quick", "--parallelism", parallelism, "--world-size", "4",
                      "--out", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots")])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and not any(tmp_path.iterdir())
    assert (f'argument --parallelism: must be "ddp" or "hsdp:RxS" (R replicas of S shards: positive integers in ASCII '
            f'digits without a leading zero, e.g. "hsdp:2x2"), got {parallelism!r}') in error, error


def test_ddp_runs_keep_their_hash():
    config = digits_quick()
    assert config.run_hash("dense", 0) == config.with_overrides(parallelism="ddp").run_hash("dense", 0)
    assert config.run_hash("dense", 0) != config.with_overrides(parallelism="hsdp:2x1").run_hash("dense", 0)


HSDP_SCRIPT = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import sparsecomm.lab
dist.init_process_group("gloo")
run = sparsecomm.lab.init()
torch.manual_seed(run.seed)  # the same initial weights on every rank (FSDP does not broadcast them)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
if run.parallelism == "ddp":
    model = DDP(model)
else:
    from torch.distributed.fsdp import fully_shard
    mesh = run.mesh()
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
optimizer = run.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
data = torch.Generator().manual_seed(dist.get_rank())  # every rank its own data
for step in range(run.steps):
    model(torch.randn(8, 4, generator=data)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
with torch.no_grad():
    loss = model(torch.randn(16, 4, generator=torch.Generator().manual_seed(99))).square().mean()
dist.all_reduce(loss)
run.log({"val_loss": loss.item() / dist.get_world_size()})
run.finish()
"""


def test_a_user_script_shards_its_model_under_hsdp_and_dense_equals_ddp_to_every_digit(tmp_path, monkeypatch):
    from sparsecomm.lab.experiment.config import ExperimentConfig
    from sparsecomm.lab.experiment.runner import run_experiment

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(HSDP_SCRIPT)
    runs = {}
    for parallelism, arms in (("ddp", ("dense",)), ("hsdp:2x1", ("dense", "topk-ef"))):
        config = ExperimentConfig(name=parallelism.replace(":", "-"), script="train.py", arms=arms, seeds=(0,),
                                  steps=5, parallelism=parallelism)
        runs[parallelism] = {r.arm: r for r in load_runs(run_experiment(config, tmp_path / "runs",
                                                                        progress=lambda line: None))}
    ddp, hsdp = runs["ddp"], runs["hsdp:2x1"]
    assert {arm: r.status for arm, r in hsdp.items()} == {"dense": "ok", "topk-ef": "ok"}, \
        {arm: r.error for arm, r in hsdp.items()}
    # One shard per replica: FSDP's reduce-scatter is a copy, the plain all-reduce is DDP's mean.
    assert hsdp["dense"].final_val_loss == ddp["dense"].final_val_loss
    assert "HSDP 2x1" in hsdp["topk-ef"].extra["hook"] and hsdp["dense"].bytes_sent_per_step == hsdp["dense"].bytes_dense_per_step
    assert 0 < hsdp["topk-ef"].bytes_sent_per_step < hsdp["dense"].bytes_sent_per_step


def test_a_script_that_does_not_shard_under_hsdp_is_told_what_to_do(tmp_path):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from sparsecomm.lab.experiment.config import ExperimentConfig
    from sparsecomm.lab.experiment.script_run import Run

    (tmp_path / "train.py").write_text(HSDP_SCRIPT)
    config = ExperimentConfig(name="s", script=str(tmp_path / "train.py"), arms=("dense", "topk-ef"), seeds=(0,),
                              parallelism="hsdp:2x1")
    run = Run(arm="topk-ef", seed=0, config=config, run_dir=tmp_path)
    model = torch.nn.Linear(4, 2)
    for given in (model, DistributedDataParallel.__new__(DistributedDataParallel)):  # refused before DDP or FSDP is asked anything
        with pytest.raises(TypeError, match=r"with parallelism 'hsdp:2x1' ddp_model must be the model fully_shard-ed "
                                            r"over run.mesh\(\)\['shard'\]"):
            run.apply(given, torch.optim.SGD(model.parameters(), lr=0.1))
    assert run.parallelism == "hsdp:2x1" and Run(arm="dense", seed=0).parallelism == "ddp"
    with pytest.raises(ValueError, match='parallelism is "ddp"'):
        Run(arm="dense", seed=0).mesh()
