"""``sparsecomm scale``: does sparse pay at p workers? Each arm's quality, traffic and time to target as p grows.

Runs the paired experiment (dense + the other arms, same seeds and data order) once per
world size, each as its own experiment ``<experiment>-p<p>`` under --out, and reports per
(p, arm): the verdict against dense at that p (the equivalence test of ``sparsecomm
check``), the final metric's mean over seeds and its gap to dense, the bytes each rank sends
and receives per step, steps- and time-to-target (the ledger's, against a target derived at
each p from that p's dense runs). Then per arm: its scaling capture, the share of dense's gain
from the smallest p to each larger p that it keeps, (L_arm(p_min) - L_arm(p)) / (L_dense(p_min)
- L_dense(p)) per paired seed, mean and 90% CI ("undefined" where dense gains nothing, or
within noise); the growth of its bytes received per rank from the smallest p, and that growth
over a ring allreduce's 2(p-1)/p (dense's own); with --model-link, its time to target at each
p on that link with the step MODELLED (compute and select/pack measured at the smallest p,
communication by the alpha-beta cost model from the bytes measured at p) and its ratio to
dense's; and the bytes per rank per step the cost model gives at p = 16, 32, ..., 1024
(modelled, never measured). Writes ``scaling.json``, ``scaling.md`` and ``scaling.png`` to
``<plots>/<experiment>-scaling/``::

    sparsecomm scale --experiment digits-quick --world-sizes 2 4 --arms dense topk-dgc sparseloco
    sparsecomm scale --experiment digits-quick --world-sizes 2 4 8 --seeds 0 1 2 --steps 200
    sparsecomm scale --experiment digits-quick --world-sizes 2 4 8 --batch global   # global batch fixed
    sparsecomm scale --experiment digits-quick --world-sizes 2 4 8 --batch both --step-budget 2 \\
        --model-link 100mbit 1gbit

What is fixed as p grows: by default the per-rank batch (``batch_size`` is per rank, so the
global batch is p x batch_size: weak scaling); ``--batch global`` fixes the global batch at
the smallest p's instead (batch_size x p_min / p per rank, refused when that does not divide;
its experiments are named ``<experiment>-p<p>-b<per-rank batch>`` where the batch differs);
``--batch both`` runs both studies, one after the other, and reports each in its own folder
(the smallest p's experiment is the same in both and runs once). The optimizer's settings
(learning rate included) are the same at every p.

Step budget: ``--step-budget X`` (a number >= 1; default 1) trains every arm but dense X times
dense's steps (rounded to a whole step), so that an arm worse than dense where dense stops
still shows when it reaches dense's target. Verdict, gap, final metric and capture are taken
at dense's step count (every run is evaluated there); steps- and time-to-target use the whole
run. The lab's learning rate is constant (no schedule), so the first steps of the longer run
are the shorter run's, bit for bit. Its experiments and folder carry ``-budget<X>x``.

Bytes per rank per step (rank 0's): sent is the run's measured mean over the steps after
warm-up (the meter around every arm's hook, as in the ledger); received comes from the
hook's own counters: the top-k hook's last completed step, or a sparse-delta averager's
total over its steps. Torch's hooks (dense, fp16/bf16, PowerSGD) count no received bytes,
so theirs is derived as a ring allreduce of what they send, 2 (p-1)/p x sent (how the top-k
hook counts its own dense calls), and labelled derived.

Re-running with the same arguments reuses the finished runs. Runs that did not finish are
counted per (p, arm); a p whose dense runs all failed has the verdict ``unavailable``.
Exit codes: 0 the study was printed; 2 a bad argument or an unreadable result file; 130 /
143 stopped by Ctrl-C / SIGTERM (what was kept is printed).
"""
import argparse
import sys
from pathlib import Path

