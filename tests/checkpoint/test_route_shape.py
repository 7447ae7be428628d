"""The save queue is policy only (issue 42 section 1): it never asks which route a save
takes, and no module of ``_checkpoint`` compares a phase with a string. Checked by
parsing the modules, so a new branch on a route's kind fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import async_stager
from async_stager._checkpoint.item import Phase, Route

CHECKPOINT = Path(async_stager.__file__).parent / "_checkpoint"
ROUTES = CHECKPOINT / "routes"
#: The modules that must not know the routes: the queue, the common write steps, the
#: in-flight view and the record with the route interface.
POLICY = ["saves.py", "write.py", "progress.py", "item.py"]
#: What only a route may read or decide on: a route's own state, and the options that
#: pick a route (``routes.Routes`` reads those).
ROUTE_STATE = {
    "lease",
    "stage",
    "stage_scope",
    "freed",
    "on_freed",
    "job",
    "fence_wait",
    "fence_scope",
    "thread_wait",
    "digests",
    "budget",
    "admission",
    "admitting",
    "node_wait",
    "largest",
    "stream",
    "host_budget_bytes",
    "node_budget_bytes",
}


def _route_classes() -> set[str]:
    names = {"Route"}
    for path in ROUTES.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("Route")}
    return names


@pytest.mark.parametrize("name", POLICY)
def test_the_policy_modules_never_ask_which_route_a_save_takes(name: str) -> None:
    path = CHECKPOINT / name
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = _route_classes() - {"Route"}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "async_stager._checkpoint.routes"
        ):
            bad.append(f"line {node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Name) and node.id in classes:
            bad.append(f"line {node.lineno}: names {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ROUTE_STATE:
            bad.append(f"line {node.lineno}: reads .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("isinstance", "issubclass", "type")
            and "Route" in ast.unparse(node)
        ):
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not bad, f"_checkpoint/{name} asks about a save's route:\n" + "\n".join(bad)


def _is_phase(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and "phase" in node.attr


def _has_str(node: ast.expr) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_has_str(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_no_phase_is_a_string_in_the_checkpoint_layer() -> None:
    """Phases are ``item.Phase``; its values are what ``SaveProgress`` shows."""
    bad = []
    for path in sorted(CHECKPOINT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
            elif isinstance(node, ast.Assign):
                sides = [*node.targets, node.value]
            else:
                continue
            if any(_is_phase(s) for s in sides) and any(_has_str(s) for s in sides):
                bad.append(f"{path.relative_to(CHECKPOINT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "phases compared with or set to strings:\n" + "\n".join(bad)
    assert [p.value for p in Phase] == [
        "deferred",
        "staging",
        "queued",
        "writing",
        "committing",
        "done",
        "memory-staging",
        "memory-committing",
    ]


def test_every_route_module_holds_its_route() -> None:
    """Each kind of save is one class deriving from ``item.Route``, in ``_checkpoint/routes``."""
    import importlib

    found = {}
    for path in sorted(ROUTES.glob("*.py")):
        module = importlib.import_module(
            f"async_stager._checkpoint.routes.{path.stem}".replace(".__init__", "")
        )
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Route) and value.__module__ == module.__name__:
                found[value.__name__] = path.stem
    assert {"StagedRoute", "StreamedRoute", "AdmissionRoute", "MemoryRoute"} <= set(found), found


def test_no_module_outside_the_routes_names_a_route() -> None:
    """Outside ``_checkpoint/routes`` nothing in the package names a route class or asks
    whether a save's route is one (``isinstance``/``type`` on a route): the Checkpointer
    asks the schedule for the routes of a step, the queue and the other layers see the
    ``Route`` interface only. (The policy modules' test above also forbids reading a
    route's state; this one covers every other module: the Checkpointer, the tiers, the
    command line.)"""
    package = CHECKPOINT.parent
    classes = _route_classes() - {"Route"}
    bad = []
    for path in sorted(package.rglob("*.py")):
        if ROUTES in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and any(a.name in classes for a in node.names):
                what = f"imports {', '.join(a.name for a in node.names)}"
            elif (isinstance(node, ast.Name) and node.id in classes) or (
                isinstance(node, ast.Attribute) and node.attr in classes
            ):
                what = f"names {ast.unparse(node)}"
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("isinstance", "issubclass", "type")
                and "Route" in ast.unparse(node)
            ):
                what = ast.unparse(node)
            else:
                continue
            bad.append(f"{path.relative_to(package)}:{node.lineno}: {what}")
    assert classes >= {"StagedRoute", "StreamedRoute", "AdmissionRoute", "MemoryRoute"}, classes
    assert not bad, "modules outside _checkpoint/routes that know the routes:\n" + "\n".join(bad)
