"""Rewrite the options table of docs/options.md from the option table in the code
(sparsecomm/hooks/state/settings.py, TopKConfig's fields): ``python scripts/options_table.py``.

The table sits between two marker lines; everything else in the page is left as it is.
tests/test_options_table.py fails when the page and the code disagree.
"""
from pathlib import Path

from sparsecomm.hooks.state.settings import TopKConfig
from sparsecomm.hooks.state.settings import markdown_table

BEGIN = "<!-- options table: written by scripts/options_table.py from the code; edit the code, not this -->"
END = "<!-- end of the options table -->"


def main() -> None:
    page = Path(__file__).resolve().parents[1] / "docs" / "options.md"
    text = page.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{markdown_table(TopKConfig)}{END}{tail}")


if __name__ == "__main__":
    main()
