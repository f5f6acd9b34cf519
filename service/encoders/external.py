"""Backend `external`: for deployments whose clients send precomputed embeddings (or logits), never content.

A PSP / LSP deployment is the typical case: the encoders are classifiers whose logits the caller
computes, so the service holds no model.  The encoder only declares `dim` and `model_id` (from
EncoderSettings, so the profile / gallery checks still run) and refuses every encode call with a 400
that tells the caller what to send instead.
"""

from __future__ import annotations

from service.encoders.base import Embeddings
from service.errors import InputError
from service.settings import EncoderSettings
from service.vocabulary import Modality

BACKEND = "external"


class ExternalEncoder:
    """An Encoder that has a width and an id but no model: queries must carry their embeddings."""

    def __init__(self, dim: int, model_id: str, device: str = "none") -> None:
        if dim < 1:
            raise InputError(f"backend {BACKEND}: dim must be positive, got {dim}")
        self.dim = dim
        self.model_id = model_id
        self.device = device

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """Always refuses: there is no model behind this backend."""
        raise InputError(
            f"this deployment takes precomputed embeddings; send old_embedding/new_embedding "
            f"instead of {modality} content (model {self.model_id!r}, {len(batch)} item(s))"
        )

    def warmup(self) -> None:
        """Nothing to warm up."""


def external_encoder(settings: EncoderSettings, _device: str) -> ExternalEncoder:
    """Build the `external` backend from settings.dim and settings.model_id (both required; no device)."""
    missing = [name for name in ("dim", "model_id") if getattr(settings, name) is None]
    if missing:
        raise InputError(
            f"backend {BACKEND} needs {' and '.join(missing)} in its encoder settings "
            "(e.g. NOBACKFILL_NEW__DIM=10, NOBACKFILL_NEW__MODEL_ID=my-classifier-v2)"
        )
    if settings.path is not None:
        raise InputError(f"backend {BACKEND} takes no path (got {settings.path!r})")
    assert settings.dim is not None and settings.model_id is not None
    return ExternalEncoder(settings.dim, settings.model_id)
