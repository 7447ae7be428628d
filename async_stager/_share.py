"""Hand staged tensors to another process without a copy: export and attach.

A stager made with ``share_memory=True`` keeps its host buffers in memfd arenas (one
file descriptor per arena, whatever the number of tensors), and each staged tensor is a
``torch.frombuffer`` view of an exact-size slice of one arena. torch does not see those
storages as shared, so pickling them through ``torch.multiprocessing`` would copy every
byte into new shared-memory segments, one descriptor per storage, in the training
process. ``export_shared`` sends the arenas instead:

- ``export_shared(staged, stager)`` (training process) returns a ``SharedHandle``: plain,
  picklable data naming each arena the result uses (the owning pid, the descriptor
  number, its size and its inode) and the structure of ``staged`` pickled with every
  tensor replaced by a reference (arena, byte offset, dtype, size, stride, storage
  offset). It copies no tensor data and opens no descriptor. Send it in one message.
- ``attach_shared(handle)`` (writer process) opens each arena once through
  ``/proc/<pid>/fd/<fd>``, maps it (one ``mmap`` per arena, not per tensor) and
  rebuilds the structure around ``torch.frombuffer`` views of the mapping: the same
  physical pages the training process staged into.

Ownership and validity: the handle does not keep the buffers unchanged; a lease does.
Export inside ``async with stager.snapshot(sd) as staged:`` and leave the block only
after the writer has said it is done; until then no later stage writes into those
buffers (they go to another buffer set). Once the lease is released the next stage may
overwrite what the writer sees. The writer's mapping keeps the memory alive even if the
training process closes its stager, but attaching needs the training process's arena
descriptors: attach while the lease is held.

The writer may not change the training process's buffers by accident: by default the
mapping is private (copy-on-write), so in-place writes in the writer stay in the writer.
``writable=True`` maps shared and read-write, for writers that hand data *back*.

Requirements: Linux ``/proc`` (or any system where ``/proc/<pid>/fd`` reopens a
descriptor), both processes under the same user (the kernel checks ptrace read access).
"""

from __future__ import annotations

import bisect
import io
import mmap
import os
import pickle
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from ._errors import HostAllocationError, StagingError, UnsupportedError

__all__ = ["AttachedStateDict", "SharedArena", "SharedHandle", "attach_shared", "export_shared"]

#: torch.dtype -> its attribute name in torch ("float32"), sent instead of the object.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    v: str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)
}


@dataclass(frozen=True)
class SharedArena:
    """One shared arena as another process can reach it: ``/proc/<pid>/fd/<fd>``,
    ``nbytes`` bytes long, identified by its inode (``dev``, ``ino``) so a descriptor
    number reused for another file is detected instead of mapped."""

    pid: int
    fd: int
    nbytes: int
    dev: int
    ino: int

    @property
    def path(self) -> str:
        """The path that reopens the arena from another process."""
        return f"/proc/{self.pid}/fd/{self.fd}"


@dataclass(frozen=True)
class SharedHandle:
    """A staged state dict as plain, picklable data (see ``export_shared``).

    ``arenas``: the arenas the tensors live in. ``payload``: the structure, pickled,
    with each tensor as an index into ``refs``; ``refs``: per tensor (or storage) its
    arena, byte offset, storage bytes, dtype, size, stride, storage offset. ``tensors``/``nbytes``: how many
    tensor references it holds and the bytes of the storages they view (bytes).
    The handle holds no descriptor and no memory: it is only valid while the exporting
    process holds a lease on the staged result.
    """

    arenas: tuple[SharedArena, ...]
    payload: bytes
    refs: tuple[tuple[Any, ...], ...]
    tensors: int
    nbytes: int


def _engine_of(stager: Any) -> Any:
    engine = getattr(stager, "_engine", None)
    if engine is None or not hasattr(engine, "options"):
        raise UnsupportedError(
            f"export_shared needs the Stager or DefaultStager that staged the result, got {type(stager).__name__}"
        )
    return engine


def _shared_arenas(stager: Any) -> list[Any]:
    """The stager's live shared arenas, sorted by base address."""
    engine = _engine_of(stager)
    if not engine.options.share_memory:
        raise UnsupportedError(
            "export_shared needs a stager made with share_memory=True (Stager(share_memory=True), "
            "or DefaultStager's use_shared_memory=True): its buffers are private memory that "
            "another process cannot map"
        )
    arenas = [a for s in list(engine._sets) for a in list(s.pool.arenas) if a.shared and a.fd >= 0]
    arenas.sort(key=lambda a: a.base)
    return arenas


