"""The alpha-beta cost model behind ``sparsecomm project``: formulas, fallback, break-even, labels, CLI.

Run directories are synthetic, written by hand in the layout of :mod:`sparsecomm.lab.results`,
with round numbers so that every expected figure below is computed by hand.
"""
import json

import pytest

from sparsecomm.lab import cli, costmodel
from sparsecomm.lab.costmodel import (
    falls_back_to_dense, make_scenario, project_arm, read_run, ring_allgather_seconds, ring_allreduce_seconds,
)
from sparsecomm.lab.results.quantity import Quantity

# Relative agreement of closed-form sums of a few float terms: rounding is ~1e-16 per
# operation, so 1e-12 leaves room without hiding a wrong term (those are >= 1e-3 off).
REL = 1e-12

NUMEL = 250_000  # gradient entries per step (fp32): D = 1 MB
DENSE_BYTES = 4.0 * NUMEL
K = 2_500  # density 0.01
PAYLOAD = 8.0 * K  # fp32 value + int32 index: s = 20 kB per rank
UNPACK_RATE = 1e8  # scatter-adds per second, built into hook_stats below
STEPS = 100


def _topk_stats(world_size: int) -> dict:
    sparse_calls, warmup = STEPS - 2, 2
    return {
        "sparse_calls": sparse_calls, "warmup_calls": warmup, "fallback_calls": 0, "steps": STEPS,
        "elements_total": STEPS * NUMEL, "elements_sparse": sparse_calls * NUMEL,
        "elements_sent": sparse_calls * K, "bytes_dense": STEPS * DENSE_BYTES,
        "bytes_sent": warmup * DENSE_BYTES + sparse_calls * PAYLOAD,
        "seconds_unpack": sparse_calls * K * world_size / UNPACK_RATE,
        "density": 0.01,
    }


def write_run(root, *, arms: dict, link: str | None = "loopback", world_size: int = 2, seeds=(0, 1, 2),
              reach: dict | None = None, bucket_cap_mb: float = 25.0):
    """``arms[name] = dict(compute=, compress=, comm_wait=, step=, sent=, topk=bool)``.

    ``reach[name]``: the step at which the arm's evaluations first drop below the target
    (declared as 2.0); None: never.
    """
    config = {"name": root.name, "task": "synthetic", "arms": list(arms), "seeds": list(seeds),
              "world_size": world_size, "steps": STEPS, "target_loss": 2.0, "bucket_cap_mb": bucket_cap_mb,
              "policy": {"quality_tolerance": 0.05, "staleness_limit": 1000, "redundancy_budget": 0.05}}
    if link is not None:
        config["link"] = link
    runs = {}
    for arm, figures in arms.items():
        first = (reach or {}).get(arm, 50)
        for seed in seeds:
            name = f"{arm}-seed{seed}-0123456789"
            runs[f"{arm}/{seed}"] = name
            run = root / "runs" / name
            run.mkdir(parents=True)
            evals = [[s, s * figures["step"], 1.5 if first is not None and s >= first else 3.0]
                     for s in range(10, STEPS + 1, 10)]
            summary = {
                "arm": arm, "seed": seed, "status": "ok", "config_hash": "0123456789", "setup_seconds": 1.0,
                "hook": "sparsecomm topk_hook density 0.01" if figures.get("topk") else "torch allreduce_hook",
                "median_step_seconds": figures["step"], "median_compute_seconds": figures["compute"],
                "median_compress_seconds": figures["compress"], "median_comm_wait_seconds": figures["comm_wait"],
                "bytes_sent_per_step": figures["sent"], "bytes_dense_per_step": DENSE_BYTES, "evals": evals,
                "hook_stats": _topk_stats(world_size) if figures.get("topk") else None,
                "world_size": world_size,
            }
            if figures.get("arm_spec"):
                summary["arm_spec"] = figures["arm_spec"]
            (run / "summary.json").write_text(json.dumps(summary))
            rows = [{"kind": "eval", "step": s, "val_loss": v, "elapsed_seconds": t} for s, t, v in evals]
            (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "experiment.json").write_text(json.dumps({"config": config, "environment": {}, "runs": runs}))
    return root


