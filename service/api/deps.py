"""Dependencies shared by the route modules."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.errors import NotReady
from service.pipeline import Pipeline


async def get_pipeline(request: Request) -> Pipeline:
    """The app's pipeline, or 503 while it is still loading (async: FastAPI runs sync dependencies on a thread)."""
    pipeline: Pipeline | None = getattr(request.app.state, "pipeline", None)
    if pipeline is None:
        raise NotReady("the service is still loading its encoders, gallery and profile")
    return pipeline


PipelineDep = Annotated[Pipeline, Depends(get_pipeline)]
