"""Synthetic run directories in the layout ``sparsecomm compare`` writes (see sparsecomm.lab.results).

For tests of the readers (ledger, tolerance checker, plots) without training anything.
"""
import json
from pathlib import Path

DEFAULT_POLICY = {"quality_tolerance": 0.05, "staleness_limit": 1000, "redundancy_budget": 0.05}


def write_run_dir(
    root: Path,
    curves: dict[tuple[str, int], list[tuple[int, float, float]]],
    *,
    step_seconds: dict[str, float] | None = None,
    setup_seconds: float = 2.0,
    target_loss: float | None = None,
    policy: dict | None = None,
    failed: tuple[tuple[str, int], ...] = (),
    bytes_per_step: dict[str, float] | None = None,
    summary_extra: dict[str, dict] | None = None,
    link: str | None = None,
) -> Path:
    """Write ``root/experiment.json`` and one run per ``(arm, seed)``.

    ``curves[(arm, seed)]`` lists evaluations as (step, elapsed_seconds, val_loss); train
    rows are generated for every step up to the last evaluated one.
    """
    root.mkdir(parents=True, exist_ok=True)
    arms = sorted({arm for arm, _ in curves} | {arm for arm, _ in failed})
    seeds = sorted({seed for _, seed in curves} | {seed for _, seed in failed})
    config = {
        "name": root.name, "task": "synthetic", "arms": arms, "seeds": seeds, "world_size": 2,
        "steps": max(s for c in curves.values() for s, _, _ in c), "target_loss": target_loss,
        "policy": policy or DEFAULT_POLICY,
    }
    if link is not None:
        config["link"] = link
    (root / "experiment.json").write_text(json.dumps({"config": config, "environment": {"torch": "test"}}))
    for (arm, seed), evals in curves.items():
        run = root / "runs" / f"{arm}-seed{seed}-0123456789"
        run.mkdir(parents=True)
        per_step = (step_seconds or {}).get(arm, 0.1)
        sent = (bytes_per_step or {}).get(arm, 1000.0)
        rows = []
        eval_at = {s: (t, v) for s, t, v in evals}
        for step in range(1, max(eval_at) + 1):
            rows.append({"kind": "train", "step": step, "train_loss": 3.0 / step, "step_seconds": per_step,
                         "compute_seconds": per_step * 0.7, "compress_seconds": per_step * 0.1,
                         "comm_wait_seconds": per_step * 0.2, "bytes_sent": sent, "bytes_dense": 1000.0,
                         "elapsed_seconds": step * per_step})
            if step in eval_at:
                rows.append({"kind": "eval", "step": step, "val_loss": eval_at[step][1], "elapsed_seconds": eval_at[step][0]})
        (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {
            "arm": arm, "seed": seed, "status": "ok", "config_hash": "0123456789",
            "setup_seconds": setup_seconds, "median_step_seconds": per_step,
            "median_compute_seconds": per_step * 0.7, "median_compress_seconds": per_step * 0.1,
            "median_comm_wait_seconds": per_step * 0.2, "bytes_sent_per_step": sent,
            "bytes_dense_per_step": 1000.0, "evals": [list(e) for e in evals],
            **(summary_extra or {}).get(arm, {}),
        }
        (run / "summary.json").write_text(json.dumps(summary))
    for arm, seed in failed:
        run = root / "runs" / f"{arm}-seed{seed}-0123456789"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(
            {"arm": arm, "seed": seed, "status": "failed", "error": "RuntimeError: gloo timeout", "evals": []}))
    return root