DENSE = dict(compute=0.030, compress=0.001, comm_wait=0.004, step=0.035, sent=DENSE_BYTES)
TOPK = dict(compute=0.030, compress=0.002, comm_wait=0.001, step=0.033, sent=PAYLOAD, topk=True)


@pytest.fixture
def run_dir(tmp_path):
    return write_run(tmp_path / "source", arms={"dense": DENSE, "topk-ef": TOPK}, reach={"dense": 60, "topk-ef": 80})


# A top-k arm whose compute is 8 ms above dense's: on 1gbit at 32 workers it is cheaper than
# dense only below some density, well inside the sparse range (< 1/64).
CROSSING = {**TOPK, "compute": 0.038}


@pytest.fixture
def crossing_dir(tmp_path):
    return write_run(tmp_path / "crossing", arms={"dense": DENSE, "topk-ef": CROSSING},
                     reach={"dense": 60, "topk-ef": 70})


# ---------------------------------------------------------------------------------------------
# Formulas


@pytest.mark.parametrize("p, expected", [
    (2, 2 * 1 * 1e-5 + 2 * (1 / 2) * 1e6 / 1e9),  # 1.02e-3
    (32, 2 * 31 * 1e-5 + 2 * (31 / 32) * 1e6 / 1e9),  # 6.2e-4 + 1.9375e-3 = 2.5575e-3
])
def test_ring_allreduce_matches_hand_computation(p, expected):
    got = ring_allreduce_seconds(1e6, p, rate_bytes_per_s=1e9, alpha_s=1e-5)
    assert got == pytest.approx({2: 1.02e-3, 32: 2.5575e-3}[p], rel=REL)
    assert got == pytest.approx(expected, rel=REL)
    # Three collectives (PowerSGD) pay three latencies, the same bandwidth term.
    assert ring_allreduce_seconds(1e6, p, rate_bytes_per_s=1e9, alpha_s=1e-5, collectives=3) == pytest.approx(
        expected + 2 * 2 * (p - 1) * 1e-5, rel=REL)


@pytest.mark.parametrize("p, expected", [(2, 2e-5), (32, 6.2e-4)])
def test_ring_allgather_matches_hand_computation(p, expected):
    # (p-1) alpha + (p-1) s / B with s = 10 kB, B = 1 GB/s, alpha = 10 us
    assert ring_allgather_seconds(1e4, p, rate_bytes_per_s=1e9, alpha_s=1e-5) == pytest.approx(expected, rel=REL)


def test_fallback_rule_is_the_hooks_p_times_payload_against_dense():
    # fp32 values + int32 indices: 8 bytes per entry against 4 dense, so density 1/(2p) is the edge.
    p = 32
    edge = 1 / (2 * p)
    assert falls_back_to_dense(edge * NUMEL * 8, DENSE_BYTES, p)  # equal: not smaller, so dense
    assert not falls_back_to_dense(0.99 * edge * NUMEL * 8, DENSE_BYTES, p)
    assert falls_back_to_dense(PAYLOAD, DENSE_BYTES, 50)  # 50 x 20 kB = 1 MB
    assert not falls_back_to_dense(PAYLOAD, DENSE_BYTES, 49)


# ---------------------------------------------------------------------------------------------
# Reading a run and projecting it


def test_read_run_takes_measured_inputs(run_dir):
    run = read_run(run_dir)
    assert (run.link, run.world_size, run.buckets_per_step) == ("loopback", 2, 1)
    assert "hook_stats" in run.buckets_source
    topk, dense = run.arm("topk-ef"), run.arm("dense")
    assert topk.sparse and not dense.sparse
    assert topk.payload_element_bytes == pytest.approx(8.0, rel=REL)
    assert topk.density == pytest.approx(0.01, rel=REL)
    assert topk.unpack_adds_per_s == pytest.approx(UNPACK_RATE, rel=REL)
    assert (dense.steps_to_target, topk.steps_to_target) == (60, 80)


