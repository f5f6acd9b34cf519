"""The `Encoder` protocol every backend implements, and device resolution."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Modality = Literal["text", "image"]
Embeddings = npt.NDArray[np.float32]


@runtime_checkable
class Encoder(Protocol):
    """Maps a batch of inputs of one modality to unit-norm float32 rows."""

    dim: int
    model_id: str
    device: str

    def encode(self, batch: list[str], modality: Modality = "text") -> Embeddings:
        """Return float32 [len(batch), dim] with unit-norm rows."""
        ...

    def warmup(self) -> None:
        """Run one tiny batch so the first real request pays no lazy-init cost."""
        ...


def resolve_device(requested: str, role: Literal["old", "new"]) -> str:
    """Turn `auto` into a device: old on cuda:0, new on cuda:1 with two GPUs; one GPU shared; else CPU."""
    if requested != "auto":
        return requested
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "cpu"
    if count == 1:
        return "cuda:0"
    return "cuda:0" if role == "old" else "cuda:1"
