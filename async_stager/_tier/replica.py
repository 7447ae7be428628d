"""Replicas of memory snapshots on another node: placement, the transfer, pacing.

Placement (``ring``): the ranks are grouped by the agent they talk to (a node: its host
name and its agent's socket path), nodes ordered by their lowest rank; the ranks of
node *i* replicate to node *i+1* (the last to the first), the *j*-th rank of a node to
the *j*-th of the next (modulo its size). Losing any one node leaves each of its ranks'
snapshots on the next node and the next node's own snapshots on itself. With one node
there is no replica.

Transport: torch.distributed point-to-point ``send``/``recv`` on a gloo group of the
tier's own (TCP), never training's communicator; ranks here are the group's. A snapshot goes as a header (a fixed
int64 tensor), its description (JSON: step, timeline, arena sizes, references,
digests), its pickled structure, then its arenas in chunks of ``chunk_bytes`` read
straight from the sender's mapping of its memfds and received straight into memfds of
the receiver (no staging copy on either side). ``Pacer`` spaces the chunks: the link is
busy at most ``share`` of the time (each chunk's send measured) and at most ``rate``
bytes per second.

Verification: the receiver hands the replica to its own agent (``BEGIN``/``COMMIT``
in the namespace ``replica_namespace(ns)``, under the source rank), which re-hashes
every region against the digests the source computed before it sent: a replica torn
by a sender lost mid-transfer is never committed, one with a changed byte is refused.
The receiver answers the sender (``Ack``) only after that: a snapshot counts as
replicated when its peer verified it.
"""

from __future__ import annotations

import enum
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ACK_TAG",
    "BYE",
    "DATA_TAG",
    "RESTORE_TAG",
    "NOTHING",
    "SNAPSHOT",
    "Ack",
    "Incoming",
    "Outgoing",
    "Pacer",
    "Replication",
    "receive_snapshot",
    "recv_ack",
    "replica_namespace",
    "ring",
    "send_ack",
    "send_bye",
    "send_nothing",
    "send_snapshot",
]

_log = logging.getLogger("async_stager.checkpoint")

#: gloo tags: a snapshot's parts (sender to receiver), the receiver's answer, a
#: restore's transfer (holder to restored rank).
DATA_TAG = 4501
ACK_TAG = 4502
RESTORE_TAG = 4503
_MAGIC = 0x4153_5245  # "ASRE"
#: Header kinds.
SNAPSHOT = 1
BYE = 2
NOTHING = 3


class Ack(enum.IntEnum):
    """The receiver's answer: its agent holds the replica verified, or why not."""

    HELD = 1
    MEMORY = 2  # the peer agent's memory bound: this step's replication skipped
    REFUSED = 3  # the peer agent refused it (a checksum: changed while it was sent)
    NO_AGENT = 4  # the peer's agent is away


@dataclass(frozen=True)
class Replication:
    """How replicas are sent: ``share`` of the time the link may be busy (0 < share
    <= 1, each chunk's send measured), ``rate`` bytes per second at most (None: no
    cap), ``chunk_bytes`` per send."""

    share: float = 0.1
    rate: float | None = None
    chunk_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        from async_stager.errors import InvalidOptionError

        if (
            isinstance(self.share, bool)
            or not isinstance(self.share, (int, float))
            or not 0 < self.share <= 1
        ):
            raise InvalidOptionError(f"replica_share must be a number in (0, 1], got {self.share!r}")
        if self.rate is not None and (
            isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not self.rate > 0
        ):
            raise InvalidOptionError(f"replica_rate must be None or bytes per second > 0, got {self.rate!r}")
        if (
            isinstance(self.chunk_bytes, bool)
            or not isinstance(self.chunk_bytes, int)
            or self.chunk_bytes < 1
        ):
            raise InvalidOptionError(
                f"the replica chunk must be an int >= 1 (bytes), got {self.chunk_bytes!r}"
            )


def replica_namespace(ns: str) -> str:
    """The agent namespace of the replicas of namespace ``ns`` (never a rank's own)."""
    return f"{ns}#replica"


def ring(nodes: Sequence[Any]) -> dict[int, int]:
    """Rank -> the rank that holds its replicas, for ``nodes[rank]`` each rank's node
    (anything comparable for equality): see the module doc. {} with one node."""
    order: list[Any] = []
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in order:
            order.append(node)
        members.setdefault(order.index(node), []).append(rank)
    if len(order) < 2:
        return {}
    peers = {}
    for i in range(len(order)):
        nxt = members[(i + 1) % len(order)]
        for j, rank in enumerate(members[i]):
            peers[rank] = nxt[j % len(nxt)]
    return peers


class Pacer:
    """Spaces chunks: after a chunk of ``nbytes`` that took ``seconds`` to send, waits
    so that the link is busy at most ``share`` of the time and ``rate`` is not passed.
    ``stop`` ends a wait at once. ``busy``/``sent``: seconds sending, bytes sent."""

    def __init__(self, options: Replication, stop: threading.Event | None = None) -> None:
        self.options = options
        self.stop = stop if stop is not None else threading.Event()
        self.busy = 0.0
        self.sent = 0

    def after(self, nbytes: int, seconds: float) -> None:
        self.busy += seconds
        self.sent += nbytes
        share, rate = self.options.share, self.options.rate
        wait = seconds * (1.0 - share) / share
        if rate is not None:
            wait = max(wait, nbytes / rate - seconds)
        if wait > 0:
            self.stop.wait(wait)


