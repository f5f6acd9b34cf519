"""One exception tree for the whole service; `api/` renders it, the CLI turns it into exit code 2.

NobackfillError            500 internal
├── InputError             400 invalid_input      bad request body, bad files, bad arguments
│   ├── TooManyQueries     413 too_many_queries
│   └── UnsupportedMode    400 unsupported_mode   unknown mode, or one the profile lacks
├── ArtifactError          400 bad_artifact       profile / gallery missing, corrupt or mismatched
├── Unauthorized           401 unauthorized
├── NotReady               503 not_ready
└── Overloaded             503 overloaded         carries retry_after_s
"""

from __future__ import annotations


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


class TooManyQueries(InputError):
    """A request carried more queries than the configured limit."""

    status = 413
    code = "too_many_queries"


class UnsupportedMode(InputError):
    """The requested mode is unknown or the loaded profile lacks it."""

    code = "unsupported_mode"


class ArtifactError(NobackfillError):
    """A profile or gallery on disk is missing, corrupt, or does not match its partners."""

    status = 400
    code = "bad_artifact"


class Unauthorized(NobackfillError):
    """Missing or wrong API key."""

    status = 401
    code = "unauthorized"


class NotReady(NobackfillError):
    """The service is still loading encoders or the gallery."""

    status = 503
    code = "not_ready"


class Overloaded(NobackfillError):
    """The request queue is full; the client should retry later."""

    status = 503
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
