"""JSON responses rendered with orjson (numpy-free plain data in, bytes out)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse


class OrjsonResponse(JSONResponse):
    """A JSONResponse whose body orjson renders (several times faster than the standard library)."""

    def render(self, content: Any) -> bytes:
        """Serialise `content`; NaN/inf become null as orjson does."""
        return orjson.dumps(content)
