"""Retries: exponential backoff with full jitter, bounded in tries, one typed error.

A store classifies each failure (``Failure``): transient ones (503 SlowDown, 500
InternalError, a reset or refused connection, a timeout) are tried again after a
random delay in ``[0, min(max_delay, base_delay * 2**n))`` (AWS's "full jitter": many
clients throttled together do not come back together); any other failure (denied,
credentials, quota, missing) is raised at once. After ``tries`` attempts in all a
``StoreError`` with ``reason="unavailable"`` names the object, the tries and the last
cause.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from async_stager.errors import InvalidOptionError, StoreError

__all__ = ["Failure", "RetryPolicy", "retrying", "store_error"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a request is tried.

    ``tries``: attempts in all, the first included (default 6: five retries, about 3 s
    of backoff on average before giving up with the defaults). ``base_delay`` and
    ``max_delay`` in seconds bound the random delay before each retry."""

    tries: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.tries, bool) or not isinstance(self.tries, int) or self.tries < 1:
            raise InvalidOptionError(f"RetryPolicy(tries={self.tries!r}): give an int >= 1")
        if not (self.base_delay >= 0 and self.max_delay >= self.base_delay):
            raise InvalidOptionError(
                f"RetryPolicy(base_delay={self.base_delay!r}, max_delay={self.max_delay!r}): "
                "give 0 <= base_delay <= max_delay"
            )

    def delay(self, retry: int, rng: random.Random) -> float:
        """The wait before retry number ``retry`` (0 for the first retry)."""
        return rng.uniform(0.0, min(self.max_delay, self.base_delay * (2.0**retry)))


@dataclass(frozen=True)
class Failure:
    """What a store made of one failed attempt: ``reason`` (StoreError's code),
    ``code`` (the store's: ``SlowDown``, ``ECONNRESET``), ``detail`` (one line),
    ``transient`` (worth another try)."""

    reason: str
    code: str
    detail: str
    transient: bool


_SAYS = {
    "denied": "was denied",
    "credentials": "was refused: the store did not accept the credentials",
    "quota": "failed: the store is full (quota or space)",
    "unavailable": "failed: the store is unavailable",
    "exists": "was refused: the object exists already",
    "missing": "failed: no such object or bucket",
    "request": "was refused",
}

_CREDENTIALS_HINT = (
    "; credentials come from the client library's standard places: AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials, an instance role"
)


def store_error(op: str, url: str, failure: Failure, *, tries: int = 1) -> StoreError:
    """One line: what was done to which object, why it failed, after how many tries."""
    says = _SAYS.get(failure.reason, "failed")
    after = f" after {tries} tries" if tries > 1 else ""
    hint = _CREDENTIALS_HINT if failure.reason == "credentials" else ""
    detail = " ".join(failure.detail.split())  # one line, whatever the store sent
    return StoreError(
        f"{op} {url} {says}{after} ({failure.code}: {detail}){hint}",
        key=url,
        reason=failure.reason,
        code=failure.code,
        tries=tries,
    )


async def retrying(
    op: str,
    url: str,
    attempt: Callable[[], Awaitable[T]],
    classify: Callable[[BaseException], Failure | None],
    policy: RetryPolicy,
    rng: random.Random,
) -> T:
    """``await attempt()``, tried again on transient failures as ``policy`` says.
    ``classify`` returns None for an exception that is not the store's (a bug, a
    cancellation): it is raised as it is. Runs on the I/O loop (asyncio).
    Cancellation: at any await; nothing is retried after it."""
    for n in range(policy.tries):
        try:
            return await attempt()
        except Exception as exc:
            failure = classify(exc)
            if failure is None:
                raise
            if not failure.transient or n + 1 == policy.tries:
                raise store_error(op, url, failure, tries=n + 1) from exc
            del exc
        await asyncio.sleep(policy.delay(n, rng))
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises
