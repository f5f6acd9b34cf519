"""JSON responses rendered with orjson (numpy-free plain data in, bytes out)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse


class OrjsonResponse(JSONResponse):
    """A JSONResponse whose body orjson renders (several times faster than the standard library).

    Not fastapi.responses.ORJSONResponse: FastAPI deprecates it and warns on every instance, which
    doubles the cost of building a response (3.2 vs 6.8 us measured) on the search hot path.
    """

    def render(self, content: Any) -> bytes:
        """Serialise `content`; NaN/inf become null as orjson does."""
        return orjson.dumps(content)
