"""Where a Checkpointer's steps live: the storage seam under the routes.

Every route writes a save's files into a local folder (``scratch``: the save's
``.tmp-`` folder, as ``commit`` lays it out) through its format; what happens to them
then is the place's: ``FolderPlace`` (a local folder: the commit is a rename, holds and
the writer lock are ``flock``, see ``commit``) or ``StorePlace`` (an object store,
``store_place``: the files uploaded, then a commit record written last by one rank).
The routes, the save queue and the formats do not know which.

What a place does, in the order of a save: ``upload_own`` (every rank, its own files,
before the ranks meet for the commit), ``commit`` (the coordinator, after every rank's
files are stored: the manifest, the commit point, ``latest``, retention), ``leave``
(every other rank, after it: its local copy); for a
reader: ``steps_for_reading``, ``reading`` (a committed step's files, as a local
folder, for as long as the block runs) and ``commit_number``. Every method blocks (a
worker thread).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path

from async_stager._checkpoint import commit as _commit, holds as _holds
from async_stager._dcp.files import naming_file

__all__ = ["FolderPlace", "Place", "ReadersHold"]

#: ``SaveItem.readers_hold``: told which processes hold the step a commit replaces.
ReadersHold = Callable[[list[int] | None], None]


class Place(ABC):
    """One Checkpointer's storage: see the module docstring."""

    #: The local folder the saves' files are written into (``.tmp-`` folders).
    scratch: Path
    #: What messages name: the folder, or the store's URL.
    where: str

    def open(self) -> None:
        """Before the first save or read (``Checkpointer.__aenter__``)."""

    def close(self) -> None:
        """Let go of connections (idempotent)."""

    def upload_own(self, tmp: Path, rank: int, world: int) -> None:
        """Store the files this rank wrote into ``tmp`` (every rank, before the commit's
        gather; nothing for a folder, where they are in place)."""

    def leave(self, tmp: Path, rank: int) -> None:
        """A rank other than the coordinator is done with a save's ``tmp`` (committed or
        not): nothing for a folder, whose ``tmp`` the coordinator renames or removes."""

    @abstractmethod
    def commit(
        self,
        step: int,
        tmp: Path,
        layout: str,
        keep: int,
        prepare: Callable[[], None],
        committed: Callable[[], None],
        readers_hold: ReadersHold,
    ) -> None:
        """Make the files of ``tmp`` committed ``step`` (coordinator, after every rank's
        files are stored): ``prepare`` first (the manifest, into ``tmp``), then the
        commit point, ``committed`` right after it, ``latest``, and the retention of all
        but ``keep`` commits."""

    @abstractmethod
    def committed_steps(self) -> list[int]:
        """Committed steps, oldest commit first."""

    def steps_for_reading(self) -> list[int]:
        """``committed_steps`` as one moment (a reader's candidates)."""
        return self.committed_steps()

    @abstractmethod
    def reading(self, step: int) -> contextlib.AbstractContextManager[tuple[Path, int, bool]]:
        """Committed ``step``'s files as a local folder for the block: yields the folder,
        its commit number and whether it is held (no writer retires or replaces it
        meanwhile). Raises ``commit.StepGone`` if it is no longer committed."""

    @abstractmethod
    def commit_number(self, step: int) -> int | None:
        """Committed ``step``'s commit number now (None: not committed)."""

    @abstractmethod
    def step_path(self, step: int) -> str:
        """Where committed ``step`` is (its folder, or its objects' URL prefix)."""

    @abstractmethod
    def exists(self) -> bool:
        """The place holds anything (restore's "nothing to restore" says which)."""


class FolderPlace(Place):
    """A local folder: ``commit``'s protocol (a rename is the commit point), readers'
    holds and retention by ``holds``' flocks."""

    def __init__(self, root: Path) -> None:
        self.scratch = root
        self.where = str(root)

    def commit(
        self,
        step: int,
        tmp: Path,
        layout: str,
        keep: int,
        prepare: Callable[[], None],
        committed: Callable[[], None],
        readers_hold: ReadersHold,
    ) -> None:
        root = self.scratch
        # The step's hold first (it waits for a reader of the step it replaces), then
        # the folder's lock: the order ``holds`` prescribes.
        with _holds.exclusive(root, _commit.step_name(step), readers_hold), _commit.folder_lock(root):
            prepare()
            # The record (its own error names it), then the fsyncs and the rename: a full
            # disk there names no file, and is the step's folder's (not the record's).
            with naming_file(tmp):
                _commit.commit(root, tmp, step, layout=layout)
            committed()
            _commit.retain(root, keep)

    def committed_steps(self) -> list[int]:
        return _commit.committed_steps(self.scratch)

    def steps_for_reading(self) -> list[int]:
        return _commit.steps_for_reading(self.scratch)

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[tuple[Path, int, bool]]:
        with _commit.reading(self.scratch, step) as (seq, held):
            yield _commit.step_dir(self.scratch, step), seq, held

    def commit_number(self, step: int) -> int | None:
        return _commit.commit_number(self.scratch, step)

    def step_path(self, step: int) -> str:
        return str(_commit.step_dir(self.scratch, step))

    def exists(self) -> bool:
        return self.scratch.is_dir()
