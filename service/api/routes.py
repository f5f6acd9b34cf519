"""Thin routes: parse, call the pipeline, shape the answer."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response

from service import metrics
from service.api.auth import ApiKey
from service.api.deps import PipelineDep
from service.api.inputs import to_queries
from service.api.responses import OrjsonResponse
from service.api.schemas import SearchRequest, SearchResponse, error_responses
from service.pipeline import Pipeline, default_mode
from service.vocabulary import Mode

router = APIRouter()
metrics_router = APIRouter()


@router.post("/v1/search", response_model=SearchResponse, responses=error_responses(400, 401, 413, 422, 500, 503, 504))
async def search(body: SearchRequest, request: Request, pipeline: PipelineDep, _: ApiKey) -> OrjsonResponse:
    """Search the frozen gallery with each query, through the chosen compatibility mode."""
    mode = body.mode or default_mode(pipeline.settings, pipeline.profile)
    request.state.mode = mode if Mode.has(mode) else "unknown"  # keeps the metric label bounded
    api = pipeline.settings.api
    limits = (api.max_queries, api.max_image_bytes, api.max_image_pixels)
    if any(item.image_b64 is not None for item in body.queries):
        # base64 decoding and the image check cost milliseconds per image: not on the event loop.
        queries = await asyncio.to_thread(to_queries, body.queries, *limits)
    else:
        queries = to_queries(body.queries, *limits)
    outcome = await pipeline.search(
        queries, k=body.k, mode=body.mode, alpha=body.alpha, nprobe=body.nprobe, ef_search=body.ef_search
    )
    results = []
    for result in outcome.results:
        # Built by hand rather than through SearchResponse: this is the hot path.
        row = {key: value for key, value in vars(result).items() if value is not None}
        if body.debug:
            row["timings_ms"] = outcome.timings_ms
        else:
            row.pop("theta", None)
        results.append(row)
    return OrjsonResponse({"results": results})


@router.get("/v1/info", responses=error_responses(500, 503))
async def info(pipeline: PipelineDep) -> dict[str, Any]:
    """Models, dims, devices, profile id and alphas, gallery fingerprint and size, nprobe."""
    return pipeline.info()


@router.get("/healthz", responses={503: {"description": "An encoder's batcher is beyond restarting."}})
async def healthz(request: Request) -> OrjsonResponse:
    """Liveness: the process answers and no encoder batcher has died for good (then restart the process)."""
    pipeline: Pipeline | None = getattr(request.app.state, "pipeline", None)
    if pipeline is not None and not pipeline.alive:
        return OrjsonResponse({"status": "dead", "problems": pipeline.problems()}, status_code=503)
    return OrjsonResponse({"status": "ok"})


@router.get("/readyz", responses={503: {"description": "Not ready: loading, or a part is down."}})
async def readyz(request: Request) -> OrjsonResponse:
    """200 once encoders are warm and gallery and profile are loaded, and while both batchers serve.

    503 while loading, while a batcher is stopped or every replica of one is stuck, while a Milvus
    gallery does not answer (probed here, within index.milvus_timeout_s), and while draining.
    Redis state is reported, never fatal (the cache fails open).
    """
    pipeline: Pipeline | None = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        return OrjsonResponse({"status": "loading"}, status_code=503)
    await pipeline.probe_gallery()  # records the answer where problems() reads it (a no-op for FAISS)
    problems = pipeline.problems()
    redis_ok = await pipeline.cache.ping()
    return OrjsonResponse(
        {
            "status": "not_ready" if problems else "ready",
            **({"problems": problems} if problems else {}),
            "cache": {"kind": pipeline.cache.kind, "state": pipeline.cache.state(), "ping": redis_ok},
        },
        status_code=503 if problems else 200,
    )


@metrics_router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(500)},
)
async def prometheus_metrics() -> Response:
    """Prometheus exposition of every nobackfill_ collector (here unless api.metrics_port moves it)."""
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)
