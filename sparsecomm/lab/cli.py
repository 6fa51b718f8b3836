"""``sparsecomm`` command line: ``sparsecomm <command> [options]``."""
import importlib
import sys

COMMANDS = {
    "compare": ("sparsecomm.lab.compare", "run a paired dense-vs-sparse experiment; print ledger, verdicts, plots"),
    "ledger": ("sparsecomm.lab.ledger", "print the time-to-quality ledger of a run directory"),
    "check": ("sparsecomm.lab.tolerance", "judge 'no loss' claims against a tolerance (TOST over seeds); exit code for CI"),
    "plot": ("sparsecomm.lab.plot_command", "draw time-to-loss, loss-vs-step and ledger plots of a run directory"),
    "tensorboard": ("sparsecomm.lab.tensorboard_export", "write a run's curves (loss, bytes, step times) as TensorBoard event files"),
    "frontier": ("sparsecomm.lab.frontier", "sweep densities x sparse techniques; the sparsest setting still equivalent"),
    "scale": ("sparsecomm.lab.scaling", "run the paired experiment at several world sizes; verdicts and bytes per rank vs p"),
    "run": ("sparsecomm.lab.experiment.run_command", "one arm x seed as one rank of a job started by mpiexec / srun / torchrun"),
    "project": ("sparsecomm.lab.costmodel.cli", "project a run to p workers on a link (alpha-beta model, labelled modelled)"),
}


def _usage() -> str:
    lines = ["usage: sparsecomm <command> [options]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "sparsecomm <command> --help for its options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"sparsecomm: unknown command {command!r}; choose one of {', '.join(COMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
