"""Bearer-key checks: one key for the search routes, a separate one for the admin routes.

Keys are compared in constant time, and on their sha256 digests so that the time does not depend
on the key's length either.  No api_key: the search routes are open.  No admin_key: the admin
routes are not mounted at all (404), and this check refuses them too.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from service.errors import NotFound, Unauthorized

_api_bearer = HTTPBearer(auto_error=False, scheme_name="ApiKey", description="NOBACKFILL_API__API_KEY")
_admin_bearer = HTTPBearer(auto_error=False, scheme_name="AdminKey", description="NOBACKFILL_API__ADMIN_KEY")


def key_matches(credentials: HTTPAuthorizationCredentials | None, expected: SecretStr) -> bool:
    """Whether the bearer token equals `expected`, compared in constant time."""
    given = credentials.credentials if credentials else ""
    return hmac.compare_digest(
        hashlib.sha256(given.encode()).digest(),
        hashlib.sha256(expected.get_secret_value().encode()).digest(),
    )


# async although they never await: FastAPI runs a sync dependency on a worker thread, per request.
async def require_api_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_api_bearer)],
) -> None:
    """Pass when no API key is configured or the bearer token matches it."""
    expected: SecretStr | None = request.app.state.settings.api.api_key
    if expected is not None and not key_matches(credentials, expected):
        raise Unauthorized("missing or wrong API key (send Authorization: Bearer <key>)")


async def require_admin_key(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_bearer)],
) -> None:
    """Pass only when an admin key is configured and the bearer token matches it."""
    expected: SecretStr | None = request.app.state.settings.api.admin_key
    if expected is None:
        raise NotFound("no such route")
    if not key_matches(credentials, expected):
        raise Unauthorized("missing or wrong admin key (send Authorization: Bearer <admin key>)")


ApiKey = Annotated[None, Depends(require_api_key)]
AdminKey = Annotated[None, Depends(require_admin_key)]
