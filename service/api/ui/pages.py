"""The operator page's files: /ui and its script and stylesheet, each with a strict Content-Security-Policy.

Three fixed files read once from static/, served by name from a fixed table: no path from the URL
ever reaches the file system.  No build step, nothing from a CDN.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from service.errors import NotFound

# Scripts and styles from this origin only (no inline script, no eval, no inline style attribute),
# fetch only back to this service, images only as data: URLs (a query image's preview) or blob: URLs (the
# thumbnails, fetched with the API key in a header, which an <img src> cannot send), no framing.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",  # a new version of the service serves its new page at once
}
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    """A static file's bytes, read from the package once."""
    return files("service.api.ui").joinpath("static", name).read_bytes()


def page_response(name: str) -> Response:
    """One of FILES with its content type and the security headers."""
    return Response(_read(name), media_type=FILES[name], headers=HEADERS)


@router.get("/ui")
async def ui_root() -> RedirectResponse:
    """/ui -> /ui/, so the page's relative links resolve under /ui/."""
    return RedirectResponse("/ui/", status_code=308, headers=HEADERS)


@router.get("/ui/")
async def ui_index() -> Response:
    """The page."""
    return page_response("index.html")


@router.get("/ui/{name}")
async def ui_file(name: str) -> Response:
    """The page's script or stylesheet; any other name is a 404."""
    if name not in FILES:
        raise NotFound("no such file")
    return page_response(name)
