"""Encoder backends by name: `create_encoder(settings, role)` builds the configured one on its device.

Built in: `synthetic-old` and `synthetic-new`, the simulated models of the synthetic upgrade world, and
`external` (no model: `dim` and `model_id` come from the settings, queries must carry embeddings).
A real backend is one factory `(settings, device) -> Encoder` added with `register_backend`; e.g. a
sentence-transformers model from a local folder would read `settings.path`, load
`SentenceTransformer(path, device=device)` inside the factory (so the import stays optional) and
return an object with `encode`, `dim`, `model_id`, `device` and `warmup`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from service.encoders.base import Encoder, resolve_device
from service.errors import InputError
from service.settings import EncoderSettings

Role = Literal["old", "new"]
BackendFactory = Callable[[EncoderSettings, str], Encoder]

_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `factory` available as backend `name` (a later registration replaces an earlier one)."""
    _BACKENDS[name] = factory


def backends() -> list[str]:
    """Names of the registered backends, sorted."""
    return sorted(_BACKENDS)


def _synthetic(model: Role) -> BackendFactory:
    """Factory for one of the simulated models; torch loads only when an encoder is built."""

    def build(settings: EncoderSettings, device: str) -> Encoder:
        """Build the simulated model on `device`."""
        from service.encoders.synthetic import synthetic_encoder

        if settings.path is not None:
            raise InputError(f"backend synthetic-{model} takes no path (got {settings.path!r})")
        return synthetic_encoder(model, device)

    return build


def _external(settings: EncoderSettings, device: str) -> Encoder:
    """Backend `external`: no model, the clients send embeddings (see encoders/external.py)."""
    from service.encoders.external import external_encoder

    return external_encoder(settings, device)


register_backend("synthetic-old", _synthetic("old"))
register_backend("synthetic-new", _synthetic("new"))
register_backend("external", _external)


def create_encoder(settings: EncoderSettings, role: Role) -> Encoder:
    """Build the encoder `settings` names for `role`, on the device `resolve_device` picks for it."""
    factory = _BACKENDS.get(settings.backend)
    if factory is None:
        raise InputError(
            f"unknown encoder backend {settings.backend!r} for the {role} encoder (known: {', '.join(backends())})"
        )
    encoder = factory(settings, resolve_device(settings.device, role))
    if settings.simulated_cost_ms > 0 or settings.simulated_cost_per_item_ms > 0:
        from service.encoders.simulated_cost import SimulatedCostEncoder

        return SimulatedCostEncoder(encoder, settings.simulated_cost_ms, settings.simulated_cost_per_item_ms)
    return encoder
