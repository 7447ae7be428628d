"""docs/design.md's module map names every module of the package, each once, in the
package that holds it (issue 23: the map had left 15 modules out)."""

from __future__ import annotations

import re
from pathlib import Path

import async_stager

PKG = Path(async_stager.__file__).parent
DESIGN = PKG.parent / "docs" / "design.md"


def _documented() -> set[str]:
    text = DESIGN.read_text(encoding="utf-8")
    start = text.index("| package | module | what it holds |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    found = set()
    for row in rows:
        package, modules = (cell.strip() for cell in row.strip("|").split("|")[:2])
        package = package.strip("`")
        prefix = "" if package == "async_stager" else package + "/"
        for name in re.findall(r"`([^`]+)`", modules):
            found.add(prefix + name)
    return found


def _real() -> set[str]:
    out = set()
    for path in PKG.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(PKG).with_suffix("")
        if rel.name == "__init__" and len(rel.parts) > 1:
            continue  # a layer's package marker
        out.add(str(rel))
    return out


def test_the_module_map_lists_every_module() -> None:
    documented, real = _documented(), _real()
    assert not real - documented, f"modules missing from docs/design.md's map: {sorted(real - documented)}"
    assert not documented - real, (
        f"docs/design.md's map names modules that do not exist: {sorted(documented - real)}"
    )


def test_contributing_names_every_layer() -> None:
    """CONTRIBUTING.md's layout shows a folder for every layer of tests/test_layers.py, and
    its import chain names them all in that order (it had left out _store and _tier)."""
    from tests.test_layers import LAYERS

    text = (PKG.parent / "CONTRIBUTING.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout") :]
    layout = layout[: layout.index("```", layout.index("```") + 3)]
    folders = re.findall(r"^  (_\w+)/", layout, flags=re.MULTILINE)
    assert folders == [layer for layer in LAYERS if layer.startswith("_")], folders
    chain = text[text.index("Imports point one way:") :].split(";")[0]
    assert re.findall(r"`(\w+)`", chain) == LAYERS, chain
