"""Recovery time and lost work for a killed rank on the default task (not a test).

Runs the default task (byte-level GPT on pydoc_data) for each arm twice under torchrun
with --max-restarts=1 and a verified checkpoint every --checkpoint-every steps: once
clean, once with rank 1 killed after --fault-step. Prints, per arm: recovery time (fault
-> first completed step after the restore), restore time, lost (recomputed) steps,
checkpoint time per save, the wall-clock cost of the fault (faulted - clean total), and
whether the resumed run matched the clean one bit for bit. Writes the table as JSON.

    python experiments/bench_recovery.py --out bench_recovery.json
"""
import argparse
import json
import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from sparsecomm.lab.experiment.named import pydoc_gpt
from sparsecomm.lab.experiment.runner import _git_commit, run_experiment
from sparsecomm.lab.results import load_runs, load_steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=["dense", "topk-ef"], help="arms to measure (dense is required)")
    parser.add_argument("--steps", type=int, default=200, help="steps per run (>= 2)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="checkpoint cadence in steps (>= 1)")
    parser.add_argument("--fault-step", type=int, default=175, help="rank 1 is killed after this step")
    parser.add_argument("--out", type=Path, default=Path("bench_recovery.json"), help="JSON result file")
    args = parser.parse_args(argv)
    if not 1 <= args.fault_step <= args.steps:
        parser.error(f"--fault-step must be in [1, --steps={args.steps}], got {args.fault_step}")
    base = replace(pydoc_gpt(), arms=tuple(args.arms), seeds=(0,), steps=args.steps,
                   checkpoint_every=args.checkpoint_every, max_restarts=1, fault=None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clean = {r.arm: r for r in load_runs(run_experiment(base.with_overrides(name="clean"), Path(tmp)))}
        faulted_config = base.with_overrides(name="faulted", fault={"kind": "kill", "rank": 1, "step": args.fault_step})
        faulted = {r.arm: r for r in load_runs(run_experiment(faulted_config, Path(tmp)))}
        for arm in args.arms:
            c, f = clean[arm], faulted[arm]
            same = [r["train_loss"] for r in load_steps(c.path) if r["kind"] == "train"] == \
                   [r["train_loss"] for r in load_steps(f.path) if r["kind"] == "train"]
            rows.append({
                "arm": arm,
                "status": f.status,
                "recovery_seconds": f.extra.get("recovery_seconds"),
                "restore_seconds": f.extra.get("restore_seconds"),
                "lost_steps": f.extra.get("lost_steps"),
                "checkpoint_seconds_per_save": f.extra["checkpoint_seconds"] / max(1, f.extra["num_checkpoints"]),
                "fault_cost_seconds": f.extra["total_seconds"] - c.extra["total_seconds"],
                "step_seconds": f.median_step_seconds,
                "bit_exact": same and f.final_val_loss == c.final_val_loss,
            })
    header = f"{'arm':<10} {'recovery s':>10} {'restore s':>9} {'lost steps':>10} {'ckpt s/save':>11} {'fault cost s':>12} {'bit exact':>9}"
    print(header)
    for r in rows:
        print(f"{r['arm']:<10} {r['recovery_seconds']:>10.2f} {r['restore_seconds']:>9.3f} {r['lost_steps']:>10} "
              f"{r['checkpoint_seconds_per_save']:>11.3f} {r['fault_cost_seconds']:>12.2f} {str(r['bit_exact']):>9}")
    args.out.write_text(json.dumps({"torch": torch.__version__, "machine": platform.machine(), "python": platform.python_version(),
                                    "git_commit": _git_commit(), "config": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
