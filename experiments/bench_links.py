"""Step time and time-to-target of every arm over loopback and emulated links (not a test).

For the default task (byte-level GPT on pydoc_data, 2 ranks), runs the paired experiment
once per link: loopback, then each emulated link (one network namespace per rank, shaped
with tc; needs root). No checkpoints or faults: this measures the training step and the
time to the quality target. Prints, per link:

- the rate one TCP stream between the ranks really reached (the link, measured);
- per arm: median step, comm wait, bytes sent per step, steps- and time-to-target, the
  time-to-target ratio to dense fp32 over the same link (geometric mean of per-seed
  ratios; < 1: the arm reaches the target sooner) and the "no loss" verdict (TOST);
- the cost model's prediction of each emulated link's step times from the loopback run
  (``sparsecomm project --against``), with its relative error.

Every figure is measured in this one invocation (the run root is fresh unless --out
points at an earlier one, whose finished runs are then reused and reported as such).

    python experiments/bench_links.py                        # ~25 min on 2 cores
    python experiments/bench_links.py --links loopback 1gbit --arms dense topk-dgc --seeds 0 --steps 100
"""
import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from sparsecomm.lab import costmodel, ledger, tolerance
from sparsecomm.lab.experiment.config import ARM_NAMES
from sparsecomm.lab.experiment.named import pydoc_gpt
from sparsecomm.lab.experiment.runner import _git_commit, run_experiment
from sparsecomm.links import parse_link
from sparsecomm.links.netns import check_emulation_possible, maybe_emulated
from sparsecomm.links.probe import stream_throughput
from sparsecomm.lab.results.target import DENSE_ARM

DEFAULT_ARMS = ("dense", "dense-bf16", "powersgd", "topk-ef", "topk-dgc")


def _probe(link) -> float:
    with maybe_emulated(link, 2) as network:
        return stream_throughput(network, 32 << 20 if (link.rate_bits_per_s or 1e12) >= 1e9 else 4 << 20)


def _rows(run_dir: Path) -> list[dict]:
    built = ledger.build_ledger(run_dir)
    report = tolerance.check(run_dir) if len(built.arms) > 1 else None
    verdicts = {a.arm: a for a in report.arms} if report else {}
    comm = {inputs.arm: inputs for inputs in costmodel.read_run(run_dir).arms}
    rows = []
    for a in built.arms:
        checked = verdicts.get(a.arm)
        rows.append({
            "arm": a.arm,
            "runs_ok": a.num_ok,
            "step_seconds": a.step.value,
            "comm_wait_seconds": comm[a.arm].comm_wait_s if a.arm in comm else None,
            "bytes_per_step": a.bytes_per_step.value,
            "steps_to_target": a.steps_to_target.value,
            "time_to_target_seconds": a.time_to_target.value,
            "time_to_target_ratio": checked.time_ratio.geo_mean if checked else (1.0 if a.arm == DENSE_ARM else None),
            "time_ratio_range": [checked.time_ratio.min, checked.time_ratio.max] if checked else None,
            "verdict": checked.equivalence.verdict if checked else "(baseline)",
            "loss_diff": checked.equivalence.mean_diff if checked else None,
        })
    return rows