def test_arms_that_train_locally_are_named_and_not_projected(tmp_path):
    local = {**DENSE, "sent": PAYLOAD / 4, "arm_spec": {"reducer": "sparse-delta", "options": {"period": 2}}}
    run = read_run(write_run(tmp_path / "loco", arms={"dense": DENSE, "topk-ef": TOPK, "loco": local}))
    assert run.not_modelled == ("loco",) and run.arm("loco") is None and run.arm("topk-ef") is not None
    assert any("not projected: loco" in line for line in costmodel.assumptions(run, make_scenario(32, "1gbit")))


def test_projection_at_32_workers_on_1gbit_matches_hand_computation(run_dir):
    run = read_run(run_dir)
    scenario = make_scenario(32, "1gbit")  # B = 1.25e8 B/s, alpha = 25 us (default)
    assert scenario.alpha_s == costmodel.DEFAULT_ALPHA_S == 25e-6
    dense = project_arm(run.arm("dense"), run, scenario)
    topk = project_arm(run.arm("topk-ef"), run, scenario)
    # dense: 0.031 + 2*31*25e-6 + 2*31/32 * 1e6/1.25e8 = 0.031 + 1.55e-3 + 0.0155
    assert dense.step.value == pytest.approx(0.04805, rel=REL)
    assert dense.time_to_target.value == pytest.approx(60 * 0.04805, rel=REL)
    # top-k: 0.032 + 31*25e-6 + 31*2e4/1.25e8 + unpack 32*2500/1e8
    assert topk.mode == "sparse allgather"
    assert topk.comm_s == pytest.approx(7.75e-4 + 4.96e-3, rel=REL)
    assert topk.unpack_s == pytest.approx(8e-4, rel=REL)
    assert topk.step.value == pytest.approx(0.038535, rel=REL)
    assert topk.time_to_target.value == pytest.approx(80 * 0.038535, rel=REL)


def test_owner_and_broadcast_costs_match_hand_computation():
    # owner: all-to-all of p-1 shares of s/p, then a ring all-gather of s/p replies.
    s, p = 1e4, 8
    assert costmodel.owner_exchange_seconds(s, p, rate_bytes_per_s=1e9, alpha_s=1e-5) == pytest.approx(
        2 * 7 * 1e-5 + 2 * 7 * 1250 / 1e9, rel=REL)  # 1.4e-4 + 1.75e-5
    assert costmodel.broadcast_seconds(1e4, 8, rate_bytes_per_s=1e9, alpha_s=1e-5) == pytest.approx(
        3 * (1e-5 + 1e-5), rel=REL)  # a binomial tree: 3 rounds for 8 ranks
    assert costmodel.broadcast_seconds(1e4, 1, rate_bytes_per_s=1e9, alpha_s=1e-5) == 0.0
    assert costmodel.exchange_bytes_received("owner", s, 1e6, p) == pytest.approx(2 * 7 * s / 8, rel=REL)
    assert costmodel.exchange_bytes_received("allgather", s, 1e6, p) == 7 * s
    with pytest.raises(ValueError, match="exchange"):
        costmodel.exchange_bytes_received("ring", s, 1e6, p)


