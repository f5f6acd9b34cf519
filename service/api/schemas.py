"""Request and response bodies of the HTTP API."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.vocabulary import Modality


class QueryIn(BaseModel):
    """One query: text, a base64 image, or embeddings precomputed by the caller.

    Precomputed: both embeddings, or only the one the mode reads (new_embedding alone for aligned,
    adapter, psp and lsp; old_embedding alone for old).  The pipeline refuses a query that lacks the
    embedding its mode needs.  For psp / lsp, new_embedding holds the new model's raw logits.
    """

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    image_b64: str | None = None
    old_embedding: list[float] | None = None
    new_embedding: list[float] | None = None
    modality: Modality | None = Field(
        None, description="Query modality for precomputed embeddings (picks the alpha); default text."
    )

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> QueryIn:
        """A query is text, or an image, or precomputed embeddings, never a mix."""
        embedded = self.old_embedding is not None or self.new_embedding is not None
        kinds = [self.text is not None, self.image_b64 is not None, embedded]
        if sum(kinds) != 1:
            raise ValueError("give exactly one of text, image_b64, or old_embedding and/or new_embedding")
        return self


class SearchRequest(BaseModel):
    """POST /v1/search body."""

    model_config = ConfigDict(extra="forbid")

    queries: list[QueryIn]
    k: int = 10
    mode: str | None = None
    alpha: float | None = None
    nprobe: int | None = None
    # Every HNSW graph this request walks searches this many candidates: the segment's sealed indexes (hybrid,
    # new, the cut-over) and an HNSW gallery (an adopted HNSW index, a pgvector HNSW index, Qdrant's hnsw_ef,
    # a Milvus HNSW collection's ef); unset: each one's setting.  Wider finds more of the exact top k, slower.
    ef_search: int | None = None
    debug: bool = False


class QueryResultOut(BaseModel):
    """Top-k for one query."""

    ids: list[int]
    scores: list[float]
    mode: str
    alpha: float | None
    cache: Literal["hit", "miss", "off"]
    theta: float | None = None
    timings_ms: dict[str, float] | None = None
    old_ids: list[int] | None = None
    old_scores: list[float] | None = None
    overlap: float | None = None
    # Set when an encoder gave an all-zero row: the endpoint that answered alone (none: no results).
    fallback: Literal["old", "new", "none"] | None = None
    # hybrid / new: how many of the ids came from the new-model segment (the rest from the frozen gallery).
    segment_hits: int | None = None
    # What the scores are: old (old-model cosines, the gallery's), new (new-model cosines: mode new, the
    # cut-over), calibrated (hybrid: the segment's scores mapped onto the old scale), raw (hybrid without
    # a calibration: both models' cosines side by side), rrf (hybrid: fused ranks, not cosines).
    score_scale: Literal["old", "new", "calibrated", "raw", "rrf"] = "old"
    # cascade (and hybrid with an item store): the first `reranked` ids were re-ranked by the new query
    # (their scores are new-model cosines); the rest keep their stage-1 order and scores.
    reranked: int | None = None
    # compare: the mode that answered ids / scores (the head, or its fallback), then "old" (old_ids / old_scores).
    compared: list[str] | None = None


class SearchResponse(BaseModel):
    """POST /v1/search answer, results in request order."""

    results: list[QueryResultOut]


class ReloadRequest(BaseModel):
    """POST /v1/admin/reload-profile body; no path reloads the configured profile directory."""

    model_config = ConfigDict(extra="forbid")

    profile_dir: str | None = None


class ErrorBody(BaseModel):
    """What went wrong: a stable code, a message for people, the request id (also in X-Request-ID)."""

    code: str
    message: str
    request_id: str


class ErrorResponse(BaseModel):
    """The one error shape, for every status: {"error": {"code", "message", "request_id"}}."""

    error: ErrorBody


_ERROR_MEANINGS = {
    400: "Bad input (invalid_input, unsupported_mode, bad_artifact).",
    401: "Missing or wrong key (unauthorized).",
    404: "No such route (not_found).",
    413: "Too many queries (too_many_queries) or a body over the cap (body_too_large).",
    422: "The body does not match this schema (invalid_request), or an input that hung an encoder lately "
    "(poison_input, refused at once for encoder.poison_ttl_s).",
    500: "Internal failure (internal, encoder_failed); details only in the server log.",
    503: "Still loading (not_ready), full (overloaded, with Retry-After), or a Milvus gallery not answering "
    "(gallery_unavailable).",
    504: "An encoder did not answer in time (encoder_timeout).",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses, all in the ErrorResponse shape."""
    return {status: {"model": ErrorResponse, "description": _ERROR_MEANINGS[status]} for status in statuses}
