"""The report's last section, where compression pays: each equivalent arm's modelled break-even
link rate against dense, the command that measures it, and the cases without one.

Run directories are synthetic (tests/run_dir_fixture.py: compute 0.7 and compress 0.1 of the
step; dense sends D = 1000 bytes per step; 2 ranks; target 1.5). Every expected figure is
worked by hand from the alpha-beta formulas, at p = 2 and one bucket per step (D is far under
DDP's 25 MB bucket):

- dense: ring allreduce, step = compute + compress + 2 (p-1) alpha + 2 (p-1)/p D / B;
- a top-k arm sending s bytes: ring allgather, step = compute + compress + (p-1) alpha + (p-1) s / B;
- time to target = steps-to-target x step, so the arm is sooner below the rate B where
  n_arm x step_arm(B) = n_dense x step_dense(B).
"""
import json

import pytest

from run_dir_fixture import write_run_dir
from sparsecomm.lab.costmodel.breakeven_report import break_even_lines, link_just_below
from sparsecomm.lab.results.text import REPORT_WIDTH
from sparsecomm.links import parse_link

SEEDS = (0, 1, 2, 3)
ALPHA = 25e-6  # the model's default per message: loopback names no latency
LABEL = "[modelled, boundary: time_to_target]"
TOPK = {"hook": "sparsecomm topk_hook density 0.05"}  # read as a top-k arm: its bytes travel by all-gather


def _curves(arm: str, seed: int, reach: int | None, elapsed: float) -> list[tuple[int, float, float]]:
    """Evaluations (step, elapsed, val loss): the target 1.5 first reached at step ``reach``
    (None: never; the arm ends worse than dense), after ``elapsed`` seconds; dense ends at
    1.40 + 0.01 seed, an equivalent arm at 1.41 + 0.012 seed (inside the tolerance 0.05)."""
    if arm == "dense":
        return [(10, 1.0, 2.0), (20, 2.0 + seed, 1.5), (30, 3.0 + seed, 1.40 + 0.01 * seed)]
    if reach is None:
        return [(10, 0.5, 2.6), (20, 1.5, 2.2), (30, 2.5, 2.0 + 0.013 * seed)]
    losses = {10: 2.1, 20: 1.5 if reach == 20 else 1.6, 30: 1.41 + 0.012 * seed}
    return [(step, elapsed if step == reach else step / 10, loss) for step, loss in losses.items()]


def _section(tmp_path, arms: dict, *, link: str | None = None, config: dict | None = None) -> list[str]:
    """``arms[name] = dict(step=, sent=, reach=, elapsed=, extra=)``; dense: step 1 ms, 1000 bytes."""
    arms = {"dense": dict(step=0.001, sent=1000.0, reach=20, elapsed=0.0), **arms}
    curves = {(arm, seed): _curves(arm, seed, a["reach"], a["elapsed"]) for arm, a in arms.items() for seed in SEEDS}
    run_dir = write_run_dir(tmp_path / "exp", curves, target_loss=1.5, link=link,
                            step_seconds={arm: a["step"] for arm, a in arms.items()},
                            bytes_per_step={arm: a["sent"] for arm, a in arms.items()},
                            summary_extra={arm: a["extra"] for arm, a in arms.items() if a.get("extra")})
    if config:
        experiment = json.loads((run_dir / "experiment.json").read_text())
        experiment["config"].update(config)
        (run_dir / "experiment.json").write_text(json.dumps(experiment))
    lines = break_even_lines(run_dir)
    assert lines[0].startswith(f"where compression pays {LABEL}: the link rate per rank below which")
    assert max(map(len, lines)) <= REPORT_WIDTH
    return lines


def _text(lines: list[str]) -> str:
    """The section as one line, folds undone."""
    return " ".join(" ".join(lines).split())


def _command(lines: list[str], after: str) -> tuple[str, int]:
    """The command printed on the lines after the line ``after`` (its shell continuations
    joined) and the number of lines it takes."""
    at = lines.index(after) + 1
    end = at
    while lines[end].endswith(" \\"):
        end += 1
    return " ".join(line.removesuffix(" \\").strip() for line in lines[at:end + 1]), end + 1 - at


