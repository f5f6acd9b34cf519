"""The one error boundary: request ids, the error envelope, the access line, the body cap.

    request ──► RequestBoundary ──► BodyLimit ──► FastAPI (ExceptionMiddleware ──► routes)
                 │ request id                │ 413 once the body       │ HTTPException and
                 │ (echo a sane X-Request-ID │ passes max_body_bytes   │ RequestValidationError
                 │ or make one)              │ (or its Content-Length  │ are re-raised as our
                 │ catches every exception,  │ says it will)           │ errors (`from_framework`)
                 │ translate() -> envelope   │                         │
                 │ X-Request-ID on every answer, 5xx logged with the cause, optional access line

Every answer that is not a success has the body {"error": {"code", "message", "request_id"}}: our
own errors with their status and code, FastAPI's 404 / 405 / 422 translated into the tree, anything
foreign (torch, faiss, redis, OSError, a bug) as a 500 whose message reveals nothing; the cause is
written to the server log under the same request id, with its traceback.  A 503 of the Unavailable
family (not ready, overloaded, the gallery unreachable) is a refusal, not a bug: one line, no traceback.
Plain ASGI rather than BaseHTTPMiddleware (which adds a task and a memory stream to every request).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.responses import OrjsonResponse
from service.errors import (
    BodyTooLarge,
    GalleryUnavailable,
    InputError,
    InvalidRequest,
    MethodNotAllowed,
    NobackfillError,
    NotFound,
    NotReady,
    Overloaded,
    Unauthorized,
    Unavailable,
    origin,
    translate,
)

log = logging.getLogger("nobackfill")
access_log = logging.getLogger("nobackfill.access")

REQUEST_ID_HEADER = "x-request-id"
# An incoming id is echoed only when it cannot break a log line or a header: no spaces, no control
# characters, bounded length.  Anything else is replaced by a fresh one.
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:+/=-]{1,128}")


def _incoming_request_id(scope: Scope) -> str | None:
    """The caller's X-Request-ID when it is sane, else None."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            return text if _SANE_REQUEST_ID.fullmatch(text) else None
    return None


def error_response(error: NobackfillError, request_id: str) -> OrjsonResponse:
    """The one error shape, with the headers some statuses carry (Retry-After, Allow, WWW-Authenticate)."""
    headers: dict[str, str] = {}
    if isinstance(error, Overloaded | GalleryUnavailable):
        headers["Retry-After"] = str(error.retry_after_s)
    elif isinstance(error, MethodNotAllowed) and error.allowed:
        headers["Allow"] = error.allowed
    elif isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    body = {"error": {"code": error.code, "message": error.message, "request_id": request_id}}
    return OrjsonResponse(body, status_code=error.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    """The first bad field and what is wrong with it (pydantic's message names no input value)."""
    first: dict[str, Any] = dict(exc.errors()[0]) if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON"
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "model_attributes_type":
        # FastAPI reads a body without a JSON content type as bytes, then says only that it is no object.
        return "the request body must be a JSON object, sent with Content-Type: application/json"
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def from_framework(exc: Exception) -> NobackfillError:
    """FastAPI's and Starlette's own exceptions, as members of the service's tree."""
    if isinstance(exc, RequestValidationError):
        return InvalidRequest(_validation_message(exc))
    if not isinstance(exc, HTTPException):
        return translate(exc)
    if isinstance(exc.__cause__, NobackfillError):  # raised while FastAPI read the body (BodyLimit)
        return exc.__cause__
    if exc.status_code == 404:
        return NotFound("no such route")
    if exc.status_code == 405:
        return MethodNotAllowed("this route does not take that method", (exc.headers or {}).get("Allow", ""))
    if exc.status_code == 413:
        return BodyTooLarge("the request body is too large")
    if 400 <= exc.status_code < 500:
        error = InputError(str(exc.detail))
        error.status = exc.status_code
        return error
    return translate(exc)


async def reraise_in_tree(_: Request, exc: Exception) -> OrjsonResponse:
    """Exception handler for FastAPI's own errors: hand them to RequestBoundary as ours."""
    raise from_framework(exc) from exc


class RequestBoundary:
    """Give every request an id, render every exception in the one envelope, log failures and access."""

    def __init__(self, app: ASGIApp, access_log_on: bool = False) -> None:
        self.app = app
        self.access_log_on = access_log_on

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_request_id(scope) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            error = translate(exc)
            _log_failure(scope, request_id, error, exc)
            if status:  # the answer has begun: nothing more can be said; the server drops the connection
                raise
            await error_response(error, request_id)(scope, receive, send_with_id)
        finally:
            if self.access_log_on:
                client = scope.get("client") or ("-", 0)
                access_log.info(
                    '%s "%s %s" %s %.1fms id=%s',
                    client[0],
                    scope.get("method"),
                    scope.get("path"),
                    status or 500,
                    (time.perf_counter() - start) * 1000,
                    request_id,
                )


def _log_failure(scope: Scope, request_id: str, error: NobackfillError, exc: Exception) -> None:
    """Log a failed request by its family: a 503 refusal in one line, any other 5xx with its traceback.

    An Unavailable is a state of the service, not a bug: its traceback says nothing (a Milvus outage's
    cause is logged once per failed call where it happened, index/milvus.py) and one per request would
    cost the loop time exactly when it has none.  Shed and not-ready refusals are expected under load
    and counted in the metrics, hence at debug; an outage of a part the service needs at warning.
    """
    method, path = scope.get("method"), scope.get("path")
    if isinstance(error, Unavailable):
        level = logging.DEBUG if isinstance(error, Overloaded | NotReady) else logging.WARNING
        log.log(level, "request %s %s %s refused: %s: %s", request_id, method, path, error.code, error.message)
    elif error.status >= 500:  # the cause goes to the log, never into the answer
        cause = "service" if error is exc else origin(exc)
        log.error("request %s %s %s failed: %s (%s)", request_id, method, path, error.code, cause, exc_info=exc)


class BodyLimit:
    """Refuse a request body over `max_bytes` (413): up front from Content-Length, else while it streams in.

    The body is counted as the app pulls it; once past the cap the app's next read raises
    BodyTooLarge, so the rest is never read nor parsed.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                raise self._refusal()
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._refusal()
            return message

        await self.app(scope, counting_receive, send)

    def _refusal(self) -> BodyTooLarge:
        """The 413 for this cap."""
        return BodyTooLarge(f"the request body is over the {self.max_bytes}-byte limit")
