"""``python -m async_stager verify DIR``: check committed checkpoints against their
checksums, without loading them into a model.

``DIR`` is a Checkpointer directory (every committed step is checked, newest first) or
one step folder. Prints one line per step; the exit status is 0 when every step checked
verifies, 1 when one does not, 2 when there is nothing to check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TextIO

__all__ = ["add_verify_parser", "run_verify"]


def add_verify_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify",
        help="check saved checkpoints against their checksums",
        description="Read back every tensor of each committed checkpoint under DIR (or of one step "
        "folder) and compare it with the CRC-32 checksums taken from the staged copy when it was saved.",
    )
    p.add_argument("directory", type=Path, help="a Checkpointer directory or one step-NNNNNNNN folder")
    p.add_argument("--newest", action="store_true", help="check only the newest committed step")


def _folders(directory: Path, newest: bool) -> list[tuple[int | None, Path]]:
    from .._commit import committed_steps, step_dir

    m = re.match(r"^step-(\d+)$", directory.name)
    if m and directory.is_dir():
        return [(int(m.group(1)), directory)]
    steps = list(reversed(committed_steps(directory)))
    if newest:
        steps = steps[:1]
    return [(s, step_dir(directory, s)) for s in steps]


def verify_folder(step: int | None, folder: Path) -> str:
    """Verify one step folder (either format); returns a summary, raises IntegrityError."""
    import torch

    from .._integrity import read_manifest, verify_dcp, verify_flat
    from .._statefuls import TORCH_FILE

    if (folder / TORCH_FILE).exists():
        tensors = read_manifest(folder, step)
        loaded = torch.load(folder / TORCH_FILE, map_location="cpu", weights_only=True)
        n = verify_flat(step, tensors, loaded)
        return f"{n} tensors"
    return f"{verify_dcp(folder, step)} tensor chunks"


def run_verify(ns: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from .._errors import IntegrityError

    folders = _folders(ns.directory, ns.newest)
    if not folders:
        print(f"async-stager: error: no committed checkpoint in {ns.directory}", file=sys.stderr)
        return 2
    status = 0
    for step, folder in folders:
        try:
            summary = verify_folder(step, folder)
        except IntegrityError as exc:
            out.write(f"{folder.name}: FAILED: {exc}\n")
            status = 1
        else:
            out.write(f"{folder.name}: ok ({summary})\n")
    return status
