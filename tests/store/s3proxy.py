"""Faults injected at the server: an HTTP/1.1 proxy on loopback in front of moto.

Requests pass through to the S3 server unchanged, unless a ``Rule`` matches (method, a
regex on the path and query, a regex on the headers), in which case, for the next
``times`` matching requests, the proxy answers an S3 error itself (503 SlowDown, 500
InternalError, 403 AccessDenied, QuotaExceeded, InvalidAccessKeyId), resets the
connection (RST) before reading the body, cuts a response body half way (then RST),
or delays the request. Bounded: every rule applies a given number of times; the proxy
serves loopback only and stops with its fixture.

It runs its own asyncio loop in a thread, so tests on any event loop (or none) use it.
``Expect: 100-continue`` (botocore sends it for bodies over 1 MB) is answered here: a
fault is answered before the body is sent, as S3 does.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import threading
from dataclasses import dataclass, field

__all__ = ["FaultProxy", "Rule"]


@dataclass
class Rule:
    """What to do to the next ``times`` requests that match.

    ``action``: ``"error"`` (answer ``status``/``code``), ``"reset"`` (RST before the
    body is read), ``"cut"`` (forward, then send half the answer's body and RST),
    ``"delay"`` (wait ``delay`` seconds, then forward)."""

    action: str
    method: str | None = None
    path: str = ""
    header: str = ""
    times: int = 1
    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."
    delay: float = 0.0
    hits: int = field(default=0)

    def matches(self, method: str, target: str, head: str) -> bool:
        if self.hits >= self.times:
            return False
        if self.method is not None and method != self.method:
            return False
        if self.path and not re.search(self.path, target):
            return False
        return not (self.header and not re.search(self.header, head, re.IGNORECASE))


def slow_down(**kw: object) -> Rule:
    return Rule("error", **kw)  # type: ignore[arg-type]


def internal_error(**kw: object) -> Rule:
    return Rule("error", status=500, code="InternalError", message="We encountered an internal error.", **kw)  # type: ignore[arg-type]


def denied(**kw: object) -> Rule:
    return Rule("error", status=403, code="AccessDenied", message="Access Denied", **kw)  # type: ignore[arg-type]


def quota(**kw: object) -> Rule:
    # Ceph RGW's answer to a bucket or user over its quota (S3 itself has no quota).
    return Rule("error", status=403, code="QuotaExceeded", message="Bucket quota exceeded", **kw)  # type: ignore[arg-type]


def wrong_key(access_key: str, **kw: object) -> Rule:
    """Answers as S3 does to a request signed with an access key it does not know."""
    return Rule(
        "error",
        status=403,
        code="InvalidAccessKeyId",
        message="The AWS Access Key Id you provided does not exist in our records.",
        header=rf"Credential={re.escape(access_key)}/",
        **kw,  # type: ignore[arg-type]
    )


def _error_body(code: str, message: str, target: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<Resource>{target.split('?')[0]}</Resource><RequestId>proxy</RequestId></Error>"
    ).encode()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            out += line
            n = int(line.split(b";")[0].strip(), 16)
            data = await reader.readexactly(n + 2)
            out += data
            if n == 0:
                if data != b"\r\n":  # trailers, up to an empty line
                    out += await reader.readuntil(b"\r\n\r\n")
                return bytes(out)
    n = int(headers.get("content-length", "0") or 0)
    return await reader.readexactly(n) if n else b""


def _parse(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return lines[0], headers


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """The proxy; ``endpoint`` is its URL. ``add`` a rule, ``clear`` them all.
    ``max_in_flight[kind]``: the most requests of a kind (``"GET"``, ``"PUT-part"``...)
    the server was answering at once."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []
        self.in_flight: dict[str, int] = {}
        self.max_in_flight: dict[str, int] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="s3-fault-proxy", daemon=True)
        self.port = 0
        self._tasks: set[asyncio.Task[None] | None] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fault proxy did not start in 30 s")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def add(self, *rules: Rule) -> None:
        with self._lock:
            self.rules.extend(rules)

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.requests.clear()
            self.max_in_flight.clear()

    def count(self, method: str, pattern: str = "") -> int:
        with self._lock:
            return sum(1 for m, t in self.requests if m == method and re.search(pattern, t))

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    def _match(self, method: str, target: str, head: str) -> Rule | None:
        with self._lock:
            self.requests.append((method, target))
            for rule in self.rules:
                if rule.matches(method, target, head):
                    rule.hits += 1
                    return rule
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Held here until it ends: a connection task waiting on a future nothing else
        # holds would be collected pending, its sockets reported unclosed in whatever
        # test the collector runs.
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._connection(reader, writer)
        except asyncio.CancelledError:
            pass  # the proxy stopping with a delayed request in hand: nothing to say
        finally:
            self._tasks.discard(task)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                line, headers = _parse(head)
                method, target = line.split(" ")[:2]
                rule = self._match(method, target, head.decode("latin-1"))
                expect = headers.get("expect", "").lower() == "100-continue"
                if rule is not None and rule.action == "reset":
                    _rst(writer)
                    return
                if rule is not None and rule.action == "error":
                    if not expect:
                        await _read_body(reader, headers)
                    body = b"" if method == "HEAD" else _error_body(rule.code, rule.message, target)
                    writer.write(
                        f"HTTP/1.1 {rule.status} Fault\r\nContent-Type: application/xml\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                        + body
                    )
                    await writer.drain()
                    return
                if expect:
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                body = await _read_body(reader, headers)
                if rule is not None and rule.action == "delay":
                    await asyncio.sleep(rule.delay)
                if upstream is None:
                    upstream = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                forwarded = re.sub(rb"(?im)^expect:[^\r\n]*\r\n", b"", head)
                keep = await self._forward(upstream, forwarded + body, method, writer, rule)
                if not keep:
                    return
        finally:
            for w in (writer, upstream[1] if upstream else None):
                if w is not None:
                    w.close()  # idempotent; a writer never closed is reported when collected

    async def _forward(
        self,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        request: bytes,
        method: str,
        writer: asyncio.StreamWriter,
        rule: Rule | None,
    ) -> bool:
        """Send ``request`` to the server and its answer back; False if the connection
        is to be closed after it."""
        up_reader, up_writer = upstream
        kind = method + ("-part" if b"partNumber=" in request.split(b"\r\n", 1)[0] else "")
        with self._lock:
            self.in_flight[kind] = self.in_flight.get(kind, 0) + 1
            self.max_in_flight[kind] = max(self.max_in_flight.get(kind, 0), self.in_flight[kind])
        try:
            up_writer.write(request)
            await up_writer.drain()
            head = await up_reader.readuntil(b"\r\n\r\n")
            status_line, headers = _parse(head)
            status = int(status_line.split(" ")[1])
            close = headers.get("connection", "").lower() == "close"
            if method == "HEAD" or status in (204, 304):
                body = b""
            elif "content-length" in headers or headers.get("transfer-encoding", "").lower() == "chunked":
                body = await _read_body(up_reader, headers)
            else:
                body = await up_reader.read()
                close = True
        finally:
            with self._lock:
                self.in_flight[kind] -= 1
        if rule is not None and rule.action == "cut" and len(body) > 1:
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            _rst(writer)
            return False
        writer.write(head + body)
        await writer.drain()
        return not close
