"""A request's mode, parsed once into what it maps and where it searches: the query map and the search plan.

The API's `mode` is one word, but it says two things.  Which map turns the query into the old space
(old, aligned, slerp, ..., adapter+slerp, psp, lsp: the head's modes, `Plan.mapping`), and how the
search is staged around it (`Plan.where`, `reranks`, `compares`):

    mode       mapping        where            reranks                         compares
    old..lsp   itself         gallery          no                              no
    compare    the head       gallery          no                              yes (old beside it)
    hybrid     the head       beside_segment   with an item store, unless      no
                                               cascade.in_hybrid is off
    cascade    the head       beside_segment   yes                             no
                              (gallery without a segment)
    new        none           segment          no                              no

Every stage reads the plan, never the mode word: adding a staging is a row here, not a branch in
each stage.  What a mode reads (the old query, the new one, a weight) stays the mode's own
(vocabulary.MODE_READS): a staged mode reads both, so a row whose new encoder failed can still be
answered by the old endpoint alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.vocabulary import Mode, Word


class Where(Word):
    """Where stage 1 searches."""

    gallery = "gallery"  # the frozen gallery alone
    beside_segment = "beside_segment"  # the gallery's unmoved items and the new-model segment, merged
    segment = "segment"  # the segment alone, in the new space


@dataclass(frozen=True)
class Plan:
    """How one request is answered: the mode as asked, the map over the gallery, and the staging around it."""

    mode: Mode  # as asked: what results say they are, and what the mode reads (the old query, the new one)
    mapping: Mode | None  # the head's map into the old space; None: no map (the new query over the segment)
    where: Where
    reranks: bool = False  # the top candidates re-ranked by the new query (query/cascade.py)
    compares: bool = False  # the old query's top k returned beside (compare)

    @property
    def staged(self) -> bool:
        """Whether the mode names a staging around the head's map (its results carry the mode, not the map)."""
        return self.mapping is not None and self.mapping != self.mode

    @property
    def survives_new_failure(self) -> bool:
        """Whether a row whose new encoder failed is still answered (by the old endpoint): the cascade's promise."""
        return self.mode == Mode.cascade


def needs_segment(mode: str) -> bool:
    """Whether a mode can only be served beside a new-model segment (hybrid, new)."""
    return mode in (Mode.hybrid, Mode.new)


def plan_of(mode: Mode, head: str | None, *, segment: bool, hybrid_reranks: bool) -> Plan:
    """The plan for a validated mode.

    `head`: the profile's head (the map of a staged mode; None with no profile, where only new is served);
    `segment`: whether one is served beside the gallery; `hybrid_reranks`: whether hybrid re-ranks (the
    cascade and an item store, cascade.in_hybrid).
    """
    if mode == Mode.new:
        return Plan(mode, None, Where.segment)
    if mode not in (Mode.compare, Mode.hybrid, Mode.cascade):
        return Plan(mode, mode, Where.gallery)
    if head is None:
        raise ValueError(f"mode {mode!r} maps with the profile's head, and there is no profile")
    if mode == Mode.compare:
        return Plan(mode, Mode(head), Where.gallery, compares=True)
    if mode == Mode.hybrid:
        return Plan(mode, Mode(head), Where.beside_segment, reranks=hybrid_reranks)
    return Plan(mode, Mode(head), Where.beside_segment if segment else Where.gallery, reranks=True)
