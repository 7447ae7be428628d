"""The package's layers and the one direction of their imports (issue 23).

``async_stager`` is ``errors`` -> ``_core`` (the staging pipeline) -> ``_share`` ->
``_dcp`` -> ``_checkpoint`` -> ``_cli``, with thin public modules on top
(``__init__``, ``dcp``, ``share``, ``testing``). A module imports only from its own
layer or the layers before it; ``_core`` never imports ``torch.distributed``. Checked
by parsing every import (also the ones inside functions), so a lazy import cannot
break the order unseen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import async_stager

PKG = Path(async_stager.__file__).parent
#: The layers, lowest first; a module's layer is its first component under the package.
LAYERS = ["errors", "_core", "_share", "_dcp", "_tier", "_checkpoint", "_cli"]
#: The public face: may import any layer.
PUBLIC = {"__init__", "__main__", "dcp", "share", "testing"}


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(["async_stager", *parts])


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _name(path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "async_stager" or len(parts) < 2:
        return None
    return parts[1]


def test_every_module_belongs_to_a_layer_or_the_public_face() -> None:
    stray = [str(p.relative_to(PKG)) for p in _modules() if _layer(_name(p)) not in [*LAYERS, *PUBLIC, None]]
    assert not stray, f"modules outside the layers: {stray}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down(path: Path) -> None:
    own = _layer(_name(path))
    if own in PUBLIC or own is None:
        return
    rank = LAYERS.index(own)
    bad = []
    for line, mod in _imports(path):
        target = _layer(mod)
        if target in PUBLIC and target != "__init__":
            bad.append(f"line {line}: {mod} (a public module; import its layer instead)")
        elif target in LAYERS and LAYERS.index(target) > rank:
            bad.append(f"line {line}: {mod} (layer {target} is above {own})")
        elif mod == "async_stager" and own != "__init__":
            bad.append(f"line {line}: the package itself (import the module that defines the name)")
        if own in ("errors", "_core") and mod.startswith("torch.distributed"):
            bad.append(f"line {line}: {mod} (the pipeline never imports torch.distributed)")
    assert not bad, f"{path.relative_to(PKG)}:\n" + "\n".join(bad)