from sparsecomm.lab.compare import (
    add_job_arguments,
    add_link_argument,
    add_parallelism_argument,
    check_writable_directory,
    local_world_size_limit,
    parse_arguments,
)
from sparsecomm.lab.experiment.config_source import add_experiment_source
from sparsecomm.lab.scaling.format import format_study, markdown_study, plot_study, study_json
from sparsecomm.lab.scaling.modelled import MODELLED_WORLD_SIZES, modelled_traffic
from sparsecomm.lab.scaling.points import run_study
from sparsecomm.lab.scaling.link_ledger import link_ledger
from sparsecomm.lab.scaling.study import BATCH_MODES, BOTH_BATCH_MODES, make_studies
from sparsecomm.lab.sweep import UNAVAILABLE, run_and_read


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsecomm scale", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    add_experiment_source(p)
    add_job_arguments(p, world_size=False)  # --world-sizes instead
    p.add_argument("--world-sizes", nargs="+", type=int, required=True, metavar="P",
                   help=f"numbers of workers to run at: at least two distinct integers in [2, "
                        f"{local_world_size_limit()}] on this machine (sorted for you)")
    p.add_argument("--batch", choices=(*BATCH_MODES, BOTH_BATCH_MODES), default="per-rank",
                   help="what stays fixed as p grows: per-rank (default; the config's batch_size is per rank, the "
                        "global batch is p x batch_size), global (the smallest p's global batch, split over p), or "
                        "both (the two studies in one command, each reported in its own folder)")
    p.add_argument("--step-budget", type=float, metavar="X",
                   help="every arm but dense trains X times dense's steps (a number >= 1; default 1, or the "
                        "config's step_budget); verdicts at dense's step count, steps/time to target over the "
                        "whole run")
    p.add_argument("--model-link", nargs="+", metavar="LINK",
                   help="links to model the time to target on, per p and arm (the step MODELLED: compute measured "
                        "at the smallest p, communication by the alpha-beta model), e.g. 100mbit 1gbit 10gbit@50us; "
                        "default: --link when it is emulated, else none")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="arms to compare (default: the experiment's): presets, arms the --config defines, or "
                        "NAME=REDUCER[:key=value,...]; dense is always run, as the baseline")
    p.add_argument("--seeds", nargs="+", type=int, help="override the seeds (integers in [0, 2**32 - 1])")
    p.add_argument("--steps", type=int, help="override the steps per run (>= 1)")
    add_link_argument(p)
    add_parallelism_argument(p)
    p.add_argument("--out", type=Path, default=Path("runs"), help="root of run directories (default: ./runs)")
    p.add_argument("--plots", type=Path, default=Path("plots"),
                   help="root of plot folders (default: ./plots); the study goes to <plots>/<experiment>-scaling/")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    try:  # every argument and every point's config, of every study, before the first launch
        studies = make_studies(args)
        check_writable_directory(args.out, "--out")
        from sparsecomm.lab.experiment.runner import check_run_directories

        for study in studies:
            check_writable_directory(args.plots / study.stem, "--plots")
            for p in study.world_sizes:
                check_run_directories(study.point_config(p), args.out)
    except (ValueError, TypeError, RuntimeError, OSError) as error:
        parser.error(str(error))
    for study in studies:
        code = run_and_report(study, args.out, args.plots)
        if code:
            return code
    return 0


def run_and_report(study, out: Path, plots: Path) -> int:
    """Run what is missing of one study, then print and write its report: the exit code."""
    from sparsecomm.lab.results.target import Target

    metric = Target(0.0, "", study.config.metric).metric_label

    def run_and_model():
        points = run_study(study, out)
        # The model starts from the largest p with a finished dense run (the cost model reads the target).
        model_p = next((p for p in reversed(study.world_sizes) if any(
            q.world_size == p and q.verdict != UNAVAILABLE for q in points)), None)
        modelled = [] if model_p is None else modelled_traffic(
            out / study.point_config(model_p).name, study.config.arms,
            sorted({*study.world_sizes, *MODELLED_WORLD_SIZES}), model_p)
        run_dirs = {p: out / study.point_config(p).name for p in study.world_sizes}
        batches = {p: study.batch_size(p) for p in study.world_sizes}
        ledgers = [link_ledger(run_dirs, study.config.arms, link, batches) for link in study.model_links]
        return points, model_p, modelled, ledgers

    done, code = run_and_read("sparsecomm scale", run_and_model)
    if code is not None:
        return code
    points, model_p, modelled, ledgers = done
    print()
    print(format_study(study, points, modelled, model_p, metric, ledgers))
    folder = plots / study.stem
    folder.mkdir(parents=True, exist_ok=True)
    from sparsecomm.lab.experiment.files import write_bytes_atomically, write_json_atomically

    summary = folder / "scaling.json"
    write_json_atomically(summary, study_json(study, points, modelled, model_p, metric, ledgers))
    write_bytes_atomically(folder / "scaling.md",
                           markdown_study(study, points, modelled, model_p, metric, ledgers).encode())
    figure = plot_study(study, points, modelled, folder / "scaling.png", metric)
    print(f"\nwrote {summary}, {folder / 'scaling.md'}\nplot: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
