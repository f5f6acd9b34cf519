"""/metrics on its own port (api.metrics_port), so scrapes need not reach the public listener.

A second uvicorn server inside the worker's event loop, serving one tiny ASGI app.  Its socket is
bound with SO_REUSEPORT, so with several workers each one binds the same port and the kernel
spreads scrapes over them; any worker's answer adds up all of them (multiprocess mode).  The main
server owns the process's signals; this one only stops when told to.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Iterator

import uvicorn
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service import metrics
from service.api.boundary import error_response
from service.errors import MethodNotAllowed, NobackfillError, NotFound


async def metrics_app(scope: Scope, receive: Receive, send: Send) -> None:
    """GET /metrics; any other path or method gets the error envelope."""
    if scope["type"] != "http":
        return
    if scope["path"] != "/metrics":
        await error_response(NotFound("no such route"), uuid.uuid4().hex)(scope, receive, send)
    elif scope["method"] not in ("GET", "HEAD"):
        refusal = MethodNotAllowed("this route does not take that method", "GET, HEAD")
        await error_response(refusal, uuid.uuid4().hex)(scope, receive, send)
    else:
        body, content_type = metrics.render()
        await Response(body, media_type=content_type)(scope, receive, send)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT / SIGTERM to the main one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Install nothing: the main server's handlers stay in place."""
        yield


class MetricsServer:
    """Serve metrics_app on (host, port) until `stop`."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        config = uvicorn.Config(metrics_app, lifespan="off", access_log=False, log_level="warning")
        self.server = _QuietServer(config)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind the port (NobackfillError when it cannot) and start serving on this event loop."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise NobackfillError(f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror}") from exc
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))

    async def stop(self) -> None:
        """Stop accepting scrapes and wait for the server to finish."""
        if self.task is not None:
            self.server.should_exit = True
            await self.task
