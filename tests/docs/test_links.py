"""Every relative Markdown link in README.md, CONTRIBUTING.md and docs/*.md resolves: the
file (or folder) it names exists, and its ``#anchor`` is a heading of that page, as GitHub
makes anchors from headings (issue 42: pages split and sections moved)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

pytestmark = pytest.mark.timeout(30)  # a hang guard: reading a few pages takes milliseconds

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); a target with no spaces, an optional "title".
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The page without its code blocks and inline code, where ``](`` is not a link."""
    return CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces made ``-``; a repeated one gets ``-1``, ``-2``..."""
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        base, n = slug, 0
        while slug in found:
            n += 1
            slug = f"{base}-{n}"
        found.add(slug)
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text(encoding="utf-8"))) if not re.match(r"[a-z]+:", t)]


def test_the_slugs_are_githubs() -> None:
    assert anchors(ROOT / "docs" / "benchmarks.md") >= {"cpu-2-cores-no-gpu-torch-213-2026-12-04", "method"}
    assert "crossing-torchmultiprocessing-without-a-copy" in anchors(ROOT / "docs" / "concepts.md")


def test_the_check_finds_links() -> None:
    """Not vacuous: the pages do link to each other, with anchors."""
    every = [t for page in PAGES for t in links(page)]
    assert sum("#" in t for t in every) >= 10, every


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_index_lists_every_page() -> None:
    """docs/index.md, where each kind of reader starts, links every page of docs/."""
    listed = {Path(t.partition("#")[0]).name for t in links(ROOT / "docs" / "index.md")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert not pages - listed, f"pages docs/index.md does not list: {sorted(pages - listed)}"
