"""One exception tree for the whole service; `api/` renders it, the CLI turns it into exit code 2.

NobackfillError            500 internal           also what any foreign exception becomes (see `translate`)
├── InputError             400 invalid_input      bad request body, bad files, bad arguments
│   ├── InvalidRequest     422 invalid_request    the body does not match the request schema
│   ├── TooManyQueries     413 too_many_queries
│   ├── BodyTooLarge       413 body_too_large     the request body is over api.max_body_bytes
│   ├── UnsupportedMode    400 unsupported_mode   unknown mode, or one the profile lacks
│   ├── SettingsError      400 bad_settings       a setting (env var, YAML key) that can never work: at startup
│   └── PoisonInput        422 poison_input       an input that hung an encoder alone lately: refused at once
├── ArtifactError          400 bad_artifact       profile / gallery missing, corrupt or mismatched
├── Unauthorized           401 unauthorized
├── NotFound               404 not_found          no such route (the admin routes too, while they are off)
├── MethodNotAllowed       405 method_not_allowed carries the allowed methods
├── EncoderError           500 encoder_failed     an encoder gave no usable rows
│   ├── EncoderFailed      500 encoder_failed     a model raised or returned unusable rows
│   ├── EncoderTimeout     504 encoder_timeout    a model did not answer within its timeout_s
│   └── EncoderProcessExited 500 encoder_failed   an encoder's child died mid-call (answered as EncoderFailed)
└── Unavailable            503 unavailable        not now, later it may: a refusal, not a bug (logged in one line)
    ├── NotReady           503 not_ready
    ├── GalleryUnavailable 503 gallery_unavailable  a remote gallery (Milvus) did not answer within its deadline
    └── Overloaded         503 overloaded         carries retry_after_s

`translate` is the one place where a foreign exception (torch, faiss, redis, OSError, anything
unexpected) enters the tree: it becomes a bare NobackfillError whose message says nothing about
the cause (a 5xx body never carries internals); the original stays attached for the server's log.
"""

from __future__ import annotations

# Libraries whose exceptions we name in the server log (never in a response): the top-level package
# of the exception's class.  Anything else is logged as "unexpected".
_KNOWN_ORIGINS = ("torch", "faiss", "redis", "numpy", "safetensors", "PIL")
INTERNAL_MESSAGE = "internal error; the server log has the details under this request id"


class NobackfillError(Exception):
    """Base of every error the service raises on purpose."""

    status = 500
    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InputError(NobackfillError):
    """The caller sent something we cannot use; nothing was changed."""

    status = 400
    code = "invalid_input"


class InvalidRequest(InputError):
    """The request body or parameters do not match the published schema."""

    status = 422
    code = "invalid_request"


class TooManyQueries(InputError):
    """A request carried more queries than the configured limit."""

    status = 413
    code = "too_many_queries"


class BodyTooLarge(InputError):
    """The request body is larger than the configured cap (refused before it is read in full)."""

    status = 413
    code = "body_too_large"


class UnsupportedMode(InputError):
    """The requested mode is unknown or the loaded profile lacks it."""

    code = "unsupported_mode"


class SettingsError(InputError):
    """A setting that can never work (a typo, a missing partner, a contradiction), refused when Settings() is built."""

    code = "bad_settings"


class PoisonInput(InputError):
    """An input that hung an encoder on its own a short while ago: refused without a call (encoder.poison_ttl_s)."""

    status = 422
    code = "poison_input"


class ArtifactError(NobackfillError):
    """A profile or gallery on disk is missing, corrupt, or does not match its partners."""

    status = 400
    code = "bad_artifact"


class Unauthorized(NobackfillError):
    """Missing or wrong API key."""

    status = 401
    code = "unauthorized"


class NotFound(NobackfillError):
    """No such route, or a route that is switched off."""

    status = 404
    code = "not_found"


class MethodNotAllowed(NobackfillError):
    """The route exists but not for this method; `allowed` lists the methods it takes."""

    status = 405
    code = "method_not_allowed"

    def __init__(self, message: str, allowed: str = "") -> None:
        super().__init__(message)
        self.allowed = allowed


class EncoderError(NobackfillError):
    """An encoder gave no usable rows for a call: the family of every encoder failure."""

    status = 500
    code = "encoder_failed"


class EncoderFailed(EncoderError):
    """An encoder raised, or returned rows that are not finite or not of its width (zero rows are data)."""

    status = 500
    code = "encoder_failed"


class EncoderTimeout(EncoderError):
    """An encoder did not answer (or had no free replica) within its timeout_s."""

    status = 504
    code = "encoder_timeout"


class EncoderProcessExited(EncoderError):
    """An encoder's child process died during a call (its exit code says how); a new one has been started."""

    status = 500
    code = "encoder_failed"


class Unavailable(NobackfillError):
    """Not now: the service (or a part it needs) cannot answer at the moment; a retry later may succeed."""

    status = 503
    code = "unavailable"


class NotReady(Unavailable):
    """The service is still loading encoders or the gallery."""

    status = 503
    code = "not_ready"


class GalleryUnavailable(Unavailable):
    """A remote gallery (Milvus, PostgreSQL, Qdrant) is unreachable or did not answer within its timeout."""

    status = 503
    code = "gallery_unavailable"
    # Retry-After: a store coming back (a restart, a failover) is found by the next search, each on a
    # fresh connection; a second is long enough not to hammer it, short enough to notice it is back.
    retry_after_s = 1


class Overloaded(Unavailable):
    """The request queue is full; the client should retry later."""

    status = 503
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def origin(exc: BaseException) -> str:
    """Which library a foreign exception comes from (torch, faiss, redis, os, ...), for the log line."""
    package = type(exc).__module__.split(".", 1)[0]
    if package in _KNOWN_ORIGINS:
        return package
    if isinstance(exc, OSError):
        return "os"
    return "unexpected"


def translate(exc: BaseException) -> NobackfillError:
    """`exc` itself when it is ours; otherwise a 500 that names nothing of the cause (chained to it)."""
    if isinstance(exc, NobackfillError):
        return exc
    internal = NobackfillError(INTERNAL_MESSAGE)
    internal.__cause__ = exc
    return internal