def test_projection_through_owners_does_not_grow_with_workers(run_dir):
    run = read_run(run_dir)
    topk = run.arm("topk-ef")
    owner = project_arm(topk, run, make_scenario(32, "1gbit", exchange="owner"))
    # 2*31*25e-6 + 2*31/32 * 2e4/1.25e8; unpack: 2 payloads of 2500 entries at 1e8 adds/s
    assert owner.mode == "sparse owner"
    assert owner.comm_s == pytest.approx(1.55e-3 + 3.1e-4, rel=REL)
    assert owner.unpack_s == pytest.approx(5e-5, rel=REL)
    # At 50 workers the all-gather falls back to dense; through owners it stays sparse.
    assert project_arm(topk, run, make_scenario(50, "1gbit", exchange="owner")).mode == "sparse owner"
    auto = project_arm(topk, run, make_scenario(50, "1gbit", exchange="auto"))
    assert auto.mode == "sparse owner"
    with pytest.raises(ValueError, match="exchange"):
        make_scenario(32, "1gbit", exchange="ring")


def test_projection_says_when_an_arm_falls_back_to_dense(run_dir):
    run = read_run(run_dir)
    topk = run.arm("topk-ef")
    at_50 = project_arm(topk, run, make_scenario(50, "1gbit"))  # 50 x 20 kB >= 1 MB
    assert at_50.mode == "dense fallback" and at_50.unpack_s == 0
    assert at_50.comm_s == pytest.approx(
        ring_allreduce_seconds(DENSE_BYTES, 50, rate_bytes_per_s=1.25e8, alpha_s=25e-6), rel=REL)
    assert any("allreduces densely" in note for note in at_50.notes)
    scenario = make_scenario(32, "1gbit")
    assert project_arm(topk, run, scenario, density=1 / 64).mode == "dense fallback"
    assert project_arm(topk, run, scenario, density=0.99 / 64).mode == "sparse allgather"


def test_alpha_comes_from_the_option_then_the_link_then_the_default():
    assert make_scenario(4, "1gbit", alpha_us=3).alpha_s == pytest.approx(3e-6)
    latency = make_scenario(4, "1gbit@80us")
    assert latency.alpha_s == pytest.approx(80e-6) and "latency" in latency.alpha_source
    assert "assumed" in make_scenario(4, "1gbit").alpha_source
    with pytest.raises(ValueError, match="no known rate"):
        make_scenario(4, "loopback")
    with pytest.raises(ValueError, match=r"workers must be an integer in \[2, "):
        make_scenario(1, "1gbit")


def test_buckets_are_estimated_from_bucket_cap_without_hook_stats(tmp_path):
    root = write_run(tmp_path / "dense-only", arms={"dense": DENSE}, bucket_cap_mb=0.25)
    run = read_run(root)
    assert run.buckets_per_step == 4  # ceil(1e6 / 262144)
    assert "bucket_cap_mb" in run.buckets_source
    projected = project_arm(run.arm("dense"), run, make_scenario(32, "1gbit"))
    assert projected.comm_s == pytest.approx(4 * 2 * 31 * 25e-6 + 0.0155, rel=REL)
    # With four buckets, overlap can hide three quarters of the communication behind compute.
    overlapped = project_arm(run.arm("dense"), run, make_scenario(32, "1gbit", overlap=True))
    assert overlapped.exposed_s == pytest.approx(projected.comm_s / 4, rel=REL)


# ---------------------------------------------------------------------------------------------
# Break-even


@pytest.mark.parametrize("boundary", ["step", "time_to_target"])
def test_break_even_density_is_where_the_modelled_costs_are_equal(crossing_dir, boundary):
    run = read_run(crossing_dir)
    topk, dense = run.arm("topk-ef"), run.arm("dense")
    scenario = make_scenario(32, "1gbit")
    found = costmodel.break_even_density(topk, dense, run, scenario, boundary)
    assert found.kind == "below" and 0 < found.value < 1 / 64
    weight = (70, 60) if boundary == "time_to_target" else (1, 1)
    sparse_cost = weight[0] * project_arm(topk, run, scenario, found.value).step.value
    dense_cost = weight[1] * project_arm(dense, run, scenario).step.value
    assert sparse_cost == pytest.approx(dense_cost, rel=1e-9)
    # and sparse is cheaper just below it, dearer just above
    assert weight[0] * project_arm(topk, run, scenario, found.value * 0.99).step.value < dense_cost
    assert weight[0] * project_arm(topk, run, scenario, found.value * 1.01).step.value > dense_cost
    if boundary == "step":
        # Closed form (exposed comm is linear in density): A + d * C = dense step.
        fixed = 0.040 + 31 * 25e-6
        per_density = 31 * NUMEL * 8 / 1.25e8 + 32 * NUMEL / UNPACK_RATE
        assert found.value == pytest.approx((0.04805 - fixed) / per_density, rel=1e-9)