def test_a_sparse_arm_slower_on_loopback_pays_below_its_break_even_and_the_command_measures_it(tmp_path):
    # topk-ef: step 2 ms (compute 1.4 ms, compress 0.2 ms), 100 bytes per step, target at step 30;
    # dense: step 1 ms (0.7 + 0.1 ms), 1000 bytes, target at step 20.
    lines = _section(tmp_path, {"topk-ef": dict(step=0.002, sent=100.0, reach=30, elapsed=4.0, extra=TOPK),
                                "topk-noef": dict(step=0.002, sent=100.0, reach=None, elapsed=0.0, extra=TOPK)})
    fixed_arm = 0.0014 + 0.0002 + 1 * ALPHA  # 1.625 ms: (p-1) alpha for the all-gather
    fixed_dense = 0.0007 + 0.0001 + 2 * 1 * ALPHA  # 0.85 ms: 2 (p-1) alpha for the allreduce
    bytes_arm, bytes_dense = 1 * 100.0, 2 * 1 / 2 * 1000.0  # (p-1) s and 2 (p-1)/p D
    # 30 (1.625 ms + 100 / B) = 20 (0.85 ms + 1000 / B)  =>  B = 17000 / 0.03175 bytes/s
    rate_bits = 8 * (20 * bytes_dense - 30 * bytes_arm) / (30 * fixed_arm - 20 * fixed_dense)
    assert rate_bits == pytest.approx(4.2835e6, rel=1e-4)
    text = _text(lines)
    assert ("assumptions: 2 workers (the run's world size); alpha 25 us per message (assumed: the link names "
            "no latency; a typical TCP ethernet message); communication not overlapped with compute") in text
    assert f"  topk-ef: below 4.28 Mbit/s {LABEL}" in lines
    # the command: the arm and dense at the two-digit rate just under 4.28 Mbit/s, as a new experiment
    command = "sparsecomm compare --config FILE --arms dense topk-ef --link 4.2mbit --name exp-4.2mbit"
    assert _command(lines, f"  topk-ef: below 4.28 Mbit/s {LABEL}") == (command, 1)
    assert parse_link("4.2mbit").rate_bits_per_s < rate_bits
    assert text.endswith(f"FILE: this run's config, the \"config\" object of {tmp_path / 'exp' / 'experiment.json'}")
    assert "topk-noef" not in text  # worse than dense: no break-even for it


def test_alpha_is_the_links_latency_and_the_command_keeps_it(tmp_path):
    # The same arms measured over 1gbit@100us: alpha = 100 us, so the fixed costs become
    # 1.6 + 0.1 = 1.7 ms (arm) and 0.8 + 0.2 = 1.0 ms (dense): B = 17000 / (30 x 1.7 ms - 20 x 1.0 ms).
    lines = _section(tmp_path, {"topk-ef": dict(step=0.002, sent=100.0, reach=30, elapsed=4.0, extra=TOPK)},
                     link="1gbit@100us", config={"max_restarts": 1, "fault": {"kind": "kill", "rank": 1, "step": 5}})
    assert 8 * 17000 / (30 * 0.0017 - 20 * 0.0010) == pytest.approx(4.387e6, rel=1e-3)
    text = _text(lines)
    assert "alpha 100 us per message (the link's latency)" in text
    assert "as measured on 1gbit@100us" in text
    # one line too long: folded with a shell continuation, so that it still runs when pasted
    assert _command(lines, f"  topk-ef: below 4.39 Mbit/s {LABEL}") == (
        "sparsecomm compare --config FILE --arms dense topk-ef --link 4.3mbit@100us --name exp-4.3mbit-100us", 2)
    # This experiment restarts after an injected fault, which an emulated link refuses: the file must not.
    assert text.endswith("experiment.json, with max_restarts 0 and fault null (an emulated link cannot restart a run)")


