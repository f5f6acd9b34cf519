"""Checks before any encoder runs: the request limits, the mode, and each query's text or embeddings."""

from __future__ import annotations

import math

import numpy as np

from service.compat.profile import CompatProfile
from service.encoders.base import Encoder, modalities_of
from service.errors import ArtifactError, InputError, TooManyQueries, UnsupportedMode
from service.index.base import check_nprobe
from service.query.job import Query, SearchJob
from service.query.plan import needs_segment
from service.segment.factory import segment_configured
from service.settings import ApiSettings, Settings
from service.vocabulary import CLASS_HEADS, Mode


def served_modes(settings: Settings, profile: CompatProfile | None) -> list[str]:
    """What a request may ask for: the profile's modes (and compare, the head beside old, where old is one),
    hybrid and new beside a segment, cascade beside a segment or an item store (where new-model rows of the
    items come from); with no profile (after the cut-over: nothing maps between two models) new alone.

    The segment holds new-model embeddings, so a head whose new query is logits (psp, lsp) has neither.
    """
    if profile is None:
        return [Mode.new]
    own = list(profile.modes())
    compare = [Mode.compare] if Mode.old in own else []
    if profile.head in CLASS_HEADS:
        return [*own, *compare]
    segment = segment_configured(settings.index)
    beside = [Mode.hybrid, Mode.new] if segment else []
    cascade = [Mode.cascade] if segment or settings.index.item_store is not None else []
    return [*own, *compare, *beside, *cascade]


def default_mode(settings: Settings, profile: CompatProfile | None) -> str:
    """The configured default mode, else new with no profile (the cut-over), else hybrid beside a segment, else
    the head.

    ArtifactError when the profile (and segment) cannot serve it.
    """
    served = served_modes(settings, profile)
    if profile is None:  # Settings refuses any other configured default after the cut-over
        return Mode.new
    mode = settings.compat.default_mode or (Mode.hybrid if Mode.hybrid in served else profile.head)
    if mode not in served:
        hint = "; hybrid and new need NOBACKFILL_INDEX__SEGMENT_DIR" if needs_segment(mode) else ""
        if mode == Mode.cascade:
            hint = "; cascade needs NOBACKFILL_INDEX__ITEM_STORE or NOBACKFILL_INDEX__SEGMENT_DIR"
        raise ArtifactError(
            f"default mode {mode!r} is not served by profile {profile.profile_id} (it serves {', '.join(served)}){hint}"
        )
    return mode


def validate_request(
    queries: list[Query],
    k: int,
    mode: str,
    alpha: float | None,
    nprobe: int,
    api: ApiSettings,
    max_nprobe: int | None,
    served: list[str],
    ef_search: int | None = None,
) -> None:
    """Check a request against the limits, the modes `served` (served_modes) and the gallery's nprobe; 4xx if bad.

    Before the mode is parsed into a plan (query/plan.py) and any encoder runs; validate_queries then checks
    each query against what the plan reads.
    """
    if not queries:
        raise InputError("queries must not be empty")
    if len(queries) > api.max_queries:
        raise TooManyQueries(f"{len(queries)} queries in one request; the limit is {api.max_queries}")
    if not 1 <= k <= api.max_k:
        raise InputError(f"k must be in 1..{api.max_k}, got {k}")
    check_nprobe(nprobe, max_nprobe)  # before any encoder runs; the gallery checks it again
    if ef_search is not None and not 1 <= ef_search <= api.max_ef_search:
        raise InputError(f"ef_search must be in 1..{api.max_ef_search}, got {ef_search}")
    if alpha is not None and not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise InputError(f"alpha must be in [0, 1], got {alpha}")
    if mode not in served:
        if served == [Mode.new]:  # the cut-over: no old model and no profile are left to serve anything else
            raise UnsupportedMode(f"mode {mode!r} is not served after the cut-over: the new model alone answers (new)")
        hint = ""
        if needs_segment(mode) and Mode.new not in served:
            hint = " (hybrid and new need a new-model segment: NOBACKFILL_INDEX__SEGMENT_DIR)"
        if mode == Mode.cascade:
            hint = " (cascade needs NOBACKFILL_INDEX__ITEM_STORE or NOBACKFILL_INDEX__SEGMENT_DIR)"
        if mode == Mode.compare:
            hint = " (compare puts the head beside old: it needs a profile that serves old)"
        raise UnsupportedMode(f"mode {mode!r} is not served by this profile; it serves {', '.join(served)}{hint}")


def validate_queries(job: SearchJob, old: Encoder | None, new: Encoder, max_text_chars: int) -> None:
    """Check each query's text or embeddings against what the job's mode reads; 4xx if bad."""
    for i, query in enumerate(job.queries):
        _check_query(i, query, job, max_text_chars, (old, new))


def _check_query(
    i: int, query: Query, job: SearchJob, max_text_chars: int, encoders: tuple[Encoder | None, Encoder]
) -> None:
    """Check one query's text length or embedding dims and values, and that its mode has what it reads."""
    mode = job.reads
    if query.content is not None and query.modality == "text":
        if len(query.content) > max_text_chars:
            raise InputError(f"queries[{i}] is {len(query.content)} characters; the limit is {max_text_chars}")
        if not query.content.strip():
            raise InputError(f"queries[{i}].text is empty")
    if query.content is not None:
        for role, encoder, needed in (("old", encoders[0], mode.reads_old), ("new", encoders[1], mode.reads_new)):
            if needed and encoder is not None and query.modality not in modalities_of(encoder):
                raise InputError(
                    f"queries[{i}] is a {query.modality} query, but the {role} model "
                    f"{encoder.model_id!r} encodes {' and '.join(modalities_of(encoder))} only"
                )
    else:
        if query.old_embedding is None and mode.reads_old:
            old_free = ", ".join(sorted(m for m in Mode if not m.reads_old))
            raise InputError(
                f"queries[{i}] has no old_embedding, which mode {job.mode!r} needs "
                f"(modes that take new_embedding alone: {old_free})"
            )
        if query.new_embedding is None and mode.reads_new:
            raise InputError(f"queries[{i}] has no new_embedding, which mode {job.mode!r} needs")
    for name, row, dim in (
        ("old_embedding", query.old_embedding, job.old_dim),
        ("new_embedding", query.new_embedding, job.new_dim),
    ):
        if row is None:
            continue
        if row.shape != (dim,):
            raise InputError(f"queries[{i}].{name} has {row.size} values; expected {dim}")
        if not np.all(np.isfinite(row)):
            raise InputError(f"queries[{i}].{name} contains NaN or infinity")
        if not np.any(row):
            raise InputError(f"queries[{i}].{name} is all zeros")
