"""The agent's protocol: small framed messages over a Unix socket, descriptors beside them.

A message is a fixed 20-byte header, a JSON object and an opaque blob::

    magic b"ASTA" | version u8 | kind u8 | descriptors u16 | json bytes u32 | blob bytes u64

(network byte order). The header goes in one ``sendmsg`` with the message's file
descriptors as SCM_RIGHTS ancillary data (``socket.send_fds``), so the descriptors
arrive with the header they belong to; the JSON and the blob follow as plain bytes.
A receiver refuses another magic or version (``AgentRefusedError``, ``"version"``) and
sizes past ``MAX_JSON``/``MAX_BLOB``/``MAX_FDS`` before reading them.

Descriptors passed this way are duplicates in the receiving process: the memory they
name lives as long as any process holds one (or a mapping of it). Nothing has a name
in a file system, so nothing is left behind when a process dies.

The socket's path derives from the job id (``socket_path``), in a directory of this
user only (mode 0700, checked), and the socket itself is mode 0600. The agent also
checks every peer's credentials (``SO_PEERCRED``): ``check_peer`` is the decision,
``peer_uid`` the kernel's answer (the seam a test replaces).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import socket
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any

from anyio.abc import SocketAttribute, SocketStream

from async_stager.errors import AgentError, AgentRefusedError, AgentUnavailableError

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_BLOB",
    "MAX_FDS",
    "MAX_JSON",
    "VERSION",
    "Kind",
    "Message",
    "check_peer",
    "close_fds",
    "error_message",
    "int_field",
    "peer_uid",
    "receive",
    "retention_of",
    "runtime_dir",
    "send",
    "socket_path",
]

MAGIC = b"ASTA"
#: The protocol's version: a peer speaking another one is refused, never guessed at.
#: 2: ``RETAIN``; retention decided by the trainer (``protect``, ``floor``), ``timeline``.
VERSION = 2
HEADER = struct.Struct("!4sBBHIQ")
#: Bounds a receiver checks before it reads: a JSON body, a blob (a snapshot's pickled
#: structure), descriptors per message (the kernel's SCM_MAX_FD is 253).
MAX_JSON = 64 << 20
MAX_BLOB = 1 << 30
MAX_FDS = 253
#: Unix socket paths are at most 107 bytes on Linux.
_MAX_PATH = 107


class Kind(enum.IntEnum):
    """What a message is. Requests from a trainer, answers from the agent."""

    HELLO = 1
    BEGIN = 2
    COMMIT = 3
    LIST = 4
    FETCH = 5
    STATUS = 6
    RETAIN = 7
    OK = 64
    ERROR = 65


@dataclass
class Message:
    """One message: ``kind``, a JSON-able ``body``, an opaque ``blob`` and ``fds`` (owned
    by whoever holds the message once received: close them, ``close_fds``)."""

    kind: Kind
    body: dict[str, Any] = field(default_factory=dict)
    blob: bytes = b""
    fds: list[int] = field(default_factory=list)


def close_fds(fds: list[int]) -> None:
    """Close every descriptor in ``fds`` (ignoring ones already closed) and empty it."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


async def send(stream: SocketStream, message: Message) -> None:
    """Send ``message`` (its descriptors stay open here: the receiver gets duplicates).
    Raises AgentUnavailableError if the peer is gone. Cancellation: the stream may
    then hold half a message; the caller closes it (every caller here does)."""
    body = json.dumps(message.body, separators=(",", ":")).encode()
    if len(message.fds) > MAX_FDS or len(body) > MAX_JSON or len(message.blob) > MAX_BLOB:
        raise AgentError(
            f"a {message.kind.name} message is too big for the agent's protocol: {len(message.fds)} "
            f"descriptors (at most {MAX_FDS}), {len(body)} JSON bytes (at most {MAX_JSON}), "
            f"{len(message.blob)} blob bytes (at most {MAX_BLOB})"
        )
    header = HEADER.pack(MAGIC, VERSION, int(message.kind), len(message.fds), len(body), len(message.blob))
    try:
        if message.fds:
            await stream.send_fds(header, message.fds)  # type: ignore[attr-defined]
        else:
            await stream.send(header)
        if body:
            await stream.send(body)
        if message.blob:
            await stream.send(message.blob)
    except (OSError, EOFError, _broken()) as exc:
        raise AgentUnavailableError(f"the connection to the agent broke while sending: {exc!r}") from exc


def _broken() -> type[Exception]:
    import anyio

    return anyio.BrokenResourceError


async def _exactly(stream: SocketStream, n: int) -> bytes:
    import anyio

    parts: list[bytes] = []
    while n > 0:
        try:
            chunk = await stream.receive(min(n, 1 << 20))
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError) as exc:
            raise AgentUnavailableError("the connection to the agent closed mid-message") from exc
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


