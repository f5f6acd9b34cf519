"""The app started in this process (its lifespan run) with an httpx client over the ASGI transport."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Running:
    """A started app (lifespan run) and an httpx client bound to it over the ASGI transport."""

    app: Any
    client: httpx.AsyncClient

    @property
    def pipeline(self) -> Any:
        """The live pipeline."""
        return self.app.state.pipeline

    async def search(self, **body: Any) -> httpx.Response:
        """POST /v1/search."""
        return await self.client.post("/v1/search", json=body)


async def start_app(settings: Any) -> AsyncIterator[Running]:
    """Run the app's lifespan and yield a client over the ASGI transport (the real HTTP stack)."""
    from service.api.app import create_app

    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield Running(app, client)


@asynccontextmanager
async def serving(settings: Any) -> AsyncIterator[Running]:
    """start_app as a context manager: shut down on the way out, even when an assertion failed inside."""
    app = start_app(settings)
    running = await anext(app)
    try:
        yield running
    finally:
        await app.aclose()


def encoder_threads_left(wait_s: float = 5.0) -> list[str]:
    """Names of the encoder threads still alive after up to wait_s (hung calls return within their hang)."""
    deadline = time.monotonic() + wait_s
    while True:
        lingering = [t.name for t in threading.enumerate() if t.name.startswith("encoder-") and t.is_alive()]
        if not lingering or time.monotonic() >= deadline:
            return lingering
        time.sleep(0.1)
