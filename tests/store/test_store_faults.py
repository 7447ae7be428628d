"""Faults injected at the server (the proxy in front of moto): throttling and transient
errors are retried with backoff until they pass; past the policy's tries, a denied
write, a full quota and a wrong credential each raise one clear StoreError naming the
object."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from async_stager._store import s3 as s3_module
from async_stager._store.objects import TransferOptions
from async_stager._store.retry import RetryPolicy
from async_stager._store.store import open_store
from async_stager.errors import StoreError, UnsupportedError
from tests.store import s3proxy
from tests.store.s3proxy import FaultProxy, Rule

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """asyncio and trio: what is under test here runs on the store's own loop, and a
    caller on uvloop reaches it as one on asyncio does (test_store.py runs every
    operation on all three)."""
    return str(request.param)


MiB = 1 << 20
#: Quick retries: the policy's numbers, not its waits, are under test here.
FAST = RetryPolicy(tries=4, base_delay=0.01, max_delay=0.05)
OPTS = TransferOptions(part_size=5 * MiB, concurrency=3, retry=FAST)


def _data(n: int) -> bytes:
    return np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize(
    "make",
    [
        lambda: s3proxy.slow_down(method="PUT", times=2),
        lambda: s3proxy.internal_error(method="PUT", times=2),
        lambda: Rule("reset", method="PUT", times=2),
        lambda: Rule("delay", method="PUT", times=1, delay=0.3),
    ],
    ids=["503-SlowDown", "500-InternalError", "reset", "delay"],
)
async def test_a_small_put_is_retried_until_it_passes(
    bucket: str, proxy: FaultProxy, make: Callable[[], Rule]
) -> None:
    rule = make()
    proxy.add(rule)
    async with open_store(f"s3://{bucket}/r", OPTS, seed=1) as store:
        await store.put("obj2", b"payload 2")
        assert await store.get("obj2") == b"payload 2"
    assert rule.hits == rule.times
    assert proxy.count("PUT", r"/r/obj2") == rule.times + (0 if rule.action == "delay" else 1)


async def test_multipart_parts_complete_and_reads_are_retried(bucket: str, proxy: FaultProxy) -> None:
    data = _data(16 * MiB + 5)
    proxy.add(
        s3proxy.slow_down(method="POST", path=r"\?uploads", times=1),  # CreateMultipartUpload
        s3proxy.internal_error(method="PUT", path=r"partNumber=2\b", times=1),
        Rule("reset", method="PUT", path=r"partNumber=3\b", times=2),
        s3proxy.slow_down(method="POST", path=r"uploadId=", times=1),  # CompleteMultipartUpload
        Rule("cut", method="GET", path=r"/r/big", times=2),  # a body cut half way, twice
        Rule("reset", method="GET", path=r"/r/big", times=1),
    )
    async with open_store(f"s3://{bucket}/r", OPTS, seed=2) as store:
        info = await store.put("big", data)
        assert info.size == len(data)
        out = bytearray(len(data))
        await store.get_into("big", out)
        assert out == data
        assert await store.list_uploads() == []
    assert all(rule.hits == rule.times for rule in proxy.rules), [
        (r.action, r.path, r.hits) for r in proxy.rules
    ]


@pytest.mark.parametrize("what", ["put", "part", "get", "list"])
async def test_gives_up_after_the_policys_tries_naming_the_object(
    bucket: str, proxy: FaultProxy, what: str
) -> None:
    async with open_store(f"s3://{bucket}/r", OPTS, seed=3) as store:
        await store.put("there", b"x")
        data = _data(11 * MiB)
        rule = {
            "put": s3proxy.slow_down(method="PUT", path=r"/r/obj$", times=100),
            "part": s3proxy.slow_down(method="PUT", path=r"partNumber=2\b", times=100),
            "get": s3proxy.internal_error(method="GET", path=r"/r/there", times=100),
            "list": Rule("reset", method="GET", path=r"list-type=2", times=100),
        }[what]
        proxy.add(rule)
        with pytest.raises(StoreError) as e:
            if what == "put":
                await store.put("obj", b"y")
            elif what == "part":
                await store.put("obj", data)
            elif what == "get":
                await store.get("there")
            else:
                await store.list_objects("p/")
        err = e.value
        assert err.reason == "unavailable" and err.tries == FAST.tries
        # aiohttp itself tries an idempotent request (GET) once more when a kept-alive
        # connection was reset under it: a reset GET may reach the server twice a try.
        assert rule.hits == FAST.tries or (
            rule.action == "reset" and FAST.tries <= rule.hits <= 2 * FAST.tries
        )
        assert f"after {FAST.tries} tries" in str(err) and "\n" not in str(err)
        url = store.url("p/" if what == "list" else "there" if what == "get" else "obj")
        assert err.key == url and url in str(err)
        assert err.code in ("SlowDown", "InternalError") or what == "list"
        proxy.clear()
        # Nothing left half done: no object, no unfinished upload (aborted); usable.
        assert await store.head("obj") is None
        assert await store.list_uploads() == []
        assert await store.get("there") == b"x"


@pytest.mark.parametrize("size", [100, 11 * MiB], ids=["put", "multipart"])
async def test_a_denied_write_names_the_object_and_is_not_retried(
    bucket: str, proxy: FaultProxy, size: int
) -> None:
    rule = s3proxy.denied(method="PUT", times=100)
    proxy.add(rule)
    async with open_store(f"s3://{bucket}/r", OPTS) as store:
        with pytest.raises(StoreError) as e:
            await store.put("step-3/rank0", _data(size))
        proxy.clear()
        assert e.value.reason == "denied" and e.value.code == "AccessDenied"
        assert (
            e.value.key == store.url("step-3/rank0") and "s3://" in str(e.value) and "denied" in str(e.value)
        )
        assert rule.hits <= OPTS.concurrency  # each part in flight once; none retried
        assert await store.list_uploads() == [] and await store.head("step-3/rank0") is None


@pytest.mark.parametrize("size", [100, 11 * MiB], ids=["put", "multipart"])
async def test_a_full_quota_names_the_object(bucket: str, proxy: FaultProxy, size: int) -> None:
    proxy.add(s3proxy.quota(method="PUT", path=r"partNumber=2\b|/r/full$", times=100))
    async with open_store(f"s3://{bucket}/r", OPTS) as store:
        with pytest.raises(StoreError) as e:
            await store.put("full", _data(size))
        proxy.clear()
        assert e.value.reason == "quota" and e.value.code == "QuotaExceeded"
        assert store.url("full") in str(e.value) and "full" in str(e.value)
        assert await store.list_uploads() == []


async def test_a_wrong_credential_is_one_line(
    bucket: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    proxy.add(s3proxy.wrong_key("AKIAWRONGWRONGWRONG0", times=100))
    async with open_store(f"s3://{bucket}/r", OPTS) as store:
        with pytest.raises(StoreError) as e:
            await store.put("obj", b"x")
    msg = str(e.value)
    assert e.value.reason == "credentials" and e.value.code == "InvalidAccessKeyId"
    assert "\n" not in msg and "credentials" in msg and "AWS_ACCESS_KEY_ID" in msg and store.url("obj") in msg


async def test_no_credentials_at_all_is_one_line(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    async with open_store(f"s3://{bucket}/r", OPTS) as store:
        with pytest.raises(StoreError) as e:
            await store.list_objects()
    assert e.value.reason == "credentials" and "\n" not in str(e.value)
    assert "Unable to locate credentials" in str(e.value)


async def test_a_record_whose_answer_was_lost_is_not_refused_on_retry(bucket: str, proxy: FaultProxy) -> None:
    """The commit record's PUT stored, its answer lost (the response cut): the retry's
    412 is our own record, found by its MD5: success, not 'exists'."""
    proxy.add(Rule("cut", method="PUT", path=r"/r/commit", times=1))
    async with open_store(f"s3://{bucket}/r", OPTS) as store:
        info = await store.put_record("commit", b'{"step": 4}', if_absent=True)
        assert info.size == 11
        assert await store.get("commit") == b'{"step": 4}'
        with pytest.raises(StoreError) as e:  # a second writer is still refused
            await store.put_record("commit", b'{"step": 4, "x": 1}', if_absent=True)
        assert e.value.reason == "exists"


async def test_without_the_client_library_s3_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_module, "s3_available", lambda: False)
    with pytest.raises(UnsupportedError, match=r"pip install 'async_stager\[s3\]'"):
        open_store("s3://bucket/p")