async def receive(stream: SocketStream) -> Message | None:
    """The next message, or None at a clean end of stream (the peer closed between
    messages). Raises AgentRefusedError for another protocol or sizes past the bounds,
    AgentUnavailableError for a connection that broke mid-message. Cancellation: the
    descriptors of a message half received are closed; the stream must be closed."""
    import anyio

    head = b""
    fds: list[int] = []
    try:
        while len(head) < HEADER.size:
            try:
                data, got = await stream.receive_fds(HEADER.size - len(head), MAX_FDS)  # type: ignore[attr-defined]
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError) as exc:
                if not head:
                    return None
                raise AgentUnavailableError("the connection to the agent closed mid-message") from exc
            fds += got
            if not data:
                if not head and not fds:
                    return None
                raise AgentUnavailableError("the connection to the agent closed mid-message")
            head += data
        magic, version, kind, nfds, jlen, blen = HEADER.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise AgentRefusedError(
                f"a peer spoke another protocol (magic {magic!r}, version {version}; this one is "
                f"{MAGIC!r} version {VERSION}): start the agent from the same async_stager version",
                reason="version",
            )
        if nfds != len(fds) or jlen > MAX_JSON or blen > MAX_BLOB:
            raise AgentRefusedError(
                f"a malformed message: {len(fds)} descriptors arrived for {nfds} announced, "
                f"{jlen} JSON bytes, {blen} blob bytes",
                reason="request",
            )
        try:
            kind_ = Kind(kind)
        except ValueError:
            raise AgentRefusedError(f"unknown message kind {kind}", reason="request") from None
        try:
            body = json.loads(await _exactly(stream, jlen)) if jlen else {}
        except ValueError as exc:  # UnicodeDecodeError too
            raise AgentRefusedError(f"a message body is not JSON: {exc}", reason="request") from exc
        if not isinstance(body, dict):
            raise AgentRefusedError("a message body is not a JSON object", reason="request")
        blob = await _exactly(stream, blen) if blen else b""
    except BaseException:
        close_fds(fds)
        raise
    return Message(kind_, body, blob, fds)


# -- where the socket is, and who may use it ---------------------------------------------


def runtime_dir(base: str | None = None) -> str:
    """This user's directory for agent sockets: ``<base>/async_stager-<uid>``, where
    ``base`` is the argument, else ``$XDG_RUNTIME_DIR`` (if it is a directory), else
    the temporary directory (``/tmp``). Made mode 0700 if missing; AgentError if it
    exists but is another user's, not a directory, or open to others (someone could
    put their own socket there)."""
    if base is None:
        xdg = os.environ.get("XDG_RUNTIME_DIR", "")
        base = xdg if xdg and os.path.isdir(xdg) else tempfile.gettempdir()
    uid = os.getuid()
    path = os.path.join(base, f"async_stager-{uid}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise AgentError(f"cannot make the agent socket directory {path}: {exc}") from exc
    st = os.lstat(path)
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise AgentError(
            f"{path} must be a directory of uid {uid} with mode 0700 (it is uid {st.st_uid}, mode "
            f"{oct(st.st_mode & 0o7777)}): remove it or fix it, or set XDG_RUNTIME_DIR",
            socket=path,
        )
    return path


def socket_path(job: str, base: str | None = None) -> str:
    """The agent socket of job ``job`` (a non-empty string) on this node, for this user
    (see ``runtime_dir``). A job id with other characters than letters, digits, ``._-``
    or longer than a socket path allows gets a hash of it in the name: two job ids never
    share a socket."""
    if not isinstance(job, str) or not job:
        from async_stager.errors import InvalidOptionError

        raise InvalidOptionError(f"the agent's job id must be a non-empty string, got {job!r}")
    folder = runtime_dir(base)
    name = job
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", job) or len(folder) + len(job) + 12 > _MAX_PATH:
        digest = hashlib.sha256(job.encode()).hexdigest()[:16]
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[: max(0, _MAX_PATH - len(folder) - 30)] + "-" + digest
    path = os.path.join(folder, f"agent-{name}.sock")
    if len(path) > _MAX_PATH:
        raise AgentError(f"the agent socket path {path} is longer than {_MAX_PATH} bytes: use a shorter base")
    return path


def peer_uid(stream: SocketStream) -> int:
    """The uid of the process at the other end of ``stream``, as the kernel recorded it
    when it connected (``SO_PEERCRED``)."""
    sock: socket.socket = stream.extra(SocketAttribute.raw_socket)
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def check_peer(peer: int, own: int) -> None:
    """Refuse a peer of another uid than this process's (AgentRefusedError, ``"peer"``):
    the snapshots are the user's training state. The socket's directory (0700) and mode
    (0600) keep others out already; this holds even where those were loosened."""
    if peer != own:
        raise AgentRefusedError(
            f"refused a connection from uid {peer}: this agent serves uid {own} only", reason="peer"
        )


# -- requests ----------------------------------------------------------------------


def int_field(body: dict[str, Any], key: str, low: int = 0) -> int:
    """A request's int field ``key`` (at least ``low``), else AgentRefusedError."""
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise AgentRefusedError(f"{key} must be an int >= {low}, got {v!r}", reason="request")
    return v


def retention_of(body: dict[str, Any]) -> tuple[frozenset[int], int | None]:
    """A message's ``protect`` (steps) and ``floor`` (a step, or None)."""
    protect = body.get("protect", [])
    if not isinstance(protect, list) or not all(
        isinstance(p, int) and not isinstance(p, bool) for p in protect
    ):
        raise AgentRefusedError(f"protect must be a list of steps, got {protect!r}", reason="request")
    floor = body.get("floor")
    if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int)):
        raise AgentRefusedError(f"floor must be a step or null, got {floor!r}", reason="request")
    return frozenset(protect), floor


def error_message(exc: AgentRefusedError) -> Message:
    """The ERROR answer that carries a refusal's reason and message."""
    return Message(Kind.ERROR, {"reason": exc.reason, "message": exc.message})
