"""The requirements a bare machine with torch needs for the package and one of its
extras, read from pyproject.toml, one per line: ``[project].dependencies`` (but torch,
which the machine brings in its own build) and, for each extra named,
``[project.optional-dependencies]``'s list of it.

    python scripts/requirements.py gpu-check        # what scripts/gpu_check.sh installs
    python scripts/requirements.py --missing gpu-check   # those that do not import here
    pip download -d wheels $(python scripts/requirements.py gpu-check)   # carried wheels
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _strings(block: str) -> list[str]:
    return re.findall(r'^\s*"([^"]+)"', block, re.M)


def requirements(extras: list[str], path: Path = PYPROJECT) -> list[str]:
    text = path.read_text()
    try:
        import tomllib

        project = tomllib.loads(text)["project"]
        reqs = list(project["dependencies"])
        optional = project.get("optional-dependencies", {})
        for extra in extras:
            reqs += optional[extra]
    except ImportError:  # Python 3.10: the lists' strings, read plainly
        deps = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        assert deps is not None, f"no dependencies in {path}"
        reqs = _strings(deps.group(1))
        for extra in extras:
            found = re.search(rf"^{re.escape(extra)}\s*=\s*\[(.*?)\]\s*$", text, re.S | re.M)
            if found is None:
                raise KeyError(extra) from None
            reqs += _strings(found.group(1))
    return [r for r in reqs if name_of(r).lower() != "torch"]


def name_of(requirement: str) -> str:
    """The module a requirement's distribution is imported as (``pytest-timeout``:
    ``pytest_timeout``)."""
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().replace("-", "_")


def missing(reqs: list[str]) -> list[str]:
    """Those of ``reqs`` whose module does not import here (one process for all)."""
    out = []
    for r in reqs:
        try:
            importlib.import_module(name_of(r))
        except Exception:  # noqa: BLE001 - any failure to import is "missing"
            out.append(r)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    only_missing = "--missing" in args
    reqs = requirements([a for a in args if a != "--missing"])
    lines = missing(reqs) if only_missing else reqs
    if lines:  # nothing at all when none (an empty line would read as one requirement)
        print("\n".join(lines))