class _Exporter(pickle.Pickler):
    """Pickles a staged structure, replacing arena-backed storages by references."""

    def __init__(self, file: io.BytesIO, arenas: list[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._arenas = arenas
        self._bases = [a.base for a in arenas]
        self.used: dict[int, int] = {}  # index in self._arenas -> index in the handle
        self.tensors = 0
        self.storages: dict[tuple[int, int], int] = {}
        #: The references; the payload holds only their indices. (A tuple returned by
        #: persistent_id would be pickled element by element, each element passing
        #: through persistent_id again: 14 Python calls per tensor instead of one.)
        self.refs: list[tuple[Any, ...]] = []
        # id(tensor) -> its index in refs (the structure keeps the tensors alive).
        self._seen: dict[int, int] = {}

    def _locate(self, ptr: int, nbytes: int, what: Any) -> tuple[int, int]:
        """(slot in the handle, byte offset in the arena) of bytes [ptr, ptr+nbytes)."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            arena = self._arenas[i]
            if ptr + nbytes <= arena.base + arena.nbytes:
                slot = self.used.get(i)
                if slot is None:
                    slot = self.used[i] = len(self.used)
                self.storages[(slot, ptr - arena.base)] = nbytes
                return slot, ptr - arena.base
        desc = (
            f"a {what.dtype} tensor of shape {tuple(what.shape)}"
            if isinstance(what, torch.Tensor)
            else "a storage"
        )
        raise UnsupportedError(
            f"{desc} is not in this stager's shared buffers (export only the result of a stage "
            "by this stager, while it is leased); sharing it would need a copy"
        )

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            seen = self._seen.get(id(obj))
            if seen is not None:
                return seen  # the same tensor object again: the same object there
            t: torch.Tensor = obj
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or t.device.type != "cpu":
                return None  # nothing to share; pickled by value (a few bytes)
            slot, offset = self._locate(storage.data_ptr(), nbytes, t)
            self.tensors += 1
            self.refs.append(
                (
                    "t",
                    slot,
                    offset,
                    nbytes,
                    _DTYPE_NAMES[t.dtype],
                    tuple(t.shape),
                    t.stride(),
                    t.storage_offset(),
                    t.requires_grad,
                    cls is torch.nn.Parameter,
                )
            )
            self._seen[id(obj)] = index = len(self.refs) - 1
            return index
        if cls is torch.UntypedStorage or cls is torch.TypedStorage:
            # Tensor subclasses pickle their inner tensors' storages this way.
            untyped = obj if cls is torch.UntypedStorage else obj._untyped_storage
            if untyped.nbytes() == 0 or untyped.device.type != "cpu":
                return None
            slot, offset = self._locate(untyped.data_ptr(), untyped.nbytes(), untyped)
            dtype = None if cls is torch.UntypedStorage else _DTYPE_NAMES[obj.dtype]
            self.refs.append(("s", slot, offset, untyped.nbytes(), dtype))
            return len(self.refs) - 1
        return None


def export_shared(staged: Any, stager: Any) -> SharedHandle:
    """A ``SharedHandle`` for ``staged``, a result of ``stager`` (``share_memory=True``).

    No tensor data is copied and no descriptor is opened: the cost is one pickle of the
    structure's metadata (a few microseconds per tensor) on the calling thread. Call it
    while holding a lease (``async with stager.snapshot(sd) as staged:``) and keep the
    lease until the receiving process is done with the tensors.

    Raises UnsupportedError if the stager does not use shared memory, or if a tensor in
    ``staged`` is not in its buffers (a source tensor, or the result of another stager).
    Plain tensors and Parameters are sent as references; other tensor subclasses are
    pickled by their own protocol, with their inner storages sent as references.
    Non-tensor values are pickled by value.
    """
    arenas = _shared_arenas(stager)
    buf = io.BytesIO()
    exporter = _Exporter(buf, arenas)
    try:
        exporter.dump(staged)
    except StagingError:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise StagingError(f"the staged structure cannot be pickled for another process: {e}") from e
    refs: list[SharedArena] = [None] * len(exporter.used)  # type: ignore[list-item]
    pid = os.getpid()
    for i, slot in exporter.used.items():
        a = arenas[i]
        st = os.fstat(a.fd)
        refs[slot] = SharedArena(pid=pid, fd=a.fd, nbytes=a.nbytes, dev=st.st_dev, ino=st.st_ino)
    return SharedHandle(
        arenas=tuple(refs),
        payload=buf.getvalue(),
        refs=tuple(exporter.refs),
        tensors=exporter.tensors,
        nbytes=sum(exporter.storages.values()),
    )


class _Attacher(pickle.Unpickler):
    """Rebuilds a structure from a handle's payload over the mapped arenas."""

    def __init__(self, handle: SharedHandle, maps: list[mmap.mmap]) -> None:
        super().__init__(io.BytesIO(handle.payload))
        self._refs = handle.refs
        self._built: dict[int, Any] = {}
        self._maps = maps
        self._storages: dict[tuple[int, int, int], torch.UntypedStorage] = {}

    def _storage(self, slot: int, offset: int, nbytes: int) -> torch.UntypedStorage:
        key = (slot, offset, nbytes)
        s = self._storages.get(key)
        if s is None:
            # One exact-size storage per staged storage: aliases in the parent (views
            # of one storage) stay aliases here.
            view = torch.frombuffer(self._maps[slot], dtype=torch.uint8, count=nbytes, offset=offset)
            s = self._storages[key] = view.untyped_storage()
        return s

    def persistent_load(self, pid: Any) -> Any:
        obj = self._built.get(pid)
        if obj is None:
            obj = self._built[pid] = self._build(self._refs[pid])
        return obj

    def _build(self, ref: tuple[Any, ...]) -> Any:
        kind = ref[0]
        if kind == "t":
            _, slot, offset, nbytes, dtype, size, stride, storage_offset, requires_grad, param = ref
            storage = self._storage(slot, offset, nbytes)
            t = torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, storage_offset, size, stride)
            if param:
                return torch.nn.Parameter(t, requires_grad=requires_grad)
            if requires_grad:
                t.requires_grad_(True)
            return t
        if kind == "s":
            _, slot, offset, nbytes, dtype = ref
            storage = self._storage(slot, offset, nbytes)
            if dtype is None:
                return storage
            return torch.TypedStorage(wrap_storage=storage, dtype=getattr(torch, dtype), _internal=True)
        raise pickle.UnpicklingError(f"unknown reference kind {kind!r} in a SharedHandle")


class AttachedStateDict:
    """A state dict attached from another process's shared arenas (``attach_shared``).

    ``state_dict`` is the rebuilt structure; its tensors view this process's mappings
    of the exporting process's arenas (the same physical memory). ``close()`` drops
    the structure and unmaps every arena no tensor still views (tensors the caller kept
    keep their mapping alive until they die). Use it as a context manager.
    """

    def __init__(self, state_dict: Any, maps: list[mmap.mmap], handle: SharedHandle) -> None:
        self.state_dict: Any = state_dict
        self.handle = handle
        self._maps = maps

    @property
    def closed(self) -> bool:
        return self.state_dict is None and not self._maps

    def close(self) -> None:
        """Drop the structure and unmap the arenas (those still viewed: when their last
        tensor dies). Idempotent."""
        self.state_dict = None
        maps, self._maps = self._maps, []
        for mm in maps:
            try:
                mm.close()
            except BufferError:
                pass  # a tensor the caller kept still views it

    def __enter__(self) -> AttachedStateDict:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _map_arena(ref: SharedArena, writable: bool) -> mmap.mmap:
    try:
        fd = os.open(ref.path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as e:
        raise HostAllocationError(
            f"cannot open shared arena {ref.path} ({ref.nbytes} bytes): {e}; attach while the "
            "exporting process is alive and holds the lease, as the same user"
        ) from e
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (ref.dev, ref.ino) or st.st_size < ref.nbytes:
            raise StagingError(
                f"{ref.path} is no longer the exported arena (it was closed and the descriptor "
                "reused): attach while the exporting process holds the lease"
            )
        flags = mmap.MAP_SHARED if writable else mmap.MAP_PRIVATE
        try:
            return mmap.mmap(fd, ref.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise HostAllocationError(f"cannot map shared arena {ref.path} ({ref.nbytes} bytes): {e}") from e
    finally:
        os.close(fd)  # the mapping keeps the memory (and Python's mmap its own dup)


def attach_shared(handle: SharedHandle, *, writable: bool = False) -> AttachedStateDict:
    """Map the arenas of ``handle`` (from ``export_shared`` in another process) and
    rebuild the staged structure over them, without copying tensor data.

    One ``mmap`` per arena. ``writable=False`` (default): a private copy-on-write
    mapping; the tensors read the exporter's memory, and in-place writes stay in this
    process (pages written are copied then). ``writable=True``: a shared read-write
    mapping; writes reach the exporter's buffers.

    Raises HostAllocationError if an arena cannot be opened or mapped (the exporting
    process exited or closed it, or another user), StagingError if its descriptor now
    names another file.
    """
    maps: list[mmap.mmap] = []
    try:
        for ref in handle.arenas:
            maps.append(_map_arena(ref, writable))
        state_dict = _Attacher(handle, maps).load()
    except BaseException:
        for mm in maps:
            try:
                mm.close()
            except BufferError:
                pass
        raise
    return AttachedStateDict(state_dict, maps, handle)
