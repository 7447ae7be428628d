"""Hand staged tensors to another process without a copy: export and attach.

A stager made with ``share_memory=True`` keeps its host buffers in memfd arenas (one
file descriptor per arena, whatever the number of tensors), and each staged tensor is a
``torch.frombuffer`` view of an exact-size slice of one arena. torch does not see those
storages as shared; ``_mp_reduce`` (imported here) registers reducers so that
``torch.multiprocessing`` sends them by arena reference anyway (one descriptor per arena
per message). ``export_shared`` is the explicit form, for channels that are not torch's
pickler and for copy-on-write views in the writer:

- ``export_shared(staged, stager)`` (training process) returns a ``SharedHandle``: plain,
  picklable data naming each arena the result uses (the owning pid, the descriptor
  number, its size and its inode) and the structure of ``staged`` pickled with every
  tensor replaced by a reference (arena, byte offset, dtype, size, stride, storage
  offset, requires_grad, Parameter or not, lazy conjugate and negative bits; the
  tensor's Python attributes and a Parameter subclass's class go in the structure).
  It copies no tensor data and opens no descriptor. Send it in one message.
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

In the writer, ``AttachedStateDict.close()`` drops the structure and the mappings; an
arena is unmapped (and the descriptor Python's ``mmap`` keeps is closed) when the last
tensor viewing it dies: at once if the writer kept none. A tensor the writer kept stays
valid memory until it dies.

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

from async_stager._core.aio.internals import internals_of
from async_stager._core.options import StagerOptions
from async_stager._core.plan.views import lazy_bits, view_on
from async_stager._share import reducers as _mp_reduce  # noqa: F401  - registers the torch.multiprocessing reducers
from async_stager.errors import ClosedError, HostAllocationError, StagingError, UnsupportedError

__all__ = ["AttachedStateDict", "SharedArenaRef", "SharedHandle", "attach_shared", "export_shared"]

#: torch.dtype -> its attribute name in torch ("float32"), sent instead of the object.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    v: str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)
}


@dataclass(frozen=True)
class SharedArenaRef:
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
    arena, byte offset, storage bytes, dtype, size, stride, storage offset,
    requires_grad, whether it is a Parameter, and its lazy math bits (1: conjugate,
    2: negative). ``tensors``/``nbytes``: how many
    tensor references it holds and the bytes of the storages they view (bytes).
    The handle holds no descriptor and no memory: it is only valid while the exporting
    process holds a lease on the staged result.
    """

    arenas: tuple[SharedArenaRef, ...]
    payload: bytes
    refs: tuple[tuple[Any, ...], ...]
    tensors: int
    nbytes: int


def _shared_arenas(stager: Any) -> list[Any]:
    """The stager's live shared arenas, sorted by base address."""
    handle = internals_of(stager)
    options = getattr(stager, "options", None)
    if handle is None or not isinstance(options, StagerOptions):
        raise UnsupportedError(
            f"export_shared needs the Stager or DefaultStager that staged the result, got {type(stager).__name__}"
        )
    if not options.share_memory:
        raise UnsupportedError(
            "export_shared needs a stager made with share_memory=True (Stager(share_memory=True), "
            "or DefaultStager's use_shared_memory=True): its buffers are private memory that "
            "another process cannot map"
        )
    arenas: list[Any] = list(handle.shared_arenas())
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
        #: through persistent_id again: a Python call per element instead of one per tensor.)
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

    def _tensor_ref(self, t: torch.Tensor, requires_grad: bool, param: bool) -> int | None:
        """The index in ``refs`` of a new reference to ``t``, or None if it has no
        bytes to share (or is not on the CPU): then it is pickled by value."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or t.device.type != "cpu":
            return None
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
                requires_grad,
                param,
                lazy_bits(t),  # not in its bytes (see _core/plan/views)
            )
        )
        return len(self.refs) - 1

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            seen = self._seen.get(id(obj))
            if seen is not None:
                return seen  # the same tensor object again: the same object there
            if obj.__dict__:
                return None  # Python attributes too: see reducer_override
            index = self._tensor_ref(obj, obj.requires_grad, cls is torch.nn.Parameter)
            if index is not None:
                self._seen[id(obj)] = index
            return index
        if cls is _Ref:
            return obj.index
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

    def reducer_override(self, obj: Any) -> Any:
        """A reference for what a bare reference would lose: a tensor's Python
        attributes (``t.__dict__``, state like a plain pickle's), and the class of a
        Parameter subclass whose reduction is Parameter's own (which rebuilds a plain
        Parameter). Everything else: NotImplemented (pickled as usual)."""
        cls = type(obj)
        if cls is torch.Generator:
            # Its state is a small tensor made by its reduction (in no arena): by value.
            seed, offset, state = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)[2]
            return (_rebuild_generator, (str(obj.device), seed, offset, state.numpy().tobytes()))
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            sub = None
            index = self._tensor_ref(obj, obj.requires_grad, cls is torch.nn.Parameter)
        elif (
            issubclass(cls, torch.nn.Parameter)
            and cls.__reduce_ex__ is torch.nn.Parameter.__reduce_ex__
            and cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        ):
            sub = cls
            index = self._tensor_ref(obj, False, False)
        else:
            return NotImplemented
        if index is None:
            return NotImplemented
        args = (_Ref(index),) if sub is None else (_Ref(index), sub, obj.requires_grad)
        # The state goes through BUILD (after the tensor is memoized): an attribute
        # that refers back to the tensor is the tensor itself there too.
        return (
            _rebuild_tensor,
            args,
            torch._utils._get_obj_state(obj) or None,
            None,
            None,
            _set_tensor_state,
        )


def _rebuild_generator(device: str, seed: Any, offset: Any, state: bytes) -> torch.Generator:
    g = torch.Generator(device)
    g.__setstate__((seed, offset, torch.frombuffer(bytearray(state), dtype=torch.uint8)))
    return g


class _Ref:
    """A reference's index in ``refs``, pickled as that persistent id."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _rebuild_tensor(
    t: torch.Tensor, cls: type[torch.Tensor] | None = None, requires_grad: bool = False
) -> Any:
    """(In the attaching process.) The referenced tensor, as ``cls`` if given."""
    if cls is None:
        return t
    return torch.Tensor._make_subclass(cls, t, requires_grad)


