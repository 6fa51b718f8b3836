"""Every link and every repository path that README.md and docs/ name exists.

Checked: markdown links and images (relative to the document; a ``#section`` must be a
heading of the target, as GitHub writes its anchor), and paths written in code, inline or in
fenced blocks, that start at a top-level folder of the repository (``sparsecomm/...``,
``docs/...``, ``experiments/...``) or at a subpackage of ``sparsecomm`` (``hooks/state/settings.py``). Paths with a placeholder (``<experiment>``, ``*``,
``{a,b}``) and web addresses are not checked. Reads files only: no torch.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP_LEVEL = ("sparsecomm/", "csrc/", "docs/", "experiments/", "scripts/", "tests/")
SUBPACKAGES = tuple(f"{p.name}/" for p in (ROOT / "sparsecomm").iterdir() if (p / "__init__.py").is_file())

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_PLACEHOLDER = re.compile(r"[<>*{}$]")


def _ids(path: Path) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in path]


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown`` (lower case, punctuation dropped,
    spaces as hyphens; a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", _FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(text: str) -> list[str]:
    return [target for target in _LINK.findall(_FENCE.sub("", text))
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto:


def _code_paths(text: str) -> set[str]:
    code = [*_FENCE.findall(text), *_INLINE_CODE.findall(_FENCE.sub("", text))]
    paths = set()
    for block in code:
        for token in re.split(r"[\s\"'(),=\[\]]+", block):
            token = token.rstrip(".:;")
            if _PLACEHOLDER.search(token):
                continue
            if token.startswith(TOP_LEVEL):
                paths.add(token.split("::")[0])
            elif token.startswith(SUBPACKAGES):  # written relative to the package, as docs/architecture.md does
                paths.add("sparsecomm/" + token.split("::")[0])
    return paths


@pytest.mark.parametrize("document", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_every_link_points_to_an_existing_file_and_section(document):
    text = document.read_text()
    broken = []
    for target in _links(text):
        path_part, _, anchor = target.partition("#")
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.relative_to(ROOT)}")
    assert broken == []


@pytest.mark.parametrize("document", DOCUMENTS, ids=_ids(DOCUMENTS))
def test_every_repository_path_named_in_code_exists(document):
    missing = sorted(p for p in _code_paths(document.read_text()) if not (ROOT / p).exists())
    assert missing == []


def test_the_checks_see_links_anchors_and_paths():
    text = "See [a](docs/lab.md#the-lab), ![f](figures/x.png), `hooks/state/settings.py` and `python experiments/bench_links.py --x 1`.\n" \
           "```bash\nsparsecomm compare --config experiments/configs/<name>.json\n```\n[w](https://example.org)"
    assert _links(text) == ["docs/lab.md#the-lab", "figures/x.png"]
    assert _code_paths(text) == {"experiments/bench_links.py", "sparsecomm/hooks/state/settings.py"}
    assert _anchors("# The lab: paired runs\n## `bench_links.py`: where it pays\n## Twice\n## Twice\n") == {
        "the-lab-paired-runs", "bench_linkspy-where-it-pays", "twice", "twice-1"}


def test_every_document_under_docs_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(readme)}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert unlinked == []
