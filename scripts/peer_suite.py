"""Run torch_checkpointing's own test suite with async_stager's stager substituted.

Usage: ``python scripts/peer_suite.py PEER_CHECKOUT [pytest args...]``
(arguments that name files under the checkout's ``tests/`` select those files;
without any, the whole ``tests`` folder runs).

``PEER_CHECKOUT`` is a copy of https://github.com/meta-pytorch/torch_checkpointing
(never part of this repository). The suite runs twice, in the checkout, with the
checkout first on ``sys.path``: once as it is ("peer's own" stager), once with a pytest
plugin (``-p``, written to a temporary folder) that, before any test module is
imported, points ``DefaultStager``, ``CheckpointStager`` and ``CheckpointStagerConfig``
in every loaded ``torch_checkpointing`` module at async_stager's. Prints a table:
passed / failed / skipped for each run, then the tests whose outcome differs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

_PLUGIN = '''
"""Substitutes async_stager's stager for torch_checkpointing's (scripts/peer_suite.py)."""
import sys

import async_stager
import torch_checkpointing  # noqa: F401  (loads every module that imports the stager)
import torch_checkpointing.staging as _staging

_NAMES = ("DefaultStager", "CheckpointStager", "CheckpointStagerConfig")
_PEER = {name: getattr(_staging, name) for name in _NAMES}
for _mod in list(sys.modules.values()):
    if getattr(_mod, "__name__", "").startswith("torch_checkpointing"):
        for _name in _NAMES:
            if getattr(_mod, _name, None) is _PEER[_name]:
                setattr(_mod, _name, getattr(async_stager, _name))
'''

_REPO = Path(__file__).resolve().parent.parent


def _run(peer: Path, plugin_dir: Path | None, extra: list[str], xml_path: Path) -> dict[str, str]:
    """One pytest run of the peer's suite: {test id: outcome}."""
    env = dict(os.environ)
    paths = [str(peer), str(_REPO)]
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}"]
    if plugin_dir is not None:
        paths.insert(0, str(plugin_dir))
        args += ["-p", "async_stager_peer_plugin"]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    chosen = [a for a in extra if a.startswith("tests/")]
    subprocess.run([*args, *extra, *([] if chosen else ["tests"])], cwd=peer, env=env, check=False)
    outcomes: dict[str, str] = {}
    for case in ET.parse(xml_path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds or "error" in kinds:
            outcomes[name] = "failed"
        elif "skipped" in kinds:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


def _counts(outcomes: dict[str, str]) -> tuple[int, int, int]:
    values = list(outcomes.values())
    return values.count("passed"), values.count("failed"), values.count("skipped")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    peer = Path(argv[0]).resolve()
    if not (peer / "torch_checkpointing" / "staging.py").is_file():
        print(f"{peer} is not a torch_checkpointing checkout", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        plugin_dir = Path(tmp)
        (plugin_dir / "async_stager_peer_plugin.py").write_text(_PLUGIN)
        theirs = _run(peer, None, argv[1:], plugin_dir / "theirs.xml")
        ours = _run(peer, plugin_dir, argv[1:], plugin_dir / "ours.xml")
    print()
    print("| stager | passed | failed | skipped |")
    print("|---|---:|---:|---:|")
    for label, outcomes in (("async_stager", ours), ("torch_checkpointing (own)", theirs)):
        p, f, s = _counts(outcomes)
        print(f"| {label} | {p} | {f} | {s} |")
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        print()
        print("| test | async_stager | torch_checkpointing |")
        print("|---|---|---|")
        for k in differ:
            print(f"| `{k}` | {ours.get(k, '-')} | {theirs.get(k, '-')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
