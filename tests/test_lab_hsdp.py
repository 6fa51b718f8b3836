"""The lab's parallelism setting: paired experiments whose arms act on the cross-replica
reduction of FSDP2 hybrid sharding ("hsdp:RxS").

Oracle: with one shard per replica (hsdp:2x1) FSDP's reduce-scatter is a copy and the dense
arm's plain all-reduce (divide by 2, sum) is DDP's allreduce_hook, so its final loss must equal
the DDP dense run's to every digit (the DDP runs: the shared digits compare of
tests/digits_point.py). Runs are real launches (torchrun, gloo), few steps."""
import json

import pytest

import digits_point
from sparsecomm.lab.experiment import compare
from sparsecomm.lab.experiment.named import digits_quick
from sparsecomm.lab.results import load_runs

pytestmark = pytest.mark.timeout(400)


def _finals(out, name):
    return {r.arm: r for r in load_runs(out / name)}


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


def test_every_hsdp_arm_kind_runs_at_two_replicas_of_two_shards(tmp_path):
    assert compare.main(["--experiment", "digits-quick", "--parallelism", "hsdp:2x2", "--world-size", "4",
                         "--arms", "dense", "topk-ef", "sparseloco", "--seeds", "0", "--steps", "6",
                         "--out", str(tmp_path / "runs"), "--plots", str(tmp_path / "plots"),
                         "--name", "hsdp"]) == 0
    runs = _finals(tmp_path / "runs", "hsdp")
    dense_bytes = runs["dense"].bytes_dense_per_step
    assert runs["dense"].bytes_sent_per_step == dense_bytes > 0  # this rank's shard, every step
    for arm in ("topk-ef", "sparseloco"):  # the hook on each module; the averager over the replicas
        assert runs[arm].status == "ok" and 0 < runs[arm].bytes_sent_per_step < 0.05 * dense_bytes, arm


@pytest.mark.parametrize("overrides, field, fragment", [
    (dict(parallelism="hsdp:2x2"), "parallelism", "R x S = world_size (2)"),
    (dict(parallelism="hsdp:1x2"), "parallelism", "R >= 2"),
    (dict(parallelism="fsdp"), "parallelism", '"ddp" or "hsdp:RxS"'),
    (dict(parallelism="hsdp:2x1", checkpoint_every=10), "checkpoint_every", "0 with parallelism 'hsdp:2x1'"),
    (dict(parallelism="hsdp:2x1", monitor_every=5, on_corruption="stop"), "monitor_every", "not in the lab's HSDP runs yet"),
    (dict(parallelism="hsdp:2x1", arms=("dense", "powersgd")), "arms", "arm 'powersgd' is 'powersgd'"),
])
def test_hsdp_settings_out_of_range_are_refused_by_name(overrides, field, fragment):
    with pytest.raises(ValueError) as refused:
        digits_quick().with_overrides(**overrides)
    assert f"{field} must be" in str(refused.value) and fragment in str(refused.value)


def test_ddp_runs_keep_their_hash():
    config = digits_quick()
    assert config.run_hash("dense", 0) == config.with_overrides(parallelism="ddp").run_hash("dense", 0)
    assert config.run_hash("dense", 0) != config.with_overrides(parallelism="hsdp:2x1").run_hash("dense", 0)
