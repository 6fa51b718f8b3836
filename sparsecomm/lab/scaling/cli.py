"""``sparsecomm scale``: how each arm holds quality and traffic as the number of workers p grows.

Runs the paired experiment (dense + the other arms, same seeds and data order) once per
world size, each as its own experiment ``<experiment>-p<p>`` under --out, and reports per
(p, arm): the verdict against dense at that p (the equivalence test of ``sparsecomm
check``), the final metric's mean over seeds and its gap to dense, the bytes each rank sends
and receives per step, steps- and time-to-target (the ledger's, against a target derived at
each p from that p's dense runs), and per arm the growth of the bytes received per rank from
the smallest p to the largest. Then the bytes per rank per step the alpha-beta cost model
gives at p = 16, 32, ..., 1024 (modelled, never measured). Writes ``scaling.json``,
``scaling.md`` and ``scaling.png`` to ``<plots>/<experiment>-scaling/``::

    sparsecomm scale --experiment digits-quick --world-sizes 2 4 --arms dense topk-dgc sparseloco
    sparsecomm scale --experiment digits-quick --world-sizes 2 4 8 --seeds 0 1 2 --steps 200
    sparsecomm scale --experiment digits-quick --world-sizes 2 4 8 --batch global   # global batch fixed

What is fixed as p grows: by default the per-rank batch (``batch_size`` is per rank, so the
global batch is p x batch_size: weak scaling); ``--batch global`` fixes the global batch at
the smallest p's instead (batch_size x p_min / p per rank, refused when that does not divide;
its experiments are named ``<experiment>-p<p>-b<per-rank batch>`` where the batch differs).
The optimizer's settings (learning rate included) are the same at every p.

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
from sparsecomm.lab.scaling.study import BATCH_MODES, make_study
from sparsecomm.lab.sweep import UNAVAILABLE, run_and_read


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsecomm scale", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:5]))
    add_experiment_source(p)
    add_job_arguments(p, world_size=False)  # --world-sizes instead
    p.add_argument("--world-sizes", nargs="+", type=int, required=True, metavar="P",
                   help=f"numbers of workers to run at: at least two distinct integers in [2, "
                        f"{local_world_size_limit()}] on this machine (sorted for you)")
    p.add_argument("--batch", choices=BATCH_MODES, default="per-rank",
                   help="what stays fixed as p grows: per-rank (default; the config's batch_size is per rank, the "
                        "global batch is p x batch_size) or global (the smallest p's global batch, split over p)")
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
    try:  # every argument and every point's config, before the first launch
        study = make_study(args)
        check_writable_directory(args.out, "--out")
        check_writable_directory(args.plots / study.stem, "--plots")
        from sparsecomm.lab.experiment.runner import check_run_directories

        for p in study.world_sizes:
            check_run_directories(study.point_config(p), args.out)
    except (ValueError, TypeError, RuntimeError, OSError) as error:
        parser.error(str(error))
    from sparsecomm.lab.results.target import Target

    metric = Target(0.0, "", study.config.metric).metric_label

    def run_and_model():
        points = run_study(study, args.out)
        # The model starts from the largest p with a finished dense run (the cost model reads the target).
        model_p = next((p for p in reversed(study.world_sizes) if any(
            q.world_size == p and q.verdict != UNAVAILABLE for q in points)), None)
        modelled = [] if model_p is None else modelled_traffic(
            args.out / study.point_config(model_p).name, study.config.arms,
            sorted({*study.world_sizes, *MODELLED_WORLD_SIZES}), model_p)
        return points, model_p, modelled

    done, code = run_and_read("sparsecomm scale", run_and_model)
    if code is not None:
        return code
    points, model_p, modelled = done
    print()
    print(format_study(study, points, modelled, model_p, metric))
    folder = args.plots / study.stem
    folder.mkdir(parents=True, exist_ok=True)
    from sparsecomm.lab.experiment.files import write_bytes_atomically, write_json_atomically

    summary = folder / "scaling.json"
    write_json_atomically(summary, study_json(study, points, modelled, model_p, metric))
    write_bytes_atomically(folder / "scaling.md", markdown_study(study, points, modelled, model_p, metric).encode())
    figure = plot_study(study, points, modelled, folder / "scaling.png", metric)
    print(f"\nwrote {summary}, {folder / 'scaling.md'}\nplot: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
