"""What an S3 failure means: a ``Failure`` (transient or not, and StoreError's reason)
from botocore's and aiohttp's exceptions, by the store's error code first, then the
HTTP status. Imports the client library lazily (the package works without it)."""

from __future__ import annotations

import asyncio
import errno

from async_stager._store.retry import Failure

__all__ = ["ShortObjectError", "TruncatedBodyError", "classify", "error_code"]

#: Throttling and server-side trouble: worth another try.
_TRANSIENT = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "BandwidthLimitExceeded",
    "ConditionalRequestConflict",  # two conditional writes raced: S3 says retry
    "OperationAborted",
}
_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidSecurity",
    "MissingSecurityHeader",
}
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidObjectState", "403"}
_QUOTA = {
    "QuotaExceeded",
    "XMinioStorageFull",
    "XMinioAdminBucketQuotaExceeded",
    "InsufficientStorage",
    "TooManyBuckets",
}
_MISSING = {"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "NotFound", "404"}
_EXISTS = {"PreconditionFailed", "412"}


class ShortObjectError(Exception):
    """A ranged read past the end of the object: not retried."""


class TruncatedBodyError(ConnectionError):
    """A response body ended before its length: retried (a connection dropped)."""


def error_code(exc: BaseException) -> str:
    """The store's error code of a botocore ClientError, else ``""``."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def _client_error(exc: BaseException) -> Failure:
    code = error_code(exc) or str(_status(exc))
    status = _status(exc)
    message = str(getattr(exc, "response", {}).get("Error", {}).get("Message", "")) or f"HTTP {status}"
    if code == "403" and status == 403:
        message = "403 Forbidden (the answer to a HEAD has no body: denied, or the credentials refused)"
    if code in _TRANSIENT or (status >= 500 and code not in _QUOTA and status != 507 and status != 501):
        return Failure("unavailable", code, message, transient=True)
    if code in _CREDENTIALS:
        return Failure("credentials", code, message, transient=False)
    if code in _QUOTA or status == 507:
        return Failure("quota", code, message, transient=False)
    if code in _DENIED or status == 403:
        return Failure("denied", code, message, transient=False)
    if code in _MISSING or status == 404:
        return Failure("missing", code, message, transient=False)
    if code in _EXISTS or status == 412:
        return Failure("exists", code, message, transient=False)
    return Failure("request", code, message, transient=False)


def classify(exc: BaseException) -> Failure | None:
    """The Failure ``exc`` is, or None if it is not a store's (a bug: raised as is)."""
    if isinstance(exc, ShortObjectError):
        return Failure("request", "InvalidRange", str(exc), transient=False)
    if isinstance(exc, TruncatedBodyError):
        return Failure("unavailable", "IncompleteBody", str(exc), transient=True)
    try:
        import aiohttp
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - the backend imported them already
        return None
    if isinstance(exc, bx.ClientError):
        return _client_error(exc)
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError)):
        return Failure("credentials", type(exc).__name__, str(exc), transient=False)
    if isinstance(exc, bx.ProfileNotFound):
        return Failure("credentials", "ProfileNotFound", str(exc), transient=False)
    if isinstance(
        exc,
        (
            bx.EndpointConnectionError,
            bx.ConnectionClosedError,
            bx.ReadTimeoutError,
            bx.ConnectTimeoutError,
            bx.ResponseStreamingError,
            bx.IncompleteReadError,
            bx.HTTPClientError,
            aiohttp.ClientError,
            asyncio.TimeoutError,
            ConnectionError,
        ),
    ):
        err = getattr(exc, "errno", None) or getattr(getattr(exc, "kwargs", {}).get("error"), "errno", None)
        code = errno.errorcode.get(err, type(exc).__name__) if isinstance(err, int) else type(exc).__name__
        return Failure("unavailable", code, str(exc) or type(exc).__name__, transient=True)
    if isinstance(exc, bx.BotoCoreError):
        return Failure("request", type(exc).__name__, str(exc), transient=False)
    return None
