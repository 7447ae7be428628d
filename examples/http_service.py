"""A training service with an HTTP control endpoint, on stdlib asyncio only.

The event loop answers requests while the model trains and checkpoints are written:

- ``GET /progress``: the saves in flight as JSON (``SaveProgress.to_dict()``), the one
  status line (``Checkpointer.status_line()``) and the last commit (``SaveStats``);
- ``GET /steps``: the committed steps, oldest commit first;
- ``POST /save``: ask for a save (``request_save()``); the reply comes once the
  training loop took it, with the step it was taken at (``await request.taken()``);
  ``POST /save?wait=1`` replies once it is committed, with its ``SaveStats``;
- SIGTERM or SIGINT (``Shutdown``): a final checkpoint within ``--deadline`` seconds.

Why the training step runs in a worker thread: a forward/backward computed on the
event loop's thread holds that thread for the whole step, so no handler can answer
(and no timer fires) until it ends; the loop only takes the step boundaries, where
``fence()`` and ``save_if_requested()`` run. The writes run in threads of their own
either way.

Run ``python examples/http_service.py --port 8000`` and try
``curl -X POST localhost:8000/save``; ``--self-test`` plays the client itself (asks
for saves, reads the progress, sends itself SIGTERM, then checks the final checkpoint
restores bit-exact) and exits 0 when everything held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch
from torch import nn

from async_stager import Checkpointer, Shutdown, state_differences


def make_state(width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": optimizer, "progress": {"step": 0}}


class Service:
    """The HTTP side: parses one request per connection and answers it from the
    Checkpointer. It never touches the training state."""

    def __init__(self, ckpt: Checkpointer) -> None:
        self.ckpt = ckpt

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            method, target, _ = head.decode("latin-1").split("\r\n", 1)[0].split(" ", 2)
            status, body = await self.route(method, target)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError):
            status, body = 400, {"error": "bad request"}
        except Exception as exc:  # noqa: BLE001 - one failed request must not stop the service
            status, body = 500, {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(body).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}[status]
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        try:
            await writer.drain()
        finally:
            writer.close()

    async def route(self, method: str, target: str) -> tuple[int, dict[str, Any]]:
        url = urlsplit(target)
        if method == "GET" and url.path == "/progress":
            last = self.ckpt.last
            return 200, {
                "status": self.ckpt.status_line(),
                "in_flight": [p.to_dict() for p in self.ckpt.in_flight()],
                "last": last.to_dict() if last is not None else None,
            }
        if method == "GET" and url.path == "/steps":
            return 200, {"steps": self.ckpt.steps()}
        if method == "POST" and url.path == "/save":
            request = self.ckpt.request_save()
            step = await asyncio.wait_for(request.taken(), timeout=60)
            reply: dict[str, Any] = {"step": step}
            if parse_qs(url.query).get("wait") == ["1"]:
                stats = await request.wait()
                reply["committed"] = stats.to_dict() if stats is not None else None
            return 200, reply
        return 404, {"error": f"no route {method} {url.path}"}


async def train(ckpt: Checkpointer, stop: Shutdown, state: dict[str, Any], width: int) -> int:
    """The training loop: each step's compute in a worker thread, the step boundary
    (fence, a requested save) on the event loop. Returns the last step."""
    model, optimizer = state["model"], state["optim"]
    x, y = torch.randn(64, width), torch.randn(64, 1)
    step = await ckpt.restore(state) or 0

    def forward_backward() -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()

    while not stop.requested:
        await asyncio.to_thread(forward_backward)
        await ckpt.fence()  # a save in flight has read the parameters
        await asyncio.to_thread(optimizer.step)
        step += 1
        state["progress"]["step"] = step
        await ckpt.save_if_requested(state, step=step)
    return step


async def http(port: int, path: str, method: str = "GET") -> dict[str, Any]:
    """A one-request HTTP client (what curl does), for the self-test."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(
        next(h for h in head.decode().split("\r\n") if h.lower().startswith("content-length")).split(":")[1]
    )
    body = await reader.readexactly(length)
    writer.close()
    await writer.wait_closed()
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {status} {body!r}")
    result: dict[str, Any] = json.loads(body)
    return result


async def self_test(port: int) -> None:
    """Play the client: two saves asked for over HTTP, the progress read while the
    model trains, then SIGTERM to this process (the final checkpoint's trigger)."""
    taken = await http(port, "/save", "POST")
    print(f"save taken at step {taken['step']}", flush=True)
    committed = await http(port, "/save?wait=1", "POST")
    assert committed["committed"]["step"] == committed["step"], committed
    progress = await http(port, "/progress")
    print(f"progress: {progress['status']}; last commit step {progress['last']['step']}", flush=True)
    steps = (await http(port, "/steps"))["steps"]
    assert committed["step"] in steps, steps
    os.kill(os.getpid(), signal.SIGTERM)


async def serve(directory: Path, port: int, width: int, deadline: float, test: bool) -> int:
    state = make_state(width)
    async with Checkpointer(directory, keep=3) as ckpt, Shutdown() as stop:
        server = await asyncio.start_server(Service(ckpt).handle, "127.0.0.1", port)
        bound = server.sockets[0].getsockname()[1]
        print(f"listening on 127.0.0.1:{bound}", flush=True)
        client = asyncio.create_task(self_test(bound)) if test else None
        step = await train(ckpt, stop, state, width)
        code = await stop.final_checkpoint(ckpt, state, step=step, deadline=deadline)
        server.close()
        await server.wait_closed()
        if client is not None:
            await client  # its errors (a failed assertion) end the service with them
    print(
        f"final checkpoint at step {step}: {'committed' if code == 0 else 'missed its deadline'}", flush=True
    )
    if code == 0 and test:
        fresh = make_state(width)
        async with Checkpointer(directory) as ckpt:
            restored = await ckpt.restore(fresh)
        bad = state_differences(state, fresh)
        if restored != step or bad:
            raise SystemExit(f"restored step {restored} differs from step {step}: {bad[:5]}")
        print(f"restored step {restored} bit-exact", flush=True)
    return code


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="checkpoint folder (default: a new temporary one)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free one)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--deadline", type=float, default=25.0, help="seconds for the final checkpoint")
    p.add_argument("--self-test", action="store_true", help="act as the client, then stop")
    args = p.parse_args()
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="http-service-"))
    sys.exit(asyncio.run(serve(out, args.port, args.width, args.deadline, args.self_test)))


if __name__ == "__main__":
    main()
