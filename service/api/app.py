"""The FastAPI app factory: lifespan loads the pipeline; boundary.py renders every error."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import __version__, metrics
from service.api import admin, ui
from service.api.admission import LoadShedder, LoopLag
from service.api.boundary import BodyLimit, RequestBoundary, reraise_in_tree
from service.api.metrics_server import MetricsServer
from service.api.openapi import publish_limits
from service.api.responses import OrjsonResponse
from service.api.routes import metrics_router, router
from service.errors import NobackfillError
from service.gc_pause import freeze_startup_objects
from service.pipeline import Pipeline
from service.settings import Settings

log = logging.getLogger("nobackfill")


def _ensure_log_handler() -> None:
    """Give the service's loggers a stderr handler when nothing else (uvicorn, pytest) routes them.

    uvicorn configures only its own loggers, so without this our warnings reach Python's last-resort
    handler bare and the info lines (access, reloads) are dropped.
    """
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def _install_sighup(app: FastAPI) -> None:
    """SIGHUP reloads the configured profile (kept as is when the new one fails)."""

    async def reload() -> None:
        pipeline: Pipeline | None = getattr(app.state, "pipeline", None)
        if pipeline is None:
            log.warning("SIGHUP: ignored, the service is still loading")
            return
        current = "none" if pipeline.profile is None else pipeline.profile.profile_id
        log.info("SIGHUP: reloading the profile from %s", pipeline.settings.compat.profile_dir)
        try:
            profile = await pipeline.reload_profile()
            log.info("SIGHUP: profile %s loaded (was %s)", profile.profile_id, current)
        except NobackfillError as exc:
            log.error("SIGHUP: profile reload refused, keeping profile %s: %s", current, exc.message)
        except Exception:  # a foreign failure must not kill the signal task silently
            log.exception("SIGHUP: profile reload failed, keeping profile %s", current)

    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGHUP, lambda: app.state.tasks.add(loop.create_task(reload())))


class RequestMetrics:
    """Request count and latency by route template, mode and status, as plain ASGI middleware.

    Plain ASGI rather than @app.middleware("http"): Starlette's BaseHTTPMiddleware runs every request
    through an extra task and memory stream, a measurable share of a sub-10 ms request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record_status)
        finally:
            # The router writes the matched route into the scope; the search route writes the mode
            # into request.state, which lives in scope["state"].
            path = getattr(scope.get("route"), "path", "unmatched")
            mode = scope.get("state", {}).get("mode", "-")
            metrics.REQUESTS.labels(route=path, mode=mode, status=str(status)).inc()
            metrics.REQUEST_DURATION.labels(route=path).observe(time.perf_counter() - start)


class OneLineStartupRefusal:
    """Report a refused start (one of our errors in the lifespan) as its one-line message, not a traceback.

    Starlette hands the server the whole traceback as the startup failure's message; for a refusal
    we raised on purpose (a missing model folder, a dimension mismatch) the operator needs the line
    that says which setting to fix.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_refusal_line(message: Message) -> None:
            refusal = getattr(scope["app"].state, "startup_refusal", None)
            if message["type"] == "lifespan.startup.failed" and refusal:
                message = {**message, "message": f"refusing to start: {refusal}"}
            await send(message)

        await self.app(scope, receive, send_refusal_line)


async def _start(app: FastAPI, settings: Settings, loop_lag: LoopLag, running: contextlib.AsyncExitStack) -> None:
    """Start the lag probe, the pipeline and the metrics server, each undone by `running` when it unwinds."""
    running.callback(metrics.worker_exited, os.getpid())  # the very last step of a shutdown
    loop_lag.start()
    running.push_async_callback(loop_lag.stop)
    pipeline = await Pipeline.build(settings)

    async def close_pipeline() -> None:
        app.state.pipeline = None  # /readyz says loading, not ready, while the parts are stopped
        await pipeline.aclose()

    running.push_async_callback(close_pipeline)
    if settings.api.ui:  # the saved results the page shows must score the served profile: refused here if not
        app.state.ui_saved = ui.load_saved(settings.api, pipeline)
    app.state.pipeline = pipeline
    freeze_startup_objects()  # models and indexes loaded: keep them out of full collections
    if settings.api.metrics_port is not None:
        metrics_server = MetricsServer(settings.api.host, settings.api.metrics_port)
        await metrics_server.start()
        running.push_async_callback(metrics_server.stop)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the heavy loading happens in the lifespan, not at import or construction."""
    settings = settings or Settings()
    loop_lag = LoopLag()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.tasks = set()
        metrics.BUILD_INFO.info({"version": __version__})
        # One stack for everything started here: a refused start unwinds what came before the refusal,
        # and shutdown is the same stack unwinding (the metrics server first, the pipeline, the lag probe).
        async with contextlib.AsyncExitStack() as running:
            try:
                await _start(app, settings, loop_lag, running)
            except NobackfillError as exc:
                app.state.startup_refusal = exc.message
                raise
            _install_sighup(app)
            yield

    app = FastAPI(
        title="nobackfill",
        version=__version__,
        description="Serve a new embedding model against a gallery frozen in the old model's space.",
        default_response_class=OrjsonResponse,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.pipeline = None
    # FastAPI's own errors are handed on as ours; RequestBoundary renders everything, in one place.
    app.add_exception_handler(HTTPException, reraise_in_tree)
    app.add_exception_handler(RequestValidationError, reraise_in_tree)

    # Added innermost first: RequestMetrics sees the status the boundary sends, BodyLimit's 413 is
    # rendered by the boundary like any other error.
    app.add_middleware(BodyLimit, max_bytes=settings.api.max_body_bytes)
    # Before the body is read: shedding must cost less than serving (api/admission.py).
    app.add_middleware(LoadShedder, lag=loop_lag, limit_ms=settings.api.shed_lag_ms)
    app.add_middleware(RequestBoundary, access_log_on=settings.api.access_log)
    app.add_middleware(RequestMetrics)
    app.add_middleware(OneLineStartupRefusal)
    app.include_router(router)
    if settings.api.metrics_port is None:
        app.include_router(metrics_router)
    if settings.api.admin_key is not None:  # no admin key: the admin routes do not exist
        app.include_router(admin.router)
    if settings.api.ui:  # off: no /ui route exists
        ui.mount(app)
    publish_limits(app, settings.api)
    _ensure_log_handler()
    return app
