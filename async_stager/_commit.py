"""The on-disk commit protocol of a Checkpointer directory.

Layout of ``DIR``::

    DIR/step-00000040/      committed checkpoints (the only names listed or restored)
    DIR/step-00000050/
    DIR/latest              "step-00000050\\n": the newest commit, for tools and people
    DIR/.tmp-step-00000060/ a checkpoint being written (never listed)

A checkpoint is written into ``.tmp-step-N``; once every rank's files are durable (DCP
fsyncs each file it writes before it reports the write done, and writes ``.metadata``
last, fsynced, on the coordinator), the coordinator writes ``checksums.json``, fsyncs
every file and the folder, renames the folder to ``step-N`` (the commit point: one
atomic ``rename``), fsyncs ``DIR``, and only then rewrites ``latest`` (temporary file,
fsync, rename, fsync ``DIR``) and retires old checkpoints. A crash before the rename
leaves a ``.tmp-`` folder that nothing reads (removed at the next open); after it, the
new checkpoint is complete. Retention renames ``step-N`` to ``.del-step-N`` (atomic:
gone from the listing) before deleting its files, and only after a newer commit.

Replacing a committed step (saving the same step again) moves the old folder to
``.old-step-N`` first; a crash between the two renames leaves the old folder there,
and the next open puts it back.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = [
    "LATEST",
    "clean_stale",
    "commit",
    "committed_steps",
    "fsync_dir",
    "read_latest",
    "retain",
    "step_dir",
    "step_name",
    "tmp_dir",
]

LATEST = "latest"
_STEP = re.compile(r"^step-(\d{8,})$")


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def step_dir(root: Path, step: int) -> Path:
    return root / step_name(step)


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{step_name(step)}"


def fsync_dir(path: Path) -> None:
    """fsync a folder, so the names created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def committed_steps(root: Path) -> list[int]:
    """Steps committed under ``root``, oldest first (empty if ``root`` does not exist)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        m = _STEP.match(name)
        if m and (root / name).is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_latest(root: Path) -> int | None:
    """The step ``latest`` names, or None (no file, or it names no committed folder)."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    m = _STEP.match(name)
    if m is None or not (root / name).is_dir():
        return None
    return int(m.group(1))


def _write_latest(root: Path, step: int) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(step_name(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def commit(root: Path, step: int) -> Path:
    """Make ``.tmp-step-N`` the committed ``step-N`` (see the module docstring) and
    point ``latest`` at the newest commit. Coordinator only, after every rank's files
    are written. Returns the committed folder."""
    src, dst = tmp_dir(root, step), step_dir(root, step)
    _fsync_tree(src)
    old = root / f".old-{step_name(step)}"
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)  # the commit point
    fsync_dir(root)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    newest = committed_steps(root)[-1]
    _write_latest(root, newest)
    return dst


def retain(root: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` committed checkpoints (after a commit);
    returns the steps deleted."""
    steps = committed_steps(root)
    doomed = steps[:-keep] if keep > 0 else []
    for step in doomed:
        gone = root / f".del-{step_name(step)}"
        os.rename(step_dir(root, step), gone)
    if doomed:
        fsync_dir(root)
        for step in doomed:
            shutil.rmtree(root / f".del-{step_name(step)}", ignore_errors=True)
    return doomed


def clean_stale(root: Path) -> None:
    """At open (coordinator, before any rank writes): remove what a crash left behind:
    uncommitted ``.tmp-`` folders and half-deleted ``.del-`` ones; put back an
    ``.old-step-N`` whose replacement never got committed."""
    for name in os.listdir(root):
        path = root / name
        if name.startswith(".old-step-"):
            final = root / name.removeprefix(".old-")
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)
        elif name.startswith((".tmp-step-", ".del-step-")):
            shutil.rmtree(path, ignore_errors=True)
        elif name == f".{LATEST}.tmp":
            path.unlink(missing_ok=True)
    fsync_dir(root)
    steps = committed_steps(root)
    if steps and read_latest(root) != steps[-1]:
        _write_latest(root, steps[-1])
