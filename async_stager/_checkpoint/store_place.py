"""A Checkpointer's steps in an object store (``Checkpointer("s3://bucket/run")``).

Layout under the store's root (``s3://bucket/run/``)::

    step-00000040.<token>.<seq>/...        one save's files (token: its writer's session,
    step-00000040.<token>.<seq>/COMMIT     seq: its save number): the commit record, last
    step-00000040.<token>.<seq>/RETIRED    retention's mark: no longer committed
    latest                                 "step-00000050\\n", for people and tools

A save's files are written into a local scratch folder by its format (as for a folder:
``place``), then each rank uploads its own (``upload_own``: multipart, parts in
parallel within the upload budget, from the files' pages, never read whole into
memory); once every rank's are stored (the ranks' gather), the coordinator uploads
the rest (``.metadata``, ``checksums.json``...) and writes the commit record: one PUT
with ``If-None-Match: *``, the commit point. A reader lists the commit records: a save
without one (being written, or its writer killed) is never seen, so nothing torn is
visible. Each save has its own prefix, so saving a step again never touches the
committed one: the newer commit (its record's ``seq``) replaces it.

What a store cannot give, and what is done instead:

- **No writer lock.** Two Checkpointers writing one prefix each commit whole steps,
  but may give two commits the same number (the key orders them then), and neither
  waits for the other's retention.
- **No reader holds.** Retention marks a step ``RETIRED`` (it is no longer listed) and
  deletes its objects only ``RETIRE_GRACE`` seconds later, at a later retention: a
  reader that listed it before reads it whole meanwhile. A reader slower than that
  finds an object gone: the step is taken as gone (``StepGone``) and the restore lists
  again and tries the newest commit then (never a torn state: files are verified
  against the manifest before anything is loaded).
- **Leftovers**: a killed writer's save prefix (no record) is deleted once its newest
  object is ``STALE_AFTER`` seconds old, and its unfinished multipart uploads aborted
  (a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` does the same server-side).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import mmap
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_stager._checkpoint import commit as _commit
from async_stager._checkpoint.options import CheckpointerOptions
from async_stager._checkpoint.place import FolderPlace, Place, ReadersHold
from async_stager._checkpoint.stored import file_digest
from async_stager._core.checksum.digest import hasher
from async_stager._store.objects import ObjectInfo, TransferOptions
from async_stager._store.store import Store, open_store
from async_stager.errors import IntegrityError, StagingError, StoreError

__all__ = ["RETIRE_GRACE", "STALE_AFTER", "StorePlace", "make_place", "upload_options"]

_log = logging.getLogger("async_stager.checkpoint")

#: Seconds a retired step's objects stay readable (deleted by a later retention).
RETIRE_GRACE = 600.0
#: Seconds after which a save prefix without a commit record is a dead writer's.
STALE_AFTER = 24 * 3600.0

_FORMAT = "async_stager-store-commit/1"
_RECORD = "COMMIT"
_RETIRED = "RETIRED"
_MANIFEST = "checksums.json"
#: ``step-N.<token>.<seq>/<name>``
_KEY = re.compile(r"^(step-(\d{8,})\.[0-9a-f]+\.\d+)/(.+)$")
#: A rank's own DCP data file: ``__<rank>_<n>.distcp``.
_RANK_FILE = re.compile(r"^__(\d+)_")
_MiB = 1 << 20


def make_place(options: CheckpointerOptions) -> Place:
    """The place ``options`` name: their store (``url``) or their folder."""
    if options.url is None:
        return FolderPlace(options.directory)
    return StorePlace(options.url, options.directory, options.host_budget_bytes)


def upload_options(host_budget_bytes: int | None) -> TransferOptions:
    """The transfer options of a Checkpointer's store: 16 MiB parts, 8 in flight (the
    store's measured defaults), within ``host_budget_bytes`` when one is given (parts
    of 5 MiB at least: S3's smallest)."""
    if host_budget_bytes is None:
        return TransferOptions()
    part = min(16 * _MiB, max(5 * _MiB, host_budget_bytes // 2))
    return TransferOptions(part_size=part, budget_bytes=max(part, host_budget_bytes))


def _canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _check(doc: dict[str, Any]) -> int:
    body = _canonical({k: v for k, v in doc.items() if k != "check"}).encode()
    return int(hasher().xxh3_64_intdigest(body))


@dataclass
class _Save:
    """One save prefix as listed: its objects, its record (if committed), retired?"""

    prefix: str
    step: int
    objects: list[ObjectInfo] = field(default_factory=list)
    record: dict[str, Any] | None = None
    record_info: ObjectInfo | None = None
    retired: ObjectInfo | None = None

    @property
    def committed(self) -> bool:
        return self.record is not None and self.retired is None

    @property
    def seq(self) -> int:
        return int(self.record["seq"]) if self.record is not None else -1

    def newest(self) -> datetime.datetime | None:
        times = [o.modified for o in self.objects if o.modified is not None]
        return max(times) if times else None


class StorePlace(Place):
    """Steps in an object store; the saves' files pass through ``scratch`` (a local
    folder). See the module docstring."""

    def __init__(self, url: str, scratch: Path, host_budget_bytes: int | None = None) -> None:
        self.url = url
        self.where = url
        self.scratch = scratch
        self._options = upload_options(host_budget_bytes)
        self._store: Store | None = None
        self._records: dict[tuple[str, str], dict[str, Any] | None] = {}

    # -- the store's life ------------------------------------------------------------

    def open(self) -> None:
        if self._store is None:
            self._store = open_store(self.url, self._options)
        self._clean_reads()

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.blocking.close()

    @contextlib.contextmanager
    def _using(self) -> Iterator[Store]:
        """The open store, or one for this call only (``steps()`` on a closed
        Checkpointer)."""
        if self._store is not None:
            yield self._store
            return
        store = open_store(self.url, self._options)
        try:
            yield store
        finally:
            store.blocking.close()

    # -- the listing -----------------------------------------------------------------

    def _list(self, store: Store) -> list[_Save]:
        saves: dict[str, _Save] = {}
        for info in store.blocking.list_objects("step-"):
            m = _KEY.match(info.key)
            if m is None:
                continue
            save = saves.setdefault(m.group(1), _Save(m.group(1), int(m.group(2))))
            save.objects.append(info)
            if m.group(3) == _RECORD:
                save.record_info = info
            elif m.group(3) == _RETIRED:
                save.retired = info
        for save in saves.values():
            if save.record_info is not None:
                save.record = self._record(store, save)
        return sorted(saves.values(), key=lambda s: (s.seq, s.prefix))

    def _record(self, store: Store, save: _Save) -> dict[str, Any] | None:
        info = save.record_info
        assert info is not None
        cached = (info.key, info.etag)
        if cached in self._records:
            return self._records[cached]
        try:
            doc = json.loads(bytes(store.blocking.get(info.key)).decode("utf-8"))
        except StoreError as exc:
            if exc.reason == "missing":
                return None  # retired meanwhile
            raise
        except (ValueError, UnicodeDecodeError):
            doc = None
        ok = (
            isinstance(doc, dict)
            and doc.get("format") == _FORMAT
            and doc.get("check") == _check(doc)
            and doc.get("step") == save.step
            and isinstance(doc.get("seq"), int)
            and isinstance(doc.get("files"), dict)
        )
        if not ok:
            _log.warning("%s: its commit record is damaged: not listed", store.url(save.prefix))
            doc = None
        self._records[cached] = doc
        return self._records[cached]

    @staticmethod
    def _live(saves: list[_Save]) -> list[_Save]:
        """The committed saves, oldest commit first, one per step (its newest)."""
        newest: dict[int, _Save] = {}
        for save in saves:
            if save.committed:
                newest[save.step] = save  # sorted by commit: the last wins
        return sorted(newest.values(), key=lambda s: (s.seq, s.prefix))

    def committed_steps(self) -> list[int]:
        with self._using() as store:
            return [s.step for s in self._live(self._list(store))]

    def commit_number(self, step: int) -> int | None:
        with self._using() as store:
            found = [s for s in self._live(self._list(store)) if s.step == step]
        return found[0].seq if found else None

    def step_path(self, step: int) -> str:
        with self._using() as store:
            found = [s for s in self._live(self._list(store)) if s.step == step]
            return store.url(found[0].prefix + "/") if found else store.url(_commit.step_name(step))

    def exists(self) -> bool:
        with self._using() as store:
            return bool(store.blocking.list_objects("step-")) or store.blocking.exists(_commit.LATEST)

    # -- writing ---------------------------------------------------------------------

    @staticmethod
    def _prefix(tmp: Path) -> str:
        # ``.tmp-step-N.<token>.<seq>``: the save's own prefix
        return tmp.name.removeprefix(".tmp-")

    def _upload(self, store: Store, tmp: Path, names: list[str]) -> None:
        prefix = self._prefix(tmp)
        items: list[tuple[str, Any]] = []
        maps: list[mmap.mmap] = []
        try:
            for name in names:
                path = tmp / name
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size == 0:
                        items.append((f"{prefix}/{name}", b""))
                        continue
                    # The file's pages: a part is read from them only once the upload
                    # budget has room for it, never the whole file into memory.
                    maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                items.append((f"{prefix}/{name}", maps[-1]))
            if items:
                store.blocking.put_many(items)
        finally:
            items.clear()
            for m in maps:
                with contextlib.suppress(BufferError):
                    m.close()  # a view still held elsewhere: the collector closes it

    @staticmethod
    def _files(tmp: Path) -> list[str]:
        return sorted(
            p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and not p.is_symlink()
        )

    def upload_own(self, tmp: Path, rank: int, world: int) -> None:
        with self._using() as store:
            own = [n for n in self._files(tmp) if (m := _RANK_FILE.match(n)) and int(m.group(1)) == rank]
            self._upload(store, tmp, own)

    def leave(self, tmp: Path, rank: int) -> None:
        """Remove this rank's own files from its scratch copy of the save, and the
        folder once empty. Only its own: on one node the ranks share the scratch folder,
        and the coordinator may still be writing or uploading the rest there."""
        if not tmp.is_dir():
            return
        for name in self._files(tmp):
            m = _RANK_FILE.match(name)
            if m is not None and int(m.group(1)) == rank:
                (tmp / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            tmp.rmdir()  # not empty: the coordinator's (one node), it removes it

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
        prepare()
        prefix = self._prefix(tmp)
        with self._using() as store:
            rest = [n for n in self._files(tmp) if _RANK_FILE.match(n) is None]
            self._upload(store, tmp, rest)
            files = {o.key[len(prefix) + 1 :]: o.size for o in store.blocking.list_objects(prefix + "/")}
            saves = self._list(store)
            record: dict[str, Any] = {
                "format": _FORMAT,
                "step": step,
                "seq": max((s.seq for s in saves), default=-1) + 1,
                "layout": layout,
                "files": files,
                "manifest": file_digest(tmp / _MANIFEST) if (tmp / _MANIFEST).is_file() else None,
            }
            record["check"] = _check(record)
            # The commit point: one PUT of the record, after every rank's files.
            store.blocking.put_record(f"{prefix}/{_RECORD}", _canonical(record).encode(), if_absent=True)
            # After it the step is committed: what fails from here on is a warning.
            committed()
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                store.blocking.put_record(_commit.LATEST, (_commit.step_name(step) + "\n").encode())
            except StoreError as exc:
                _log.warning("%s: step %d is committed, but latest was not updated: %s", self.url, step, exc)
            self.retain(store, keep)

    def retain(self, store: Store, keep: int) -> list[int]:
        """Mark all but the ``keep`` newest commits retired (and the older commits of a
        step saved again); delete what was retired ``RETIRE_GRACE`` seconds ago and what
        dead writers left. Never raises (after the commit point): a warning, retried at
        the next commit."""
        try:
            return self._retain(store, keep)
        except StoreError as exc:
            _log.warning("%s: old checkpoints not retired (retried at the next commit): %s", self.url, exc)
            return []

    def _retain(self, store: Store, keep: int) -> list[int]:
        saves = self._list(store)
        live = self._live(saves)
        doomed = [s for s in saves if s.committed and s not in live]  # replaced by a newer commit
        old = live[:-keep] if keep > 0 else []
        for save in doomed + old:
            store.blocking.put_record(f"{save.prefix}/{_RETIRED}", b"retired\n")
            store.blocking.delete(f"{save.prefix}/{_RECORD}")
        now = max((t for s in saves if (t := s.newest()) is not None), default=None)
        now = now or datetime.datetime.now(datetime.timezone.utc)
        dead: list[_Save] = []
        for save in saves:
            newest = save.newest()
            age = (now - newest).total_seconds() if newest is not None else 0.0
            if save.retired is not None and save.retired.modified is not None:
                if (now - save.retired.modified).total_seconds() >= RETIRE_GRACE:
                    dead.append(save)
            elif save.record is None and save.record_info is None and age >= STALE_AFTER:
                dead.append(save)
        for save in dead:
            # Its objects, the mark last (until then it is still known retired).
            keys = [o.key for o in save.objects if o is not save.retired]
            store.blocking.delete(keys)
            store.blocking.delete(f"{save.prefix}/{_RETIRED}")
        if dead:
            prefixes = {s.prefix for s in dead}
            stale = [u for u in store.blocking.list_uploads("step-") if u.key.split("/", 1)[0] in prefixes]
            if stale:
                store.blocking.abort_uploads(stale)
        return [s.step for s in old]

    # -- reading ---------------------------------------------------------------------

    def _clean_reads(self) -> None:
        """Remove the local copies that dead readers left (their pid is gone)."""
        if not self.scratch.is_dir():
            return
        for path in self.scratch.glob(".read-*"):
            m = re.match(r"^\.read-.+\.(\d+)\.[0-9a-f]+$", path.name)
            if m is None:
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[tuple[Path, int, bool]]:
        """Download committed ``step``'s objects in parallel (ranged GETs straight into
        the local files' pages), check its manifest against the record, yield the local
        copy; removed after the block. An object gone meanwhile (retired beyond the
        grace period): ``StepGone``."""
        with self._using() as store:
            found = [s for s in self._live(self._list(store)) if s.step == step]
            if not found:
                raise _commit.StepGone(step)
            save = found[0]
            assert save.record is not None
            self.scratch.mkdir(parents=True, exist_ok=True)
            folder = self.scratch / f".read-{save.prefix}.{os.getpid()}.{secrets.token_hex(4)}"
            folder.mkdir()
            try:
                self._download(store, save, folder)
                yield folder, save.seq, False
            except StagingError as exc:
                # Name the step's objects, not the local copy that is removed now.
                exc.message = exc.message.replace(str(folder), store.url(save.prefix))
                exc.args = (exc.message, *exc.args[1:])
                raise
            finally:
                shutil.rmtree(folder, ignore_errors=True)

    def _download(self, store: Store, save: _Save, folder: Path) -> None:
        record = save.record
        assert record is not None
        items: list[tuple[str, Any]] = []
        maps: list[mmap.mmap] = []
        try:
            for name, size in record["files"].items():
                path = folder / name
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "w+b") as f:
                    if not size:
                        continue
                    f.truncate(int(size))
                    maps.append(mmap.mmap(f.fileno(), int(size)))
                items.append((f"{save.prefix}/{name}", maps[-1]))
            try:
                store.blocking.get_many_into(items)
            except StoreError as exc:
                if exc.reason != "missing":
                    raise
                if any(s.prefix == save.prefix for s in self._live(self._list(store))):
                    # Still committed (retention retires a step before it deletes an
                    # object): lost or deleted by hand, damage that restore falls back
                    # past. Taken as gone, the step would be listed and tried again
                    # and again, and restore would end with nothing restored.
                    raise IntegrityError(
                        f"{exc.key or store.url(save.prefix)}: missing from committed step "
                        f"{save.step} (deleted or lost; it was not retired)",
                        step=save.step,
                    ) from exc
                raise _commit.StepGone(save.step) from exc
        finally:
            items.clear()
            for m in maps:
                with contextlib.suppress(BufferError):
                    m.close()
        expected = record.get("manifest")
        if expected is not None and file_digest(folder / _MANIFEST) != expected:
            raise IntegrityError(
                f"{store.url(save.prefix)}/{_MANIFEST}: does not match its commit record (damaged)",
                step=save.step,
            )
