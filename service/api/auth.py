"""Optional bearer-token check for the search and admin routes."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.errors import Unauthorized

_bearer = HTTPBearer(auto_error=False)


async def require_api_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Pass when no key is configured or the bearer token matches it (constant-time compare).

    async although it never awaits: FastAPI runs a sync dependency on a worker thread, per request.
    """
    expected = request.app.state.settings.api.api_key
    if expected is None:
        return
    given = credentials.credentials if credentials else ""
    if not secrets.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise Unauthorized("missing or wrong API key (send Authorization: Bearer <key>)")


ApiKey = Annotated[None, Depends(require_api_key)]