def _fmt(value, scale=1.0, spec=".1f", none="n/a") -> str:
    return none if value is None else format(value * scale, spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", nargs="+", default=["loopback", "10gbit", "1gbit"],
                        help="links to measure (loopback and/or emulated rates such as 1gbit)")
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=ARM_NAMES,
                        help="arms (dense is required: it is every arm's pair)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (3 for a verdict)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the task's 400)")
    parser.add_argument("--out", type=Path, default=None, help="run root (default: a fresh temporary folder)")
    parser.add_argument("--json", type=Path, default=Path("bench_links.json"), help="JSON result file")
    args = parser.parse_args(argv)
    try:
        links = [parse_link(name) for name in args.links]
        for link in links:
            check_emulation_possible(link)
        base = replace(pydoc_gpt(), arms=tuple(args.arms), seeds=tuple(args.seeds), checkpoint_every=0,
                       max_restarts=0, fault=None)
        base = base.with_overrides(steps=args.steps)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        results = []
        for link in links:
            started = time.perf_counter()
            measured_rate = _probe(link)
            print(f"== link {link}: one TCP stream between the ranks measured {measured_rate / 1e9:.2f} Gb/s", flush=True)
            run_dir = run_experiment(base.with_overrides(name=f"{base.name}-link-{link}", link=link.name), root,
                                     progress=lambda line: print("  " + line, flush=True))
            results.append({"link": link.name, "measured_stream_bits_per_s": measured_rate, "run_dir": str(run_dir),
                            "seconds": time.perf_counter() - started, "arms": _rows(run_dir)})
        validations = []
        source = next((r for r in results if r["link"] == "loopback"), None)
        for result in results:
            if source is None or result["link"] == "loopback":
                continue
            for alpha_from_run in (False, True):
                check = costmodel.validate(source["run_dir"], result["run_dir"], alpha_from_run=alpha_from_run)
                validations.append({"link": result["link"], "alpha_us": check.scenario.alpha_s * 1e6,
                                    "alpha_source": check.scenario.alpha_source, "rows": [
                    {"arm": row.arm, "predicted_step_seconds": row.predicted.value,
                     "measured_step_seconds": row.measured_step_s, "relative_error": row.relative_error}
                    for row in check.rows]})
    _print_tables(results, validations)
    args.json.write_text(json.dumps({
        "config": {**base.to_dict(), "links": args.links},
        "environment": {"python": platform.python_version(), "machine": platform.machine(), "commit": _git_commit()},
        "links": results, "model_validation": validations,
    }, indent=1))
    print(f"\nwritten: {args.json}")
    return 0


def _print_tables(results: list[dict], validations: list[dict]) -> None:
    print("\nper link and arm (medians over seeds; time-to-target includes evaluation; ratio: arm/dense fp32 over "
          "the same link, geometric mean of per-seed ratios)")
    header = (f"{'link':<9} {'arm':<11} {'step ms':>8} {'comm wait ms':>12} {'sent/step':>10} {'steps':>6} "
              f"{'t2t s':>7} {'t2t/dense':>9} {'verdict':>13}")
    print(header)
    for result in results:
        for row in result["arms"]:
            print(f"{result['link']:<9} {row['arm']:<11} {_fmt(row['step_seconds'], 1e3):>8} "
                  f"{_fmt(row['comm_wait_seconds'], 1e3):>12} {_fmt(row['bytes_per_step'], 1e-3, '.1f') + ' kB' if row['bytes_per_step'] is not None else 'n/a':>10} "
                  f"{_fmt(row['steps_to_target'], 1, '.0f'):>6} {_fmt(row['time_to_target_seconds']):>7} "
                  f"{_fmt(row['time_to_target_ratio'], 1, '.2f'):>9} {row['verdict']:>13}")
    print("\nwhere each arm reaches the target sooner than dense fp32 with verdict 'equivalent':")
    arms = [row["arm"] for row in results[0]["arms"] if row["arm"] != DENSE_ARM] if results else []
    for arm in arms:
        wins = [r["link"] for r in results for row in r["arms"] if row["arm"] == arm and row["verdict"] == "equivalent"
                and row["time_to_target_ratio"] is not None and row["time_to_target_ratio"] < 1]
        print(f"  {arm:<11} {', '.join(wins) if wins else 'on none of the links measured'}")
    for alpha_source in dict.fromkeys(v["alpha_source"] for v in validations):
        chosen = [v for v in validations if v["alpha_source"] == alpha_source]
        print(f"\ncost model (sparsecomm project --against) predicting each emulated link's step from the loopback "
              f"run, alpha {chosen[0]['alpha_us']:.0f} us per message ({alpha_source}):")
        print(f"  {'link':<9} {'arm':<11} {'predicted ms':>12} {'measured ms':>11} {'error':>7}")
        for v in chosen:
            for row in v["rows"]:
                print(f"  {v['link']:<9} {row['arm']:<11} {row['predicted_step_seconds'] * 1e3:>12.1f} "
                      f"{row['measured_step_seconds'] * 1e3:>11.1f} {row['relative_error']:>+7.1%}")
        errors = [abs(row["relative_error"]) for v in chosen for row in v["rows"]]
        print(f"  mean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%} over {len(errors)} (link, arm) pairs")


if __name__ == "__main__":
    sys.exit(main())
