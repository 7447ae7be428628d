"""Import every module of async_stager where only torch and the package's declared
dependencies can be imported: a module that needs anything else (numpy before it was
declared) fails here, as it would for a user who installed the wheel next to torch.

Every installed distribution outside the allowed set is made unimportable (a meta path
finder raising ModuleNotFoundError, as for a package that is not there); the allowed
set is the requirement closure of torch and of the package's own dependencies, without
extras. The standard library and modules that no distribution provides stay
importable.

    python scripts/declared_only.py                 # dependencies from ./pyproject.toml
    python scripts/declared_only.py --installed     # from the installed async_stager's metadata

Prints one line per module that failed and exits 1 if any did; warnings are errors.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata as md
import pkgutil
import re
import sys
import traceback
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: Iterable[str]) -> list[str]:
    """Distribution names of requirement strings, leaving out those an extra asks for
    (python-version markers are kept: over-inclusive is harmless here)."""
    out = []
    for req in requirements:
        _, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        m = _NAME.match(req)
        if m:
            out.append(_canon(m.group(1)))
    return out


def pyproject_dependencies(path: Path) -> list[str]:
    """``[project].dependencies`` of a pyproject.toml (tomllib where there is one)."""
    text = path.read_text()
    try:
        import tomllib

        deps: list[str] = tomllib.loads(text)["project"]["dependencies"]
        return deps
    except ImportError:  # Python 3.10: the list's strings, read plainly
        block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        assert block is not None, f"no dependencies in {path}"
        return re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)


def closure(roots: Iterable[str]) -> set[str]:
    """The installed distributions ``roots`` need, transitively (canonical names)."""
    seen: set[str] = set()
    todo = [_canon(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(_names(md.requires(name) or []))
        except md.PackageNotFoundError:
            pass  # declared but not installed: its import fails on its own
    return seen


def blocked_modules(allowed: set[str]) -> set[str]:
    """Top-level modules of installed distributions outside ``allowed``."""
    blocked = set()
    for top, dists in md.packages_distributions().items():
        if not any(_canon(d) in allowed for d in dists):
            blocked.add(top)
    return blocked - set(sys.stdlib_module_names) - {"async_stager"}


class _Missing(importlib.abc.Loader):
    def create_module(self, spec: Any) -> Any:
        raise ModuleNotFoundError(f"No module named {spec.name!r} (not declared)", name=spec.name)

    def exec_module(self, module: Any) -> None:  # pragma: no cover - create_module raised
        raise ModuleNotFoundError(module.__name__)


class _Block:
    """A spec without an origin (``importlib.util.find_spec`` callers then treat the
    module as absent), whose loading raises ModuleNotFoundError."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, _Missing(), origin=None)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--installed", action="store_true", help="the installed package's Requires-Dist")
    parser.add_argument("--pyproject", default=str(Path(__file__).resolve().parents[1] / "pyproject.toml"))
    args = parser.parse_args()
    declared = (
        _names(md.requires("async_stager") or [])
        if args.installed
        else _names(pyproject_dependencies(Path(args.pyproject)))
    )
    allowed = closure(["torch", *declared])
    blocked = blocked_modules(allowed)
    # Imported at start-up (a .pth file of the environment): forgotten, so that an
    # import of them from the package fails too.
    for name in [n for n in sys.modules if n.split(".")[0] in blocked]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Block(blocked))
    # torch first, warnings as usual: without numpy it warns ("Failed to initialize
    # NumPy") at its own import, which is torch's and not the package's.
    import torch  # noqa: F401

    warnings.simplefilter("error")
    import async_stager

    failed = 0
    names = [m.name for m in pkgutil.walk_packages(async_stager.__path__, "async_stager.")]
    for name in ["async_stager", *names]:
        if name.endswith("__main__"):
            continue  # runs the command line when imported
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - reported, then the next module
            failed += 1
            frames = traceback.extract_tb(e.__traceback__)
            ours = [f for f in frames if "async_stager" in f.filename] or frames
            print(f"{name}: {type(e).__name__}: {e} ({ours[-1].filename}:{ours[-1].lineno})")
    print(
        f"{len(names) + 1 - failed} of {len(names) + 1} modules import with only torch and "
        f"{', '.join(sorted(set(declared) - {'torch'}))} ({len(blocked)} installed packages blocked)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
