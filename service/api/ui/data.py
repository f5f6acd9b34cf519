"""The operator page's read-only JSON: its settings, item texts by id, the profile's fit report, a health summary.

Only mounted with api.ui on.  Item texts are the gallery's content, so they take the API key as
/v1/search does; the rest says no more than /v1/info and /readyz, which are open.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from service import metrics
from service.api.auth import ApiKey
from service.api.deps import PipelineDep
from service.api.ui.recent import RecentTraffic, counter_value
from service.api.ui.saved import SavedResults
from service.compat.profile import CompatProfile
from service.pipeline import Pipeline
from service.vocabulary import Role

MAX_ITEM_IDS = 10_000  # a page of every column at k = max_k fits well below it

router = APIRouter(prefix="/ui/api", include_in_schema=False)


class ItemsRequest(BaseModel):
    """POST /ui/api/items body: gallery ids whose texts the page shows."""

    model_config = ConfigDict(extra="forbid")

    ids: list[int] = Field(max_length=MAX_ITEM_IDS)


@router.get("/config")
async def config(request: Request) -> dict[str, Any]:
    """What the page needs before anything else: whether searches take a key."""
    return {"api_key_required": request.app.state.settings.api.api_key is not None}


@router.post("/items")
async def items(body: ItemsRequest, pipeline: PipelineDep, _: ApiKey) -> dict[str, Any]:
    """The item store's value of each id (null where it holds none); `store: false` without an item store."""
    store = pipeline.items
    if store is None:
        return {"store": False, "modality": None, "items": {}}
    wanted = sorted({i for i in body.ids if i >= 0})  # -1 pads a short result list
    # SQLite lookups block: off the event loop, like every other read of a file on the query path.
    values = await asyncio.to_thread(store.get_many, wanted)
    return {"store": True, "modality": str(store.modality), "items": dict(zip(map(str, wanted), values, strict=True))}


@router.get("/profile")
async def profile(request: Request, pipeline: PipelineDep) -> dict[str, Any]:
    """The served profile's identity and whole fit report (the page draws the curves), the gallery's identity,
    and the saved eval and compare results that score this profile (api.ui_eval / api.ui_compare)."""
    gallery = {**pipeline.gallery.describe(), "meta": pipeline.gallery.meta}
    saved: SavedResults = request.app.state.ui_saved
    profile = pipeline.profile  # one profile for the whole answer, even if a reload lands meanwhile
    if profile is None:  # the cut-over: nothing is fitted
        return {"profile": None, "gallery": gallery, "support_eval": None, **saved.shown(None)}
    return {
        "profile": _profile_block(profile),
        "gallery": gallery,
        "support_eval": profile.fit_report.get("support_eval"),  # psp / lsp: scored on the support logits
        **saved.shown(profile.profile_id),
    }


def _profile_block(profile: CompatProfile) -> dict[str, Any]:
    """profile.json's content (no tensors) with its id."""
    return {"id": profile.profile_id, "modes": profile.modes(), **profile.metadata()}


@router.get("/health")
async def health(request: Request, pipeline: PipelineDep) -> dict[str, Any]:
    """Ready or not and why, the last minutes' traffic, the cache, the encoders and their restarts, the segment."""
    await pipeline.probe_gallery()
    problems = pipeline.problems()
    recent: RecentTraffic = request.app.state.ui_recent
    info = pipeline.info()
    return {
        "status": "not_ready" if problems else "ready",
        "problems": problems,
        "alive": pipeline.alive,
        "recent": await asyncio.to_thread(recent.summary),
        "cache": {
            "kind": pipeline.cache.kind,
            "state": pipeline.cache.state(),
            "breaker_open": pipeline.cache.state() == "cooling_down",
            "hit_ratio_since_start": _hit_ratio(),
        },
        "in_flight": pipeline.in_flight,
        "encoders": _encoders(pipeline, info),
        "segment": info.get("segment"),
        "cascade": info.get("cascade"),
    }


def _hit_ratio() -> float | None:
    """Cache hits over hits and misses since the process started (None before the first lookup)."""
    hits = counter_value(metrics.CACHE_EVENTS_TOTAL, event="hit")
    misses = counter_value(metrics.CACHE_EVENTS_TOTAL, event="miss")
    return None if hits + misses <= 0 else round(hits / (hits + misses), 4)


def _encoders(pipeline: Pipeline, info: dict[str, Any]) -> dict[str, Any]:
    """Each encoder as /v1/info describes it, with its problem, restarts and failures since the process started."""
    out: dict[str, Any] = {}
    for role, batcher in ((Role.old, pipeline.old), (Role.new, pipeline.new)):
        if batcher is None:  # no old model after the cut-over: /v1/info says its backend is none
            out[str(role)] = info[f"{role}_model"]
            continue
        failures = {
            reason: counter_value(metrics.ENCODER_FAILURES, encoder=batcher.name, reason=reason)
            for reason in metrics.ENCODER_FAILURE_REASONS
        }
        out[str(role)] = {
            **info[f"{role}_model"],
            "problem": batcher.problem(),
            "process_restarts": int(counter_value(metrics.ENCODER_PROCESS_RESTARTS, encoder=str(role))),
            "batcher_restarts": int(counter_value(metrics.BATCHER_RESTARTS, encoder=batcher.name)),
            "failures": {reason: int(n) for reason, n in failures.items()},
        }
    return out