@pytest.mark.parametrize("boundary", ["step", "time_to_target"])
def test_break_even_rate_is_where_the_modelled_costs_are_equal(crossing_dir, boundary):
    run = read_run(crossing_dir)
    topk, dense = run.arm("topk-ef"), run.arm("dense")
    scenario = make_scenario(32, "100gbit")
    found = costmodel.break_even_rate(topk, dense, run, scenario, boundary)
    assert found.kind == "below"
    at = scenario.with_rate(found.value)
    weight = (70, 60) if boundary == "time_to_target" else (1, 1)
    assert weight[0] * project_arm(topk, run, at).step.value == pytest.approx(
        weight[1] * project_arm(dense, run, at).step.value, rel=1e-9)
    if boundary == "step":
        # Linear in 1/B: fixed cost gap Y over byte advantage X: B* = X / Y.
        gap = (0.040 + 31 * 25e-6 + 8e-4) - (0.031 + 2 * 31 * 25e-6)
        advantage = 2 * 31 / 32 * DENSE_BYTES - 31 * PAYLOAD
        assert found.value == pytest.approx(8 * advantage / gap, rel=1e-9)


def test_break_even_never_always_and_not_applicable(tmp_path):
    slow = write_run(tmp_path / "slow", arms={"dense": DENSE, "topk-ef": {**TOPK, "compute": 0.5}})
    run = read_run(slow)
    never = costmodel.break_even_density(run.arm("topk-ef"), run.arm("dense"), run, make_scenario(32, "1gbit"))
    assert never.kind == "never" and never.value is None and never.text.startswith("never")
    # Below the fallback p x s < D, sparse always sends fewer bytes: slow enough links favour it.
    slow_rate = costmodel.break_even_rate(run.arm("topk-ef"), run.arm("dense"), run, make_scenario(32, "1gbit"))
    gap = (0.5 + 0.002 + 31 * 25e-6 + 8e-4) - (0.031 + 2 * 31 * 25e-6)
    assert slow_rate.kind == "below"
    assert slow_rate.value == pytest.approx(8 * (2 * 31 / 32 * DENSE_BYTES - 31 * PAYLOAD) / gap, rel=1e-9)

    fast = write_run(tmp_path / "fast", arms={"dense": DENSE, "topk-ef": {**TOPK, "compute": 0.020}})
    run = read_run(fast)
    always = costmodel.break_even_density(run.arm("topk-ef"), run.arm("dense"), run, make_scenario(32, "1mbit"))
    assert always.kind == "always" and "fallback" in always.text
    assert costmodel.break_even_rate(run.arm("topk-ef"), run.arm("dense"), run,
                                     make_scenario(32, "1gbit")).kind == "always"
    # at 50 workers the measured density falls back to dense: no rate makes it sparse
    assert costmodel.break_even_rate(run.arm("topk-ef"), run.arm("dense"), run,
                                     make_scenario(50, "1gbit")).kind == "n/a"

    unreached = write_run(tmp_path / "unreached", arms={"dense": DENSE, "topk-ef": TOPK}, reach={"topk-ef": None})
    run = read_run(unreached)
    found = costmodel.break_even_density(run.arm("topk-ef"), run.arm("dense"), run, make_scenario(32, "1gbit"),
                                         "time_to_target")
    assert found.kind == "n/a"
    assert project_arm(run.arm("topk-ef"), run, make_scenario(32, "1gbit")).time_to_target.value is None


# ---------------------------------------------------------------------------------------------
# Labels


