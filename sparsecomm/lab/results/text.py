"""Text of the lab's printed output: every line fits in :data:`REPORT_WIDTH` columns.

The verdicts, the ledger and the report all fold their long lines with :func:`fold_lines`.
A leaf module, imported by each of them and importing none of them, so that the modules
that print never import one another for a line width.
"""
REPORT_WIDTH = 100
CONTINUATION = "      "  # indents the continuation lines of a folded line


def fold(line: str, width: int = REPORT_WIDTH, indent: str = CONTINUATION) -> list[str]:
    """``line`` cut into lines of at most ``width`` columns, after a semicolon or comma when
    one is in the second half of the line, else at a space; continuations start with ``indent``."""
    lines = []
    while len(line) > width:
        cut = _break_point(line, width, len(indent))
        lines.append(line[:cut].rstrip())
        line = indent + line[cut:].lstrip()
    return lines + [line]


def _break_point(line: str, width: int, indent: int) -> int:
    """Where to cut ``line`` so that the part before it, right-stripped, fits in ``width``."""
    window = line[: width + 1]  # a separator's space may sit just past the last column
    for separator in ("; ", ", "):
        at = window.rfind(separator)
        if at > width // 2:
            return at + len(separator)
    at = window.rfind(" ")
    # A space inside the indent would cut nothing off: the line would never get shorter.
    return at + 1 if at > indent else width


def fold_lines(lines: list[str], width: int = REPORT_WIDTH) -> list[str]:
    """Every line of ``lines`` folded (:func:`fold`); blank lines stay."""
    return [part for line in lines for part in fold(line, width)]
