"""What the package promises about itself says one thing everywhere (issue 37).

The supported torch versions have one source, ``torch>=X`` in ``pyproject.toml``'s
dependencies; every page that states a minimum (README, CONTRIBUTING, docs/) must say
the same ``X``. ``py.typed`` ships (the package is typed for its users' mypy): it is on
disk and in the package data. That the built wheel holds it, and that the wheel works
outside the source tree, is checked by ``.ci/run``.
"""

from __future__ import annotations

import re
from pathlib import Path

import async_stager

ROOT = Path(__file__).resolve().parent.parent
PKG = Path(async_stager.__file__).parent
#: A stated minimum: "torch 2.11 or newer", "torch first (2.11 or newer", "torch 2.11+",
#: the requirement "torch>=2.11"
#: (not a fact about some versions, "on torch >= 2.10 ...", nor a measured version).
MINIMUM = re.compile(
    r"torch(?:>=`?(\d+\.\d+)|\b[^.`]{0,20}?\b(\d+\.\d+)\s*(?:\+|or\s+(?:newer|later)))", re.I
)


def _pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def _required_torch() -> str:
    found = re.findall(r'^\s*"torch>=(\d+\.\d+)[^"]*",', _pyproject(), re.M)
    assert len(found) == 1, f"pyproject.toml: one torch>= requirement expected, found {found}"
    return found[0]


def test_every_stated_torch_minimum_is_pyprojects() -> None:
    want = _required_torch()
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    stated: list[str] = []
    bad = []
    for page in pages:
        # Joined lines: a statement may wrap ("torch 2.11 or\nnewer").
        text = " ".join(page.read_text(encoding="utf-8").split())
        for m in MINIMUM.finditer(text):
            version = m.group(1) or m.group(2)
            stated.append(version)
            if version != want:
                bad.append(f"{page.relative_to(ROOT)}: {m.group(0)!r} (pyproject.toml: torch>={want})")
    assert not bad, "\n".join(bad)
    assert stated, "no page states the supported torch versions"


def test_py_typed_ships() -> None:
    assert (PKG / "py.typed").is_file()
    assert re.search(r'^async_stager = \[[^\]]*"py\.typed"', _pyproject(), re.M), (
        "py.typed is not in [tool.setuptools.package-data]"
    )