def test_every_projected_figure_is_labelled_modelled_with_its_boundary(run_dir):
    projection = costmodel.project(read_run(run_dir), make_scenario(32, "1gbit"), densities=(0.001, 0.02))
    data = costmodel.projection_json(projection)
    assert data["modelled"] is True
    for arm in data["projected"] + [p for rows in data["densities"].values() for p in rows]:
        assert (arm["step"]["kind"], arm["step"]["boundary"]) == ("modelled", "step")
        assert (arm["time_to_target"]["kind"], arm["time_to_target"]["boundary"]) == ("modelled", "time_to_target")
    for figures in data["measured"].values():
        assert figures["compute_seconds"]["kind"] == "measured"
        assert figures["steps_to_target"]["boundary"] == "steps_to_target"
    assert [p["mode"] for p in data["densities"]["topk-ef"]] == ["sparse allgather", "dense fallback"]
    text = costmodel.format_projection(projection)
    assert "MODELLED" in text and "[modelled, boundary: step]" in text
    assert "[modelled, boundary: time_to_target]" in text and "[measured" in text
    assert "alpha 25 us per message (assumed" in text


def test_a_modelled_figure_does_not_mix_with_a_measured_one():
    modelled = costmodel.Modelled(0.04, "s", "step")
    assert str(modelled) == "40.0 ms [modelled, boundary: step]"
    with pytest.raises(TypeError):
        modelled.speedup_over(Quantity(0.05, "s", "step"))  # measured
    with pytest.raises(TypeError):
        modelled.speedup_over(costmodel.Modelled(4.0, "s", "time_to_target"))
    with pytest.raises(ValueError, match="boundary"):
        costmodel.Modelled(1.0, "s", "end_to_end")


# ---------------------------------------------------------------------------------------------
# Validation against a run measured on an emulated link


def _emulated_run(tmp_path, name, *, error: float):
    """A 2-rank "1gbit" run whose measured steps are the model's prediction x (1 + error)."""
    alpha, rate = 25e-6, 1.25e8
    dense_step = 0.031 + 2 * alpha + DENSE_BYTES / rate
    topk_step = 0.032 + alpha + PAYLOAD / rate + 2 * K / UNPACK_RATE
    arms = {"dense": {**DENSE, "step": dense_step * (1 + error), "comm_wait": 0.008},
            "topk-ef": {**TOPK, "step": topk_step * (1 + error), "comm_wait": 0.001}}
    return write_run(tmp_path / name, arms=arms, link="1gbit"), dense_step, topk_step


def test_validation_predicts_the_emulated_run_from_the_loopback_run(run_dir, tmp_path):
    exact, dense_step, topk_step = _emulated_run(tmp_path, "exact", error=0.0)
    result = costmodel.validate(run_dir, exact)
    rows = {r.arm: r for r in result.rows}
    assert result.scenario.workers == 2 and result.scenario.link.name == "1gbit"
    assert rows["dense"].predicted.value == pytest.approx(dense_step, rel=REL)
    assert rows["topk-ef"].predicted.value == pytest.approx(topk_step, rel=REL)
    assert all(abs(r.relative_error) < 1e-9 for r in result.rows)
    off, _, _ = _emulated_run(tmp_path, "off", error=0.25)
    # predicted = measured / 1.25, so the relative error is 1/1.25 - 1 = -20%
    assert all(r.relative_error == pytest.approx(-0.2, rel=1e-9) for r in costmodel.validate(run_dir, off).rows)
    text = costmodel.format_validation(costmodel.validate(run_dir, off))
    assert "-20.0%" in text and "[modelled, boundary: step]" in text


