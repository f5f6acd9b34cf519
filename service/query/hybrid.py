"""Hybrid search: the compatible queries over the frozen gallery (moved items skipped), the new embeddings over
the segment, both at once, merged into one top-k (segment/merge.py); and `new`, the segment alone.

Every request reads one segment snapshot (segment/base.py's SegmentView), so a refresh that lands meanwhile changes
nothing under it.  A row whose new embedding is all-zero (its encoder found no known token) cannot
reach the segment: it searches the whole old gallery instead, moved items included, as `slerp` would.
The segment's scores go onto the old scale through the profile's calibration for the query's
modality, each query's map read against its backgrounds in both spaces (the old one beside the
gallery search, the new one beside the segment's, so the two threads share the cost); a profile
fitted before calibrations existed merges raw cosines (/v1/info says which).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service import metrics
from service.compat.calibration import ScoreMap
from service.index.base import PAD_SCORE, GalleryBackend
from service.query.job import SearchJob
from service.rows import F32, I64, normalize_rows
from service.segment.base import SegmentStore, SegmentView
from service.segment.merge import Merged, merge
from service.segment.recall_sample import RecallSampler
from service.vocabulary import Merge

Groups = Sequence[tuple[str, npt.NDArray[np.int64]]]  # (modality, its rows)


@dataclass(frozen=True)
class SegmentSearch:
    """The live segment, how its hits merge with the old gallery's, and the threads that search it."""

    segment: SegmentStore
    method: Merge
    pool: ThreadPoolExecutor
    recall: RecallSampler | None = None  # measures one search in so many against an exact one, in the background

    def new_only(self, job: SearchJob) -> Merged:
        """`new`: the new embeddings over the segment alone (raw cosines)."""
        snapshot = self.segment.snapshot
        unit = normalize_rows(job.new)
        scores, ids = snapshot.search(unit, job.depth, job.ef_search)
        if self.recall is not None and self.recall.due(snapshot):
            self.recall.offer(snapshot, unit, job.depth, scores)
        return _padded(Merged(scores, ids, ids >= 0))

    def hybrid(self, job: SearchJob, batch: F32, gallery: GalleryBackend) -> Merged:
        """Both searches at once, then the merge per query modality (each has its own calibration)."""
        snapshot = self.segment.snapshot
        usable = np.any(job.new != 0, axis=1)
        groups = _by_modality(job)
        maps = self._score_maps(job, groups)
        beside = self.pool.submit(_segment_side, snapshot, job, usable, groups, maps)
        old_s, old_i = _old_side(job, batch, gallery, snapshot, usable)
        b_old = _backgrounds(normalize_rows(batch), groups, maps, "old")
        new_s, new_i, b_new = beside.result()
        if self.recall is not None and usable.any() and self.recall.due(snapshot):
            self.recall.offer(snapshot, normalize_rows(job.new[usable]), job.depth, new_s[usable])
        parts = []
        for modality, rows in groups:
            score_map = maps.get(modality)
            offsets = None if score_map is None else score_map.offset(b_old[rows], b_new[rows])
            part = merge(
                (old_s[rows], old_i[rows]), (new_s[rows], new_i[rows]), job.depth, self.method, score_map, offsets
            )
            parts.append((rows, part))
        out = parts[0][1] if len(parts) == 1 else _gathered(parts, old_s.shape)
        from_segment = int(out.from_segment.sum())
        metrics.HYBRID_HITS.labels(source="segment").inc(from_segment)
        metrics.HYBRID_HITS.labels(source="old").inc(int((out.ids >= 0).sum()) - from_segment)
        return _padded(out)

    def scale(self, job: SearchJob, row: int) -> str:
        """The scale of a merged row's scores (the response's score_scale) when some of its hits are the segment's."""
        if self.method != Merge.calibrated:
            return str(self.method)  # raw: both models' cosines side by side; rrf: fused ranks
        return "calibrated" if job.mapping.score_map(str(job.queries[row].modality)) is not None else "raw"

    def _score_maps(self, job: SearchJob, groups: Groups) -> dict[str, ScoreMap]:
        """The calibration of each query modality that has one, when the merge is calibrated."""
        if self.method != Merge.calibrated:
            return {}
        found = {m: job.mapping.score_map(m) for m, _ in groups}
        return {m: score_map for m, score_map in found.items() if score_map is not None}


def _segment_side(
    snapshot: SegmentView, job: SearchJob, usable: npt.NDArray[np.bool_], groups: Groups, maps: dict[str, ScoreMap]
) -> tuple[F32, I64, F32]:
    """The segment's top-k of each usable row (-inf / -1 elsewhere), and each row's new-space background."""
    new_unit = normalize_rows(job.new)
    scores = np.full((len(new_unit), job.depth), -np.inf, dtype=np.float32)
    ids = np.full((len(new_unit), job.depth), -1, dtype=np.int64)
    scores[usable], ids[usable] = snapshot.search(new_unit[usable], job.depth, job.ef_search)
    return scores, ids, _backgrounds(new_unit, groups, maps, "new")


def _backgrounds(unit: F32, groups: Groups, maps: dict[str, ScoreMap], side: str) -> F32:
    """Each row's background on `side` under its modality's score map (zero where there is none)."""
    out = np.zeros(len(unit), dtype=np.float32)
    for modality, rows in groups:
        if modality in maps:
            out[rows] = maps[modality].background(unit[rows], side)
    return out


def _padded(merged: Merged) -> Merged:
    """Short lists padded as the gallery pads them: id -1 with PAD_SCORE (finite, unlike the merge's -inf)."""
    scores = np.where(merged.ids >= 0, merged.scores, PAD_SCORE).astype(np.float32)
    return Merged(scores, merged.ids, merged.from_segment)


def _old_side(
    job: SearchJob, batch: F32, gallery: GalleryBackend, snapshot: SegmentView, usable: npt.NDArray[np.bool_]
) -> tuple[F32, I64]:
    """The old gallery's top-k: moved items skipped where the segment answers for them, kept where it cannot."""
    if usable.all():
        return gallery.search(batch, job.depth, job.nprobe, exclude=snapshot.exclusion, ef_search=job.ef_search)
    scores = np.full((len(batch), job.depth), -np.inf, dtype=np.float32)
    ids = np.full((len(batch), job.depth), -1, dtype=np.int64)
    for rows, exclusion in ((usable, snapshot.exclusion), (~usable, None)):
        if rows.any():
            scores[rows], ids[rows] = gallery.search(
                batch[rows], job.depth, job.nprobe, exclude=exclusion, ef_search=job.ef_search
            )
    return scores, ids


def _gathered(parts: list[tuple[npt.NDArray[np.int64], Merged]], shape: tuple[int, ...]) -> Merged:
    """The merged rows of each modality back in the request's order."""
    out = Merged(np.empty(shape, np.float32), np.empty(shape, np.int64), np.empty(shape, bool))
    for rows, part in parts:
        out.scores[rows], out.ids[rows], out.from_segment[rows] = part.scores, part.ids, part.from_segment
    return out


def _by_modality(job: SearchJob) -> Groups:
    """Row indices of each query modality (in sorted order of modality); one group, every row, for most requests."""
    modalities = [str(q.modality) for q in job.queries]
    if len(set(modalities)) == 1:
        return [(modalities[0], np.arange(len(modalities)))]
    named = np.array(modalities)
    return [(m, np.flatnonzero(named == m)) for m in np.unique(named).tolist()]
