"""Which mode answers each row: the head's, or the other endpoint alone after an all-zero encoder row.

An encoder may return an all-zero row: a static or lexical model does for text with no known token.
Such a row has no direction, so that query is answered by the other endpoint alone (mode `old` when
the new row is zero; `aligned`, or `adapter` for an adapter head, when the old row is zero), or with no
results when every endpoint its mode reads is zero.  (A caller's own all-zero embedding is refused
at validation: that is bad input, not data.)
"""

from __future__ import annotations

import numpy as np

from service.query.job import SearchJob
from service.vocabulary import Modality, Mode

Route = tuple[str, str | None]  # the mode that answers a row, and which endpoint answered alone (old | new | none)
Group = tuple[Modality, str, str | None]  # modality, mode, fallback


def routes(job: SearchJob, head_mode: str) -> list[Route]:
    """(mode, fallback) per query: the head's mode, or the other endpoint alone after an all-zero encoder row."""
    n = len(job.queries)
    reads = Mode(head_mode)
    old_zero = ~job.old.any(axis=1) if reads.reads_old else np.zeros(n, dtype=bool)
    new_zero = ~job.new.any(axis=1) if reads.reads_new else np.zeros(n, dtype=bool)
    if not (old_zero.any() or new_zero.any()):  # the hot path: every row has a direction
        return [(head_mode, None)] * n
    encoded = np.fromiter((q.content is not None for q in job.queries), dtype=bool, count=n)
    old_zero &= encoded  # a caller's own embeddings were checked at validation: only encoder rows count
    new_zero &= encoded
    new_alone = Mode.adapter if Mode.adapter in job.mapping.modes() else Mode.aligned
    out: list[Route] = []
    for old_is_zero, new_is_zero in zip(old_zero.tolist(), new_zero.tolist(), strict=True):
        if not (old_is_zero or new_is_zero):
            out.append((head_mode, None))
        elif old_is_zero and reads.reads_new and not new_is_zero:
            out.append((new_alone.value, "new"))
        elif new_is_zero and reads.reads_old and not old_is_zero:
            out.append((Mode.old.value, "old"))
        else:
            out.append((head_mode, "none"))  # searched as is, answered with no results
    return out


def groups(job: SearchJob, plan: list[Route]) -> dict[Group, slice | list[int]]:
    """Row indices of each (modality, mode, fallback): one transform call each; one slice (no copies) for one group."""
    found: dict[Group, list[int]] = {}
    for i, (query, (mode, fallback)) in enumerate(zip(job.queries, plan, strict=True)):
        found.setdefault((query.modality, mode, fallback), []).append(i)
    if len(found) == 1:
        return {key: slice(None) for key in found}
    return dict(found)
