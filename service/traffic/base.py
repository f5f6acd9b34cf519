"""What a sampled pair is, and the store protocol both backends follow.

A pair is one query's old-model and new-model embedding, as float16 rows, with the two model
identities (ModelIdentity.as_dict, as models.json records them) and the query modality.  The
identities travel as one canonical JSON string (`models_key`), so pairs from before an upgrade are
told apart from today's by comparing strings.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from service.encoders.identity import ModelIdentity

F16 = npt.NDArray[np.float16]
StoreKind = Literal["redis", "local"]
MODALITY_CODES = ("text", "image")


def models_key(old: ModelIdentity, new: ModelIdentity) -> str:
    """The canonical JSON of the two identities: equal strings mean the same model pair."""
    return json.dumps({"old": old.as_dict(), "new": new.as_dict()}, sort_keys=True, separators=(",", ":"))


def parse_models_key(key: str) -> tuple[ModelIdentity, ModelIdentity]:
    """(old, new) identities back from models_key's string; ArtifactError when malformed."""
    try:
        data: Any = json.loads(key)
    except json.JSONDecodeError:
        data = None
    where = "a stored traffic pair's models"
    return ModelIdentity.from_dict(_get(data, "old"), where), ModelIdentity.from_dict(_get(data, "new"), where)


def _get(data: Any, name: str) -> Any:
    """data[name] when data is a dict, else None (from_dict then names the problem)."""
    return data.get(name) if isinstance(data, dict) else None


@dataclass(frozen=True)
class PairBatch:
    """Pairs of one model pair: old [n, d_old] and new [n, d_new] float16 rows, a modality per row."""

    models: str
    old: F16
    new: F16
    modality: tuple[str, ...]

    def __post_init__(self) -> None:
        assert self.old.ndim == 2 and self.new.ndim == 2, "expected 2-d rows"
        assert len(self.old) == len(self.new) == len(self.modality), "old, new and modality must pair up"

    def __len__(self) -> int:
        return len(self.old)


@dataclass(frozen=True)
class StoredPairs:
    """What a store holds, newest first, grouped into runs of one model pair."""

    runs: list[PairBatch]

    @property
    def total(self) -> int:
        """Pairs in every run."""
        return sum(len(r) for r in self.runs)


class PairStore(Protocol):
    """A bounded store of sampled pairs; append may raise (the sampler counts it), read is for export."""

    kind: StoreKind

    def append(self, batches: Sequence[PairBatch]) -> int:
        """Store the batches; returns the pairs stored.  Keeps at most the configured number of pairs."""
        ...

    def read(self, limit: int | None = None) -> StoredPairs:
        """The newest `limit` pairs (all when None), newest first."""
        ...

    def count(self) -> int:
        """Pairs held now (after expiry and trimming)."""
        ...

    def close(self) -> None:
        """Release connections / flush buffers."""
        ...


def merge_runs(runs: Sequence[PairBatch]) -> list[PairBatch]:
    """Adjacent runs of the same model pair joined into one (rows keep their order), one copy per group."""
    out: list[PairBatch] = []
    for models, grouped in itertools.groupby(runs, key=lambda run: run.models):
        group = list(grouped)
        if len(group) == 1:
            out.append(group[0])
            continue
        # One concatenation per group: joining pairwise would copy the growing run once per row (a Redis
        # read is one-row runs, so quadratic in the pairs read).
        out.append(
            PairBatch(
                models,
                np.concatenate([run.old for run in group]),
                np.concatenate([run.new for run in group]),
                tuple(m for run in group for m in run.modality),
            )
        )
    return out
