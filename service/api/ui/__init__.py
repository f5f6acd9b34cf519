"""The operator page (/ui, off unless api.ui): answers of the old and new systems side by side, the profile, health.

pages.py serves the static page; data.py the read-only JSON it reads besides /v1/search and /v1/info;
recent.py the last minutes' traffic from the service's own collectors; saved.py the saved eval and
compare results; thumbs.py the thumbnails of image items.  docs/ui.md says what it shows.
"""

from __future__ import annotations

from fastapi import FastAPI

from service.api.ui import data, pages, thumbs
from service.api.ui.recent import RecentTraffic
from service.api.ui.saved import SavedResults, load_saved

__all__ = ["load_saved", "mount"]


def mount(app: FastAPI) -> None:
    """Add the page and its JSON routes to `app`."""
    app.state.ui_recent = RecentTraffic()
    app.state.ui_saved = SavedResults()  # until the start reads the configured ones (load_saved)
    app.include_router(pages.router)
    app.include_router(data.router)
    app.include_router(thumbs.router)
