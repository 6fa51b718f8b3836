"""``sparsecomm`` command line: ``sparsecomm <command> [options]``."""
import sys

COMMANDS = {
    "demo": ("sparsecomm.demo", "2-rank DDP job on bundled digits: dense vs top-k+EF vs top-k without EF"),
}


def _usage() -> str:
    lines = ["usage: sparsecomm <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items()]
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
    import importlib

    return importlib.import_module(COMMANDS[command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
