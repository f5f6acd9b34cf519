"""Thin routes: parse, call the pipeline, shape the answer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response

from service import metrics
from service.api.auth import ApiKey
from service.api.inputs import to_queries
from service.api.responses import OrjsonResponse
from service.api.schemas import ReloadRequest, SearchRequest, SearchResponse
from service.errors import NotReady
from service.pipeline import KNOWN_MODES, Pipeline, default_mode

router = APIRouter()


async def get_pipeline(request: Request) -> Pipeline:
    """The app's pipeline, or 503 while it is still loading (async: FastAPI runs sync dependencies on a thread)."""
    pipeline: Pipeline | None = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        raise NotReady("the service is still loading its encoders, gallery and profile")
    return pipeline


PipelineDep = Annotated[Pipeline, Depends(get_pipeline)]


@router.post("/v1/search", response_model=SearchResponse)
async def search(body: SearchRequest, request: Request, pipeline: PipelineDep, _: ApiKey) -> OrjsonResponse:
    """Search the frozen gallery with each query, through the chosen compatibility mode."""
    mode = body.mode or default_mode(pipeline.settings, pipeline.profile)
    request.state.mode = mode if mode in KNOWN_MODES else "unknown"  # keeps the metric label bounded
    queries = to_queries(body.queries, pipeline.settings.api.max_image_bytes)
    outcome = await pipeline.search(queries, k=body.k, mode=body.mode, alpha=body.alpha, nprobe=body.nprobe)
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


@router.get("/v1/info")
async def info(pipeline: PipelineDep) -> dict[str, Any]:
    """Models, dims, devices, profile id and alphas, gallery fingerprint and size, nprobe."""
    return pipeline.info()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> OrjsonResponse:
    """200 once encoders are warm and the gallery is loaded; Redis state is reported, never fatal."""
    pipeline: Pipeline | None = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        return OrjsonResponse({"status": "loading"}, status_code=503)
    redis_ok = await pipeline.cache.ping()
    return OrjsonResponse(
        {
            "status": "ready",
            "cache": {"kind": pipeline.cache.kind, "state": pipeline.cache.state(), "ping": redis_ok},
        }
    )


@router.get("/metrics")
async def prometheus_metrics() -> Response:
    """Prometheus exposition of every nobackfill_ collector."""
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


@router.post("/v1/admin/reload-profile")
async def reload_profile(pipeline: PipelineDep, _: ApiKey, body: ReloadRequest | None = None) -> dict[str, Any]:
    """Swap in a profile atomically; on failure the current one keeps serving and a 4xx explains why."""
    path = Path(body.profile_dir) if body and body.profile_dir else None
    profile = await pipeline.reload_profile(path)
    return {
        "status": "reloaded",
        "profile_id": profile.profile_id,
        "head": profile.head,
        "alphas": profile.alphas,
    }
