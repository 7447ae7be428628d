"""Object storage clients side by side against a local S3 server (moto's server mode,
started here on a free loopback port): the numbers of docs/object_storage.md.

For each client: the per-request overhead (median of sequential HEADs of a small
object), and for each size a PUT (multipart, parts in parallel) and a GET (parallel
ranges where the client has them) with the wall time, this process's CPU time (all
its threads), the server's CPU time, and the lag of a 1 ms timer on the caller's
asyncio loop during the transfer (how late it fired: max and 99th percentile). Also
our store's throughput by part size (the default part size's measurement).

    pip install -e '.[test]' s3fs obstore s3torchconnector   # those missing are skipped
    python scripts/bench_store.py                 # 100 MiB and 1 GiB, about 2 minutes
    python scripts/bench_store.py --sizes 100 --clients ours,obstore

moto is pure Python and single-process: it is the bottleneck of every throughput here,
so these figures rank the clients' own costs (CPU, loop lag, per-request overhead)
more than their speed against a real store.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

MiB = 1 << 20
PART = 16 * MiB
CONCURRENCY = 8
KEY_ID, SECRET, REGION = "AKIABENCHSTORE000001", "bench-secret", "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto did not start")


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measured(fn: Callable[[], Awaitable[Any]], server_pid: int) -> dict[str, float]:
    """Wall, our CPU, the server's CPU, and the caller loop's lag while ``fn`` runs."""
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - t - 0.001)

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    cpu0, srv0, t0 = time.process_time(), cpu_of(server_pid), time.perf_counter()
    await fn()
    wall = time.perf_counter() - t0
    cpu, srv = time.process_time() - cpu0, cpu_of(server_pid) - srv0
    stop.set()
    await tick
    lags.sort()
    return {
        "wall": wall,
        "cpu": cpu,
        "server_cpu": srv,
        "lag_max_ms": 1000 * lags[-1] if lags else 0.0,
        "lag_p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else 0.0,
    }


# -- the clients: put(key, data), get(key, buffer), head(key), close() ----------------


async def client_ours(endpoint: str, bucket: str, part: int = PART, *, unsigned: bool = False) -> Any:
    from async_stager._store.objects import TransferOptions
    from async_stager._store.store import open_store

    options: dict[str, Any] = {"endpoint_url": endpoint}
    if unsigned:
        # What botocore does over https by itself: no SHA-256 of the body (the part's
        # CRC32 still checked by the server). Over http it signs the body unless told.
        from aiobotocore.config import AioConfig

        options["config"] = AioConfig(s3={"payload_signing_enabled": False})
    store = open_store(
        f"s3://{bucket}/ours",
        TransferOptions(part_size=part, concurrency=CONCURRENCY),
        client_options=options,
    )

    class C:
        async def put(self, key: str, data: memoryview) -> None:
            await store.put(key, data)

        async def get(self, key: str, out: bytearray) -> None:
            await store.get_into(key, out)

        async def head(self, key: str) -> None:
            await store.head(key)

        async def close(self) -> None:
            await store.aclose()

    return C()


async def client_s3fs(endpoint: str, bucket: str) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(
        asynchronous=True, endpoint_url=endpoint, key=KEY_ID, secret=SECRET, max_concurrency=CONCURRENCY
    )
    session = await fs.set_session()

    class C:
        async def put(self, key: str, data: memoryview) -> None:
            await fs._pipe_file(
                f"{bucket}/s3fs/{key}", bytes(data), chunksize=PART, max_concurrency=CONCURRENCY
            )

        async def get(self, key: str, out: bytearray) -> None:
            path = f"{bucket}/s3fs/{key}"
            starts = list(range(0, len(out), PART))
            ends = [min(s + PART, len(out)) for s in starts]
            blobs = await fs._cat_ranges([path] * len(starts), starts, ends)
            for s, b in zip(starts, blobs):
                out[s : s + len(b)] = b

        async def head(self, key: str) -> None:
            await fs._info(f"{bucket}/s3fs/{key}", refresh=True)

        async def close(self) -> None:
            await session.close()

    return C()


async def client_obstore(endpoint: str, bucket: str) -> Any:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=KEY_ID,
        secret_access_key=SECRET,
        region=REGION,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )

    class C:
        async def put(self, key: str, data: memoryview) -> None:
            await obstore.put_async(
                store, f"obstore/{key}", data, chunk_size=PART, max_concurrency=CONCURRENCY
            )

        async def get(self, key: str, out: bytearray) -> None:
            starts = list(range(0, len(out), PART))
            ends = [min(s + PART, len(out)) for s in starts]
            blobs = await obstore.get_ranges_async(store, f"obstore/{key}", starts=starts, ends=ends)
            for s, b in zip(starts, blobs):
                out[s : s + len(b)] = memoryview(b)

        async def head(self, key: str) -> None:
            await obstore.head_async(store, f"obstore/{key}")

        async def close(self) -> None:
            pass

    return C()


async def client_s3torchconnector(endpoint: str, bucket: str) -> Any:
    from s3torchconnector._s3client import S3Client, S3ClientConfig

    os.environ.setdefault("AWS_ACCESS_KEY_ID", KEY_ID)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET)
    client = S3Client(
        REGION, endpoint=endpoint, s3client_config=S3ClientConfig(part_size=PART, force_path_style=True)
    )

    def put(key: str, data: memoryview) -> None:
        w = client.put_object(bucket, f"s3tc/{key}")
        w.write(data)
        w.close()

    def get(key: str, out: bytearray) -> None:
        r = client.get_object(bucket, f"s3tc/{key}")
        view, got = memoryview(out), 0
        while got < len(out):
            n = r.readinto(view[got:])
            if not n:
                break
            got += n

    class C:  # a synchronous client: each call in a thread, as an asyncio caller would
        async def put(self, key: str, data: memoryview) -> None:
            await asyncio.to_thread(put, key, data)

        async def get(self, key: str, out: bytearray) -> None:
            await asyncio.to_thread(get, key, out)

        async def head(self, key: str) -> None:
            await asyncio.to_thread(client.head_object, bucket, f"s3tc/{key}")

        async def close(self) -> None:
            pass

    return C()


async def client_ours_unsigned(endpoint: str, bucket: str) -> Any:
    return await client_ours(endpoint, bucket, unsigned=True)


CLIENTS = {
    "ours": client_ours,
    "ours-https-like": client_ours_unsigned,
    "s3fs": client_s3fs,
    "obstore": client_obstore,
    "s3torchconnector": client_s3torchconnector,
}


async def bench_client(
    name: str,
    endpoint: str,
    bucket: str,
    sizes: list[int],
    pid: int,
    admin: Any,
    results: dict[str, list[Any]],
) -> None:
    try:
        c = await CLIENTS[name](endpoint, bucket)
    except ImportError as exc:
        print(f"{name:17s} skipped: {exc}")
        return
    try:
        try:
            await c.put("small", memoryview(b"x" * 1024))
        except Exception as exc:  # noqa: BLE001 - a client that cannot talk to this server
            print(f"{name:17s} fails against this server: {' '.join(str(exc).split())}")
            return
        times = []
        for _ in range(40):
            t = time.perf_counter()
            await c.head("small")
            times.append(time.perf_counter() - t)
        results.setdefault(f"{name}|HEAD", []).append(statistics.median(times))
        for mib in sizes:
            data = memoryview(bytearray(os.urandom(MiB)) * mib)
            m = await measured(functools.partial(c.put, f"obj{mib}", data), pid)
            results.setdefault(f"{name}|PUT {mib} MiB|{mib}", []).append(m)
            _line(name, f"PUT {mib} MiB", mib, m)
            out = bytearray(mib * MiB)
            m = await measured(functools.partial(c.get, f"obj{mib}", out), pid)
            results.setdefault(f"{name}|GET {mib} MiB|{mib}", []).append(m)
            _line(name, f"GET {mib} MiB", mib, m)
            assert out == data, f"{name}: the object read back differs"
            del out, data
            _empty(admin, bucket)
    finally:
        await c.close()


def _medians(results: dict[str, list[Any]]) -> None:
    print("\nmedians over the rounds:")
    for key, runs in results.items():
        parts = key.split("|")
        if parts[1] == "HEAD":
            print(f"{parts[0]:17s} HEAD of a small object: median {1000 * statistics.median(runs):.2f} ms")
            continue
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        _line(parts[0], parts[1], int(parts[2]), m)


def _line(name: str, what: str, mib: int, m: dict[str, float]) -> None:
    print(
        f"{name:17s} {what:12s} {m['wall']:6.2f} s {mib / m['wall']:7.1f} MiB/s  cpu {m['cpu']:5.2f} s  "
        f"server cpu {m['server_cpu']:5.2f} s  loop lag max {m['lag_max_ms']:6.1f} ms p99 {m['lag_p99_ms']:5.1f} ms",
        flush=True,
    )


def _empty(admin: Any, bucket: str) -> None:
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for item in page.get("Contents", []):
            if item["Size"] > MiB:
                admin.delete_object(Bucket=bucket, Key=item["Key"])


async def part_sizes(endpoint: str, bucket: str, pid: int, mib: int) -> None:
    data = memoryview(bytearray(os.urandom(MiB)) * mib)
    for part in (5, 8, 16, 32, 64):
        c = await client_ours(endpoint, bucket, part * MiB)
        try:
            m = await measured(functools.partial(c.put, "parts", data), pid)
            _line("ours", f"part {part} MiB", mib, m)
        finally:
            await c.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1024", help="object sizes in MiB (default 100,1024)")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--rounds", type=int, default=3, help="each client's runs, interleaved (medians)")
    parser.add_argument("--part-sizes", type=int, default=256, help="MiB for the part size sweep (0: none)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    proc, endpoint = start_moto()
    try:
        import botocore.session

        admin = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
        )
        admin.create_bucket(Bucket="bench")
        os.environ.update(AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION=REGION)
        print(
            f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
        )
        _line("(no transfer)", "sleep 1 s", 1, await measured(lambda: asyncio.sleep(1.0), proc.pid))
        results: dict[str, list[Any]] = {}
        for n in range(args.rounds):
            print(f"round {n + 1} of {args.rounds}, load average {os.getloadavg()[0]:.1f}", flush=True)
            for name in args.clients.split(","):
                await bench_client(name, endpoint, "bench", sizes, proc.pid, admin, results)
        _medians(results)
        if args.part_sizes:
            await part_sizes(endpoint, "bench", proc.pid, args.part_sizes)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    asyncio.run(main())