def test_alpha_measured_in_the_source_run_is_the_smallest_sparse_arms_wait_per_message(run_dir, tmp_path):
    # topk-ef waited 1 ms; its unpack is 2 x K adds at UNPACK_RATE; one bucket, p - 1 = 1 message.
    alpha = 0.001 - 2 * K / UNPACK_RATE
    assert costmodel.measured_alpha_s(read_run(run_dir)) == pytest.approx(alpha, rel=REL)
    exact, _, _ = _emulated_run(tmp_path, "exact", error=0.0)
    result = costmodel.validate(run_dir, exact, alpha_from_run=True)
    rows = {r.arm: r for r in result.rows}
    assert result.scenario.alpha_s == pytest.approx(alpha, rel=REL)
    assert "measured in the source run" in costmodel.format_validation(result)
    assert rows["dense"].predicted.value == pytest.approx(0.031 + 2 * alpha + DENSE_BYTES / 1.25e8, rel=REL)
    dense_only = write_run(tmp_path / "dense-only", arms={"dense": DENSE})
    assert costmodel.measured_alpha_s(read_run(dense_only)) is None
    with pytest.raises(ValueError, match="--alpha-from-run needs a top-k arm"):
        costmodel.validate(dense_only, exact, alpha_from_run=True)


def test_validation_refuses_a_target_run_without_a_known_rate(run_dir, tmp_path):
    other = write_run(tmp_path / "no-link", arms={"dense": DENSE}, link=None)  # old run: no "link" field
    assert read_run(other).link == "loopback"
    with pytest.raises(ValueError, match="rate is unknown"):
        costmodel.validate(run_dir, other)


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_project_smoke(run_dir, capsys):
    assert cli.main(["project", str(run_dir), "--workers", "32", "--link", "1gbit", "--density", "0.005"]) == 0
    out = capsys.readouterr().out
    assert "MODELLED" in out and "topk-ef at other densities" in out
    table = out[out.index("topk-ef at other densities"):].splitlines()
    assert table[2].split()[:3] == ["0.005", "sparse", "allgather"]
    assert cli.main(["project", str(run_dir), "--workers", "32", "--link", "1gbit", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    steps = {p["arm"]: p["step"]["value"] for p in data["projected"]}
    assert steps["dense"] == pytest.approx(0.04805, rel=REL)
    assert steps["topk-ef"] == pytest.approx(0.038535, rel=REL)


def test_cli_against(run_dir, tmp_path, capsys):
    other, _, _ = _emulated_run(tmp_path, "emulated", error=0.1)
    assert cli.main(["project", str(run_dir), "--against", str(other), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "validation" and data["other_link"] == "1gbit"
    assert [a["relative_error"] for a in data["arms"]] == pytest.approx([1 / 1.1 - 1] * 2, rel=1e-9)


@pytest.mark.parametrize("extra, message", [
    (["--workers", "1", "--link", "1gbit"], "--workers must be an integer in [2, 1000000], got 1"),
    (["--workers", "32", "--link", "loopback"], "--link loopback has no known rate"),
    (["--workers", "32", "--link", "fast"], "--link: link must be 'loopback' or a rate"),
    (["--workers", "32", "--link", "1gbit", "--alpha-us", "-1"], "--alpha-us must be a number in [0, 1000000]"),
    (["--workers", "32", "--link", "1gbit", "--density", "0"], "--density values must be in (0, 1], got 0.0"),
    (["--workers", "32", "--link", "1gbit", "--unpack-rate", "0"], "--unpack-rate must be a finite number > 0"),
    (["--link", "1gbit"], "--workers and --link are required"),
    (["--workers", "32", "--against", "elsewhere"], "--against takes the world size and link from OTHER_RUN_DIR"),
    (["--workers", "32", "--link", "1gbit", "--alpha-from-run"], "--alpha-from-run is for --against OTHER_RUN_DIR"),
])
def test_cli_refuses_bad_arguments(run_dir, extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["project", str(run_dir), *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_reports_a_missing_run_directory(tmp_path, capsys):
    assert cli.main(["project", str(tmp_path / "nope"), "--workers", "4", "--link", "1gbit"]) == 2
    assert "is not a directory" in capsys.readouterr().err
