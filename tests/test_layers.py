"""The package's layers and the one direction of their imports (issue 23).

``async_stager`` is ``errors`` -> ``_core`` (the staging pipeline) -> ``_share`` -> ``_store`` ->
``_dcp`` -> ``_checkpoint`` -> ``_cli``, with thin public modules on top
(``__init__``, ``dcp``, ``share``, ``testing``). A module imports only from its own
layer or the layers before it; ``_core`` never imports ``torch.distributed``. Checked
by parsing every import (also the ones inside functions), so a lazy import cannot
break the order unseen. Inside ``_core`` the same holds between its sub-packages and
top-level modules (``CORE_LAYERS``: the walk and the checksums below host memory, which
is below the device copies, the plans, the engine and the async facade; issue 42).
Inside one folder, no module imports another round a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import async_stager

PKG = Path(async_stager.__file__).parent
#: The layers, lowest first; a module's layer is its first component under the package.
LAYERS = ["errors", "_core", "_share", "_store", "_dcp", "_tier", "_checkpoint", "_cli"]
#: The public face: may import any layer.
PUBLIC = {"__init__", "__main__", "dcp", "share", "testing"}
#: The layers inside ``_core``, lowest first: a module's is its first component under
#: ``_core`` (a sub-package, or a top-level module such as ``options``).
CORE_LAYERS = [
    "stats",
    "compare",
    "interp",
    "options",
    "walk",
    "checksum",
    "memory",
    "copy",
    "plan",
    "run",
    "aio",
]


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


# -- the order inside _core (issue 42) ------------------------------------------------


def _core_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["async_stager", "_core"] or len(parts) < 3:
        return None
    return parts[2]


def test_every_core_module_belongs_to_a_core_layer() -> None:
    stray = [
        str(p.relative_to(PKG))
        for p in _modules()
        if _layer(_name(p)) == "_core" and _core_layer(_name(p)) not in [*CORE_LAYERS, None]
    ]
    assert not stray, f"modules of _core outside CORE_LAYERS: {stray}"


@pytest.mark.parametrize(
    "path", [p for p in _modules() if _core_layer(_name(p))], ids=lambda p: str(p.relative_to(PKG))
)
def test_core_imports_point_down(path: Path) -> None:
    """A module of ``_core`` imports only from its own sub-package (or module) and those
    before it in CORE_LAYERS: ``memory`` never reaches up to the Lease of ``aio`` nor
    ``copy`` to the interpreter switches of ``run`` (what both need goes below both)."""
    own = _core_layer(_name(path))
    assert own is not None
    rank = CORE_LAYERS.index(own)
    bad = []
    for line, mod in _imports(path):
        target = _core_layer(mod)
        if target in CORE_LAYERS and CORE_LAYERS.index(target) > rank:
            bad.append(f"line {line}: {mod} ({target} is above {own} in _core)")
    assert not bad, f"{path.relative_to(PKG)}:\n" + "\n".join(bad)


# -- no import cycle inside a package (issue 37) ---------------------------------------


def _parts(module: str, path: Path) -> list[str]:
    """The module's name as a list, a package's ``__init__`` as a member of its package."""
    parts = module.split(".")
    return [*parts, "__init__"] if path.name == "__init__.py" and len(parts) > 1 else parts


def _graph() -> dict[str, dict[tuple[str, str], list[str]]]:
    """Per package: (importer, imported) -> where, between the modules of one folder
    (its ``__init__`` among them). Every import counts, lazy ones inside functions too.
    Imports between sub-packages (``_core.run`` and ``_core.aio``) are not edges here:
    the layers above order the packages; this is about the modules of one folder."""
    paths = {_name(p): p for p in _modules()}
    graph: dict[str, dict[tuple[str, str], list[str]]] = {}
    for src, path in paths.items():
        mine = _parts(src, path)
        for line, mod in _imports(path):
            parts = mod.split(".")
            # The longest prefix that is a module of the package (``from .x import f``).
            dst = next(
                (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in paths), None
            )
            if dst is None or dst == src:
                continue
            theirs = _parts(dst, paths[dst])
            k = len(mine) - 1
            if len(theirs) != len(mine) or mine[:k] != theirs[:k]:
                continue  # not two modules of one folder
            edges = graph.setdefault(".".join(mine[:k]), {})
            where = edges.setdefault((mine[k], theirs[k]), [])
            if not any(w.startswith(f"{path.relative_to(PKG)}:{line} ") for w in where):
                where.append(f"{path.relative_to(PKG)}:{line} imports {dst}")
    return graph


def _cycles(edges: dict[tuple[str, str], list[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one member (Tarjan's)."""
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def _found() -> dict[tuple[str, frozenset[str]], list[str]]:
    found = {}
    for package, edges in _graph().items():
        for comp in _cycles(edges):
            found[(package, comp)] = [
                w for (a, b), where in sorted(edges.items()) if a in comp and b in comp for w in where
            ]
    return found


