"""The `Encoder` protocol, what text-only backends and wrapping encoders share, device and CPU threads.

Required of every backend (plug-ins included): `dim`, `model_id`, `device`, `encode`, `warmup`.
Optional, read through `describe` and `fingerprint_of` when present:
    fingerprint   sha256 of the model's weight files (identity.weights_fingerprint); compared with
                  the one recorded in the profile and the gallery at startup
    modalities    the query modalities it encodes (default: text and image)
    details()     extra facts for /v1/info (max sequence length, dtype, threads, ...)
    interrupt()   make a call that outlived the batcher's timeout return soon (a child process: kill it)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from service.cpu_limit import usable_cpus
from service.errors import InputError
from service.vocabulary import Modality, Role

MODALITIES: tuple[Modality, ...] = tuple(Modality)
Embeddings = npt.NDArray[np.float32]


@runtime_checkable
class Encoder(Protocol):
    """Maps a batch of inputs of one modality to unit-norm float32 rows."""

    dim: int
    model_id: str
    device: str

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """Return float32 [len(batch), dim] with unit-norm rows."""
        ...

    def warmup(self) -> None:
        """Run one tiny batch per modality so the first real request pays no lazy-init cost."""
        ...


class TextOnly:
    """What a text-only backend shares (a sentence-transformers model, on torch or on ONNX Runtime): its one
    modality, the refusal of any other, its warm-up."""

    WARMUP_TEXT = "warm up the encoder"
    modalities: tuple[Modality, ...] = (Modality.text,)
    model_id: str

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """Unit float32 [len(batch), dim] rows of the texts (the backend's own)."""
        raise NotImplementedError

    def warmup(self) -> None:
        """Encode one short text (text is the only modality)."""
        self.encode([self.WARMUP_TEXT])

    def refuse_other_modalities(self, modality: Modality, runs_on: str) -> None:
        """InputError for any modality but text; `runs_on` names the backend (and its runtime) in it."""
        if modality != "text":
            raise InputError(f"model {self.model_id!r} ({runs_on}) encodes text only, not {modality}")


class Wrapper:
    """An encoder that delegates to `inner` (a simulated cost, injected faults): inner's dim, id, device and
    modalities are its own, and warming it up warms inner."""

    def __init__(self, inner: Encoder) -> None:
        self.inner = inner
        self.dim = inner.dim
        self.model_id = inner.model_id
        self.device = inner.device
        self.modalities = modalities_of(inner)

    def warmup(self) -> None:
        """Warm the inner encoder."""
        self.inner.warmup()


def fingerprint_of(encoder: Encoder) -> str | None:
    """The encoder's weights fingerprint, or None for a backend without weight files."""
    value = getattr(encoder, "fingerprint", None)
    return value if isinstance(value, str) and value else None


def modalities_of(encoder: Encoder) -> tuple[Modality, ...]:
    """The modalities an encoder serves (both when it does not say)."""
    value = getattr(encoder, "modalities", None)
    return tuple(value) if value else MODALITIES


def describe(encoder: Encoder) -> dict[str, Any]:
    """What /v1/info says of one encoder: id, dim, device, fingerprint, modalities and the backend's details."""
    details = getattr(encoder, "details", None)
    return {
        "id": encoder.model_id,
        "dim": encoder.dim,
        "device": encoder.device,
        "fingerprint": fingerprint_of(encoder),
        "modalities": list(modalities_of(encoder)),
        **(details() if callable(details) else {}),
    }


def resolve_device(requested: str, role: Role) -> str:
    """Turn `auto` into a device: old on cuda:0, new on cuda:1 with two GPUs; one GPU shared; else CPU."""
    if requested != "auto":
        return requested
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "cpu"
    if count == 1:
        return "cuda:0"
    return "cuda:0" if role == Role.old else "cuda:1"


def cpu_threads(requested: int | None) -> int:
    """Torch threads for one of the two encoders on CPU: as requested, else half the usable cores (>= 1).

    Two encoders each taking every core would oversubscribe the machine while both run at once.
    """
    if requested is not None:
        return requested
    return max(1, usable_cpus() // 2)  # the container's CPU limit, not the node's cores
