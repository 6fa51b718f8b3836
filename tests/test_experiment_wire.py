"""The wire settings in experiments: config fields, run hashes, and the frontier's codec sweep."""
import hashlib
import json

import pytest

import digits_point
from sparsecomm.lab import frontier
from sparsecomm.lab.experiment.config import ExperimentConfig
from sparsecomm.lab.experiment.named import EXPERIMENTS
from sparsecomm.lab.results import load_runs


def _hash_without_wire(config: ExperimentConfig, arm: str, seed: int, **since) -> str:
    """The run hash as it was computed before the wire fields existed (an independent recomputation;
    the fields added after them, for your own script and metric and for sharded models, did not
    exist either); ``since``: keys added to it later."""
    d = config.to_dict()
    for key in ("name", "arms", "seeds", "target_loss", "policy", "stall_timeout_s", "fault_rate_per_hour",
                "selector", "chunk_size", "index_codec", "value_codec", "exchange",
                "script", "script_args", "metric", "mode", "launcher", "parallelism"):
        d.pop(key)
    d.pop("link")
    d.update(arm=arm, seed=seed, **since)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def test_default_wire_keeps_earlier_run_hashes_and_codecs_do_not_change_dense_runs():
    base = EXPERIMENTS["digits-quick"]()
    assert base.run_hash("dense", 0) == _hash_without_wire(base, "dense", 0)
    # A top-k arm differs from it by the model-wide budget alone (the hook's default since; not the wire).
    assert base.arm("topk-ef").options["budget"] == "model"
    assert base.run_hash("topk-ef", 0) == _hash_without_wire(base, "topk-ef", 0, topk_budget="model")
    chunked = base.with_overrides(selector="chunk", index_codec="rice", value_codec="int4")
    assert chunked.run_hash("dense", 0) == base.run_hash("dense", 0)
    assert chunked.run_hash("topk-ef", 0) != base.run_hash("topk-ef", 0)
    assert chunked.with_overrides(value_codec="int2").run_hash("topk-ef", 0) != chunked.run_hash("topk-ef", 0)


@pytest.mark.parametrize("overrides,named", [
    ({"selector": "sampled"}, "selector"),
    ({"selector": "chunk", "chunk_size": 1}, "chunk_size"),
    ({"selector": "chunk", "value_codec": "int5"}, "value_codec"),
])
def test_bad_wire_settings_are_refused_naming_the_field(overrides, named):
    with pytest.raises(ValueError, match=named):
        EXPERIMENTS["digits-quick"]().with_overrides(**overrides)


def test_bad_codec_sweeps_fail_before_any_run(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        frontier.main(["--densities", "0.01", "--selector", "chunk", "--chunk-size", "1", "--value-codecs", "int4",
                       "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "chunk_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        frontier.main(["--densities", "0.01", "--selector", "chunk", "--value-codecs", "int4", "int4",
                       "--out", str(tmp_path)])
    assert "--value-codecs must be distinct" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # CI time: the frontier end-to-end test covers the sweep and its reuse of dense runs
@pytest.mark.timeout(600)  # run alone, it first runs the shared compare (6 launches)
def test_codec_sweep_runs_dense_once_per_density_and_labels_the_points(tmp_path, tmp_path_factory, capsys):
    # digits-quick, 1 density x 2 codecs x (dense + topk-ef) x 1 seed, 50 steps, into the --out of the
    # shared compare (tests/digits_point.py), which is this density's frontier experiment with the
    # default wire. Dense, which the wire does not change, is copied into the codecs' experiments
    # from there ("also across frontiers"; the second codec's may come from the first's copy),
    # never trained here: 2 launches, not 4. One seed: the reuse is per seed, and no verdict is asserted.
    point = digits_point.compare_point(tmp_path_factory)
    (trained,) = [r for r in load_runs(point.experiment_dir) if (r.arm, r.seed, r.status) == ("dense", 0, "ok")]
    out, plots = point.out, tmp_path / "plots"
    code = frontier.main(["--experiment", "digits-quick", "--densities", f"{digits_point.DENSITY:g}",
                          "--arms", "topk-ef", "--selector", "chunk", "--index-codec", "rice",
                          "--value-codecs", "int4", "sign", "--seeds", "0", "--steps", str(digits_point.STEPS),
                          "--out", str(out), "--plots", str(plots)])
    assert code == 0
    printed = capsys.readouterr().out
    points = json.loads((out / "digits-quick-chunk-rice-codecs-frontier.json").read_text())
    assert [(p["arm"], p["value_codec"]) for p in points] == [("topk-ef", "int4"), ("topk-ef", "sign")]
    assert "topk-ef int4" in printed and "topk-ef sign" in printed
    first, second = (load_runs(p["run_dir"]) for p in points)
    dense_first = {r.seed: r for r in first if r.arm == "dense"}
    dense_second = {r.seed: r for r in second if r.arm == "dense"}
    # Both codecs' dense runs are the run trained once (copied, not trained again): same loss, same times.
    assert sorted(dense_first) == sorted(dense_second) == [0]
    for dense in (dense_first[0], dense_second[0]):
        assert dense.status == "ok" and dense.final_val_loss == trained.final_val_loss
        assert dense.median_step_seconds == trained.median_step_seconds
        assert dense.setup_seconds == trained.setup_seconds
    assert printed.count("finished earlier, skipped") == 2  # the copies, one in each codec's experiment
    sparse = {r.seed: r for r in second if r.arm == "topk-ef"}
    assert "chunk 4096 rice/sign" in sparse[0].extra["hook"]
    assert (plots / "digits-quick-chunk-rice-codecs-frontier" / "frontier.png").stat().st_size > 10_000


def test_the_exchange_is_part_of_a_topk_runs_identity_and_its_label():
    from sparsecomm.lab.experiment.arms import wire_label

    base = EXPERIMENTS["digits-quick"]()
    owner = base.with_overrides(selector="chunk", index_codec="rice", value_codec="int4", exchange="owner")
    assert owner.run_hash("topk-dgc", 0) != owner.with_overrides(exchange="allgather").run_hash("topk-dgc", 0)
    assert owner.run_hash("dense", 0) == base.run_hash("dense", 0)
    assert wire_label(owner) == "chunk 4096 rice/int4 via owner"
    assert wire_label(base.with_overrides(exchange="shared-index")) == "via shared-index"
    with pytest.raises(ValueError, match="float"):
        ExperimentConfig.from_dict({**base.to_dict(), "selector": "chunk", "value_codec": "int4",
                                    "exchange": "shared-index"})


def test_the_committed_experiment_configs_load():
    from pathlib import Path

    files = sorted((Path(__file__).parent.parent / "experiments" / "configs").glob("*.json"))
    assert files
    for path in files:
        config = ExperimentConfig.from_dict(json.loads(path.read_text()))
        assert config.name == path.stem, path  # the file is named after its experiment