def test_no_import_cycle_inside_a_package() -> None:
    """Two modules of one folder never import each other, directly or round a circle:
    what both need lives below both (issue 37 removed the last: ``_checkpoint``'s saves,
    write, node_budget and progress; ``_dcp``'s budget and streaming)."""
    found = _found()
    assert not found, "import cycles (put what both sides need below both):\n" + "\n".join(
        f"{package}: {sorted(comp)}\n    " + "\n    ".join(where) for (package, comp), where in found.items()
    )


# -- no private name crosses modules (issue 42) ------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_crosses_modules() -> None:
    """A module uses only the public names of another: no ``from m import _name``, no
    ``m._name`` on an imported module, no ``getattr(obj, "_name")`` on another object
    (what a layer above needs is public in its module, or behind an internal handle),
    nor ``async_stager.m._name`` through the full dotted name.
    Failed before: ``_save_blocking`` imported three times, ``getattr(stager,
    "_shared_arenas")`` twice, ``reducers._delegate_storage``."""
    modules = {_name(p) for p in _modules()}
    bad = []
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported: set[str] = set()  # names bound to modules of the package
        foreign: set[str] = set()  # names bound by other imports (torch's privates are torch's)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = _name(path).split(".")
                    parts = parts[: len(parts) - node.level + (1 if path.name == "__init__.py" else 0)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if base.startswith("async_stager") and full in modules:
                        imported.add(a.asname or a.name)  # a module
                    elif base.startswith("async_stager") and _private(a.name):
                        bad.append(f"{path.relative_to(PKG)}:{node.lineno} imports {full}")
                if not base.startswith("async_stager"):
                    foreign.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                imported.update(
                    a.asname for a in node.names if a.asname and a.name.startswith("async_stager")
                )
                foreign.update(
                    (a.asname or a.name).split(".")[0]
                    for a in node.names
                    if not a.name.startswith("async_stager")
                )
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                if node.value.id in imported:
                    bad.append(f"{path.relative_to(PKG)}:{node.lineno} uses {node.value.id}.{node.attr}")
            elif (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and ast.unparse(node.value) in modules
                and ast.unparse(node) not in modules
            ):
                # ``import async_stager._core.x`` then ``async_stager._core.x._name``.
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} uses {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id not in ("self", "cls", *foreign)
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
            ):
                bad.append(
                    f"{path.relative_to(PKG)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})"
                )
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


# -- module size -----------------------------------------------------------------------

#: The most lines a module of the package may have (CONTRIBUTING: one module, one
#: responsibility; a module past this is split by responsibility, not cut anywhere).
MAX_MODULE_LINES = 600


def test_every_module_is_at_most_600_lines() -> None:
    """Every module under ``async_stager/`` has at most ``MAX_MODULE_LINES`` lines.
    Failed before: ``_tier/tier.py`` (632) and ``_tier/agent.py`` (612), split into
    ``solo`` (``save`` alone) and ``holdings`` (what the agent holds)."""
    sizes = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in _modules()}
    over = [f"{p.relative_to(PKG)} ({n} lines)" for p, n in sorted(sizes.items()) if n > MAX_MODULE_LINES]
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): " + ", ".join(
        over
    )