def _set_tensor_state(t: torch.Tensor, state: Any) -> None:
    """(In the attaching process.) A tensor's Python attributes, as torch's unpickling
    sets them."""
    torch._utils._set_obj_state(t, state)


def export_shared(staged: Any, stager: Any) -> SharedHandle:
    """A ``SharedHandle`` for ``staged``, a result of ``stager`` (``share_memory=True``).

    No tensor data is copied and no descriptor is opened: the cost is one pickle of the
    structure's metadata (a few microseconds per tensor) on the calling thread. Call it
    while holding a lease (``async with stager.snapshot(sd) as staged:``) and keep the
    lease until the receiving process is done with the tensors.

    Raises UnsupportedError if the stager does not use shared memory, or if a tensor in
    ``staged`` is not in its buffers (a source tensor, or the result of another stager).
    Plain tensors and Parameters (and Parameter subclasses that keep Parameter's
    pickling) are sent as references, with their lazy conjugate/negative bits, Python
    attributes and class; other tensor subclasses are pickled by their own protocol,
    with their inner storages sent as references.
    Non-tensor values are pickled by value, a ``torch.Generator``'s state too.
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
    refs: list[SharedArenaRef] = [None] * len(exporter.used)  # type: ignore[list-item]
    pid = os.getpid()
    for i, slot in exporter.used.items():
        a = arenas[i]
        st = os.fstat(a.fd)
        refs[slot] = SharedArenaRef(pid=pid, fd=a.fd, nbytes=a.nbytes, dev=st.st_dev, ino=st.st_ino)
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
            slot, offset, nbytes, dtype, size, stride, storage_offset, requires_grad, param, math_bits = ref[
                1:
            ]
            storage = self._storage(slot, offset, nbytes)
            t = view_on(storage, getattr(torch, dtype), storage_offset, size, stride, math_bits)
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
    keep their mapping, and its descriptor, alive until they die). Use it as a context
    manager. After ``close()``, ``state_dict`` and ``with`` raise ClosedError.
    """

    def __init__(self, state_dict: Any, maps: list[mmap.mmap], handle: SharedHandle) -> None:
        self._state_dict: Any = state_dict
        self.handle = handle
        self._maps = maps
        self._closed = False

    @property
    def state_dict(self) -> Any:
        """The rebuilt structure. Raises ClosedError once closed."""
        if self._closed:
            raise ClosedError(
                "this AttachedStateDict is closed (tensors taken from it before close stay "
                "valid); attach the handle again, while the exporter holds the lease"
            )
        return self._state_dict

    @property
    def closed(self) -> bool:
        return self._closed

    def spans(self) -> list[tuple[int, int]]:
        """(address, bytes) of this process's mapping of each arena, in the order of
        ``handle.arenas``: where each attached tensor's bytes lie in its arena (a
        reader of the arenas' descriptors can fetch them without touching the
        mapping). Raises ClosedError once closed."""
        if self._closed:
            raise ClosedError("this AttachedStateDict is closed")
        out = []
        for mm in self._maps:
            view = torch.frombuffer(mm, dtype=torch.uint8, count=1) if len(mm) else None
            out.append((view.data_ptr() if view is not None else 0, len(mm)))
        return out

    def close(self) -> None:
        """Drop the structure and the mappings; each arena is unmapped, and its
        descriptor closed, when the last tensor viewing it dies (at once if the caller
        kept none). Idempotent."""
        # Hazard: never mm.close() here (as in _arena.Arena._release_mapping):
        # torch.frombuffer keeps a reference to the mmap object but no buffer export,
        # so close() would unmap memory that tensors the caller kept still view (a
        # segfault on their next read). Dropping our references instead unmaps it when
        # the last of them dies.
        self._closed = True
        self._state_dict = None
        self._maps = []

    def __enter__(self) -> AttachedStateDict:
        if self._closed:
            raise ClosedError("this AttachedStateDict is closed; attach the handle again")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _map_arena(ref: SharedArenaRef, writable: bool) -> mmap.mmap:
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
    except BaseException:
        for mm in maps:
            mm.close()  # nothing views them yet
        raise
    try:
        state_dict = _Attacher(handle, maps).load()
    except BaseException:
        # Tensors built before the failure may still view the mappings (an object's
        # reduction can keep them): drop the references, never mm.close() (see
        # AttachedStateDict.close).
        maps.clear()
        raise
    return AttachedStateDict(state_dict, maps, handle)
