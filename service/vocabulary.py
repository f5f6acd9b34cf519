"""The project's words, each defined once: roles, modalities, fit options, heads and the modes they serve.

Every enum here is a `StrEnum`, so typer takes it as a choice, pydantic as a field type, and each member
is equal to (and hashes like) its string: `"slerp" in profile.modes()` and a dict keyed by `"text"` work
with either.  Adding a map means a member of `Mode`, a row of `MODE_READS`, the heads that serve it in
`HEAD_MODES`, and the code that computes it (service/compat/heads.py); adding a staging around the
head's map (like hybrid or cascade) means a row of service/query/plan.py's `plan_of`; nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Word(StrEnum):
    """A StrEnum whose repr is its plain string, so messages read 'slerp', not <Mode.slerp: 'slerp'>."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def has(cls, value: object) -> bool:
        """Whether `value` is one of the words (Python 3.11's `in` raises for a plain string)."""
        return value in cls._value2member_map_


class Role(Word):
    """Which side of the upgrade: the model that encoded the gallery, or its replacement."""

    old = "old"
    new = "new"


class Modality(Word):
    """What a query (or an item) is."""

    text = "text"
    image = "image"


class FitOn(Word):
    """Which paired rows a map (R or the adapter) is fitted on."""

    query = "query"
    target = "target"
    both = "both"


class EvalGallery(Word):
    """Which old targets a held-out fold's queries are ranked against while choosing alpha."""

    support = "support"
    fold = "fold"


class Criterion(Word):
    """How the blend weight is chosen on the cross-fitted curve (docs/alpha-selection.md)."""

    r1 = "r1"
    mean = "mean"
    mrr = "mrr"
    r1_1se = "r1-1se"
    mean_1se = "mean-1se"
    mrr_1se = "mrr-1se"


class HeadFamily(Word):
    """What a profile stores to serve its head: R, an MKP adapter, or a class-space correction."""

    procrustes = "procrustes"
    adapter = "adapter"
    classes = "classes"


class Head(Word):
    """The default mode a profile is fitted for; its family decides what else it serves."""

    slerp = "slerp"
    nlerp = "nlerp"
    adaptive = "adaptive"
    aligned = "aligned"
    adapter = "adapter"
    adapter_slerp = "adapter+slerp"
    psp = "psp"
    lsp = "lsp"

    @property
    def family(self) -> HeadFamily:
        """The family this head belongs to."""
        return HEAD_FAMILY[self]

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The modes a profile with this head serves."""
        return HEAD_MODES[self]


class Mode(Word):
    """How one query is answered; `compare` answers with the head's mode and `old` side by side."""

    old = "old"
    aligned = "aligned"
    slerp = "slerp"
    nlerp = "nlerp"
    adaptive = "adaptive"
    adapter = "adapter"
    adapter_slerp = "adapter+slerp"
    psp = "psp"
    lsp = "lsp"
    compare = "compare"
    # With a new-model segment beside the gallery (docs/backfill.md): the head's compatible query over the
    # gallery's unmoved items merged with the new query over the segment, or the segment alone.
    hybrid = "hybrid"
    new = "new"
    # The re-rank cascade (query/cascade.py): the compatible (or hybrid) search's top candidates,
    # re-ranked by the new query against their new-model rows.
    cascade = "cascade"

    @property
    def reads_old(self) -> bool:
        """Whether the old query embedding is read (the old encoder runs)."""
        return MODE_READS[self].old

    @property
    def reads_new(self) -> bool:
        """Whether the new query embedding is read (the new encoder runs)."""
        return MODE_READS[self].new

    @property
    def blends(self) -> bool:
        """Whether both embeddings meet in the answer (there is an angle between them)."""
        return self.reads_old and self.reads_new

    @property
    def takes_alpha(self) -> bool:
        """Whether a request may set this mode's weight on the mapped new query."""
        return MODE_READS[self].alpha


class Order(Word):
    """Which items a backfill moves first (backfill/run.py)."""

    given = "given"
    random = "random"
    hot = "hot"


class Merge(Word):
    """How hybrid search puts the gallery's and the segment's hits on one scale (segment/merge.py)."""

    calibrated = "calibrated"
    raw = "raw"
    rrf = "rrf"


@dataclass(frozen=True)
class Reads:
    """What a mode reads: the old query, the new query, a weight between them."""

    old: bool
    new: bool
    alpha: bool


MODE_READS: dict[Mode, Reads] = {
    Mode.old: Reads(old=True, new=False, alpha=False),
    Mode.aligned: Reads(old=False, new=True, alpha=False),
    Mode.slerp: Reads(old=True, new=True, alpha=True),
    Mode.nlerp: Reads(old=True, new=True, alpha=True),
    Mode.adaptive: Reads(old=True, new=True, alpha=True),
    Mode.adapter: Reads(old=False, new=True, alpha=False),
    Mode.adapter_slerp: Reads(old=True, new=True, alpha=True),
    # psp / lsp: the new query is the new model's logits; the gallery holds the old model's class features.
    Mode.psp: Reads(old=False, new=True, alpha=False),
    Mode.lsp: Reads(old=False, new=True, alpha=False),
    # compare: the head's mode (whose alpha a request may set) beside old; it reads both.
    Mode.compare: Reads(old=True, new=True, alpha=False),
    # hybrid: the head's mode (whose alpha a request may set) over the gallery, the new query over the segment.
    Mode.hybrid: Reads(old=True, new=True, alpha=True),
    Mode.new: Reads(old=False, new=True, alpha=False),
    # cascade: stage 1 is the head's mode (or hybrid), stage 2 reads the new query alone.
    Mode.cascade: Reads(old=True, new=True, alpha=True),
}

HEAD_FAMILY: dict[Head, HeadFamily] = {
    Head.slerp: HeadFamily.procrustes,
    Head.nlerp: HeadFamily.procrustes,
    Head.adaptive: HeadFamily.procrustes,
    Head.aligned: HeadFamily.procrustes,
    Head.adapter: HeadFamily.adapter,
    Head.adapter_slerp: HeadFamily.adapter,
    Head.psp: HeadFamily.classes,
    Head.lsp: HeadFamily.classes,
}

_PROCRUSTES_MODES = (Mode.old, Mode.aligned, Mode.slerp, Mode.nlerp, Mode.adaptive)
HEAD_MODES: dict[Head, tuple[Mode, ...]] = {
    **dict.fromkeys((Head.slerp, Head.nlerp, Head.adaptive, Head.aligned), _PROCRUSTES_MODES),
    Head.adapter: (Mode.old, Mode.adapter),
    Head.adapter_slerp: (Mode.old, Mode.adapter, Mode.adapter_slerp),
    Head.psp: (Mode.psp,),
    Head.lsp: (Mode.lsp,),
}


def heads_of(family: HeadFamily) -> tuple[Head, ...]:
    """The heads of one family, in declaration order."""
    return tuple(head for head in Head if head.family is family)


PROCRUSTES_HEADS = heads_of(HeadFamily.procrustes)
ADAPTER_HEADS = heads_of(HeadFamily.adapter)
CLASS_HEADS = heads_of(HeadFamily.classes)
# Modes whose weight a request may set (an explicit alpha).
ALPHA_MODES = tuple(mode for mode in Mode if mode.takes_alpha)
# Procrustes modes with a fitted weight per modality (slerp / nlerp: alpha; adaptive: a, b, c_ref).
BLEND_MODES = (Mode.slerp, Mode.nlerp, Mode.adaptive)