@dataclass
class Outgoing:
    """A snapshot to send: its description (JSON-able: step, timeline, world, rank,
    arenas, refs, digests, piece_bytes, tensors, nbytes), its pickled structure and
    its arenas' descriptors (this process's, readable while the caller holds them)."""

    body: dict[str, Any]
    payload: bytes
    fds: list[int]


@dataclass
class Incoming:
    """A snapshot received: its description, structure and this process's own memfds
    holding its arenas (close them: ``close``)."""

    body: dict[str, Any]
    payload: bytes
    fds: list[int]

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _send(t: torch.Tensor, dst: int, group: Any, tag: int) -> None:
    import torch.distributed as dist

    dist.send(t, group=group, tag=tag, group_dst=dst)


def _recv(t: torch.Tensor, src: int, group: Any, tag: int) -> None:
    import torch.distributed as dist

    dist.recv(t, group=group, tag=tag, group_src=src)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _head(kind: int, step: int = -1, jlen: int = 0, plen: int = 0, total: int = 0) -> torch.Tensor:
    return torch.tensor([_MAGIC, kind, step, jlen, plen, total], dtype=torch.int64)


def send_bye(group: Any, dst: int, tag: int = DATA_TAG) -> None:
    """Tell ``dst``'s receiver no more snapshots come (this rank closes)."""
    _send(_head(BYE), dst, group, tag)


def send_nothing(group: Any, dst: int, tag: int = RESTORE_TAG) -> None:
    """A restore's transfer that has no snapshot to give (the holder could not read it)."""
    _send(_head(NOTHING), dst, group, tag)


def send_snapshot(
    group: Any,
    dst: int,
    out: Outgoing,
    *,
    options: Replication,
    pacer: Pacer | None = None,
    tag: int = DATA_TAG,
    abandon: Callable[[], bool] = lambda: False,
) -> bool:
    """Send ``out`` to rank ``dst`` of ``group`` (blocking: run it in a thread), its
    arenas in chunks spaced by ``pacer``. ``abandon()``, asked before each chunk: True
    sends the rest as zeros at once (the receiver's verification then refuses it).
    Returns False if it was abandoned. Raises what gloo raises (the peer is gone)."""
    sizes = [int(n) for n in out.body["arenas"]]
    chunk = options.chunk_bytes
    body = json.dumps({**out.body, "chunk": chunk}, separators=(",", ":")).encode()
    _send(_head(SNAPSHOT, int(out.body["step"]), len(body), len(out.payload), sum(sizes)), dst, group, tag)
    _send(_bytes_tensor(body), dst, group, tag)
    if out.payload:
        _send(_bytes_tensor(out.payload), dst, group, tag)
    whole = True
    last = (len(sizes) - 1, max(0, (sizes[-1] - 1) // chunk * chunk)) if sizes else (-1, -1)
    for slot, (fd, n) in enumerate(zip(out.fds, sizes)):
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            arena = torch.frombuffer(mm, dtype=torch.uint8)
            for a in range(0, n, chunk):
                part = arena[a : min(a + chunk, n)]
                if whole and abandon():
                    whole = False
                if not whole:
                    part = torch.zeros(part.numel(), dtype=torch.uint8)
                t0 = time.monotonic()
                _send(part, dst, group, tag)
                if pacer is not None and whole and (slot, a) != last:  # no wait after the last
                    pacer.after(part.numel(), time.monotonic() - t0)
            del arena, part
        finally:
            _close_map(mm)
    return whole


def receive_snapshot(group: Any, src: int, *, tag: int = DATA_TAG) -> Incoming | int:
    """The next message from rank ``src``: a snapshot received into new memfds of this
    process, or its kind (``BYE``, ``NOTHING``). Blocking; raises what gloo raises."""
    head = torch.zeros(6, dtype=torch.int64)
    _recv(head, src, group, tag)
    magic, kind, _step, jlen, plen, _total = (int(x) for x in head.tolist())
    if magic != _MAGIC or kind not in (SNAPSHOT, BYE, NOTHING):
        raise RuntimeError(f"a replica from rank {src} began with a bad header {head.tolist()}")
    if kind != SNAPSHOT:
        return kind
    jbuf = torch.empty(jlen, dtype=torch.uint8)
    _recv(jbuf, src, group, tag)
    body = json.loads(bytes(jbuf.numpy()))
    payload = b""
    if plen:
        pbuf = torch.empty(plen, dtype=torch.uint8)
        _recv(pbuf, src, group, tag)
        payload = bytes(pbuf.numpy())
    got = Incoming(body, payload, [])
    chunk_bytes = int(body.get("chunk", 4 << 20))
    try:
        for n in (int(x) for x in body["arenas"]):
            fd = os.memfd_create("async-stager-replica", os.MFD_CLOEXEC)
            got.fds.append(fd)
            os.ftruncate(fd, n)
            mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                arena = torch.frombuffer(mm, dtype=torch.uint8)
                for a in range(0, n, chunk_bytes):
                    _recv(arena[a : min(a + chunk_bytes, n)], src, group, tag)
                del arena
            finally:
                _close_map(mm)
    except BaseException:
        got.close()
        raise
    return got


def send_ack(group: Any, dst: int, step: int, ack: Ack) -> None:
    _send(torch.tensor([step, int(ack)], dtype=torch.int64), dst, group, ACK_TAG)


def recv_ack(group: Any, src: int) -> tuple[int, Ack]:
    t = torch.zeros(2, dtype=torch.int64)
    _recv(t, src, group, ACK_TAG)
    return int(t[0]), Ack(int(t[1]))


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # pragma: no cover - a view still alive: unmapped when collected
        pass