def test_an_arm_already_sooner_on_loopback_says_so(tmp_path):
    # bf16-like: an allreduce of 500 bytes, step 0.8 ms (0.56 + 0.08 ms + 2 alpha = 0.69 ms fixed,
    # under dense's 0.85 ms) and target at step 20 as dense: cheaper at every rate; measured on
    # loopback it reached the target after 1.5 s in every seed, dense after 2, 3, 4, 5 s (median 3.5).
    lines = _section(tmp_path, {"half": dict(step=0.0008, sent=500.0, reach=20, elapsed=1.5)})
    assert _text(lines).endswith(f"half: sooner at every rate, 1 kbit/s to 10 Tbit/s {LABEL}; already sooner "
                                 "than dense on loopback (measured: 1.5 s vs 3.5 s to the target)")
    assert "sparsecomm compare" not in _text(lines)  # no break-even to measure


def test_an_arm_that_computes_more_and_sends_as_much_as_dense_never_pays(tmp_path):
    # heavy: an allreduce of dense's 1000 bytes with a 2 ms step, target at step 20.
    # Without transfers: 20 x (1.4 + 0.2 ms + 2 alpha) = 33.0 ms against dense's 20 x 0.85 ms = 17.0 ms;
    # transferred per rank to the target: 20 x 2 (p-1)/p x 1000 bytes = 20 kB each.
    lines = _section(tmp_path, {"heavy": dict(step=0.002, sent=1000.0, reach=20, elapsed=6.0)})
    assert _text(lines).endswith(
        f"heavy: never {LABEL}: no rate from 1 kbit/s to 10 Tbit/s favours it; without transfers (compute + "
        "compress + unpack + latency per message) it takes 33.0 ms to the target against dense's 17.0 ms; it "
        "transfers 20.00 kB per rank against dense's 20.00 kB")


def test_arms_without_a_break_even_say_why(tmp_path):
    loco = {"arm_spec": {"name": "loco", "reducer": "sparse-delta", "options": {}, "optimizer": {}}}
    lines = _section(tmp_path, {
        # 600 bytes per rank: p x s = 1200 >= D = 1000, so the hook allreduces densely (density 600 / 8 / 250)
        "dense-ish": dict(step=0.002, sent=600.0, reach=20, elapsed=6.0, extra=TOPK),
        "loco": dict(step=0.002, sent=50.0, reach=20, elapsed=6.0, extra=loco),
    })
    assert "  dense-ish: no break-even: at 2 workers density 0.3 falls back to dense" in lines
    assert "  loco: not modelled: it trains locally and syncs once per period, which the model does not cover" in lines


def test_a_sharded_run_is_not_modelled(tmp_path):
    lines = _section(tmp_path, {"topk-ef": dict(step=0.002, sent=100.0, reach=30, elapsed=4.0, extra=TOPK)},
                     config={"parallelism": "hsdp:2x1"})
    assert _text(lines).endswith("than dense not modelled: parallelism hsdp:2x1: the model has one reduction over "
                                 "all ranks per bucket, as DDP's, not FSDP's traffic within and across replicas")


def test_without_an_equivalent_arm_no_break_even_is_printed(tmp_path):
    lines = _section(tmp_path, {"topk-noef": dict(step=0.002, sent=100.0, reach=None, elapsed=0.0, extra=TOPK)})
    assert _text(lines).endswith("than dense no arm is equivalent to dense (or better), so no break-even is "
                                 "printed: a faster arm that loses quality is no win")
    assert "assumptions" not in _text(lines) and "sparsecomm compare" not in _text(lines)


@pytest.mark.parametrize("bits, name", [
    (4.12e8, "410mbit"),  # two significant digits, rounded down
    (4.1e8, "400mbit"),  # already two digits: the next one down, strictly below
    (1e9, "990mbit"),  # a power of ten: two digits of the decade below
    (1.25e9, "1.2gbit"),
    (1050.0, "1kbit"),
    (1000.0, None),  # 990 bit/s: under the slowest rate a link takes
])
def test_the_rate_just_below_is_one_that_link_accepts(bits, name):
    assert link_just_below(bits) == name
    if name is not None:
        assert parse_link(name).rate_bits_per_s < bits
