"""Encoder backends by name: `create_encoder(settings, role)` builds the configured one on its device.

Built in:
    synthetic-old, synthetic-new  the simulated models of the synthetic upgrade world (no path); synthetic-next
                                  the model after synthetic-new, for a second upgrade
    external                      no model: `dim` and `model_id` from the settings, queries carry embeddings
    sentence-transformers         any SentenceTransformer folder, transformer or static (sentence_transformers.py);
                                  runtime onnx: its `nobackfill encoder export` on ONNX Runtime (onnx_runtime.py)
    clip                          a transformers CLIP-family folder, text and image (clip.py)
Plug-ins: a distribution that declares, in its pyproject,

    [project.entry-points."nobackfill.encoders"]
    my-model = "my_package.encoder:create"

adds backend `my-model`; `create(settings: EncoderSettings, device: str) -> Encoder` is called with the
encoder's settings (settings.path is the user's model folder) and the device `resolve_device` picked.
A plug-in cannot replace a built-in name.  `register_backend` does the same from code.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from service.encoders.base import Encoder, fingerprint_of, resolve_device
from service.encoders.identity import ModelIdentity
from service.errors import InputError
from service.settings import EncoderSettings
from service.vocabulary import Role

BackendFactory = Callable[[EncoderSettings, str], Encoder]
ENTRY_POINT_GROUP = "nobackfill.encoders"

_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `factory` available as backend `name` (a later registration replaces an earlier one)."""
    _BACKENDS[name] = factory


def _plugin(name: str) -> BackendFactory | None:
    """The factory an installed distribution declares for `name` in the entry-point group, if any."""
    for point in entry_points(group=ENTRY_POINT_GROUP, name=name):
        try:
            factory = point.load()
        except Exception as exc:  # a broken plug-in is the user's code: say which and why
            raise InputError(f"encoder plug-in {name!r} ({point.value}) failed to import: {exc!r}") from exc
        if not callable(factory):
            raise InputError(f"encoder plug-in {name!r} ({point.value}) is not callable")
        return factory  # type: ignore[no-any-return]
    return None


def backends() -> list[str]:
    """Names of the built-in and installed plug-in backends, sorted."""
    return sorted({*_BACKENDS, *(point.name for point in entry_points(group=ENTRY_POINT_GROUP))})


def _synthetic(model: str) -> BackendFactory:
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


def _sentence_transformers(settings: EncoderSettings, device: str) -> Encoder:
    """Backend `sentence-transformers`: on torch (sentence_transformers.py), or runtime onnx (onnx_runtime.py)."""
    if settings.runtime == "onnx":
        from service.encoders.onnx_runtime import onnx_encoder

        return onnx_encoder(settings, device)
    from service.encoders.sentence_transformers import sentence_transformer_encoder

    return sentence_transformer_encoder(settings, device)


def _clip(settings: EncoderSettings, device: str) -> Encoder:
    """Backend `clip` (see encoders/clip.py)."""
    from service.encoders.clip import clip_encoder

    return clip_encoder(settings, device)


register_backend("synthetic-old", _synthetic("old"))
register_backend("synthetic-new", _synthetic("new"))
register_backend("synthetic-next", _synthetic("next"))  # the upgrade after next (docs/backfill.md)
register_backend("external", _external)
register_backend("sentence-transformers", _sentence_transformers)
register_backend("clip", _clip)


def create_encoder(settings: EncoderSettings, role: Role) -> Encoder:
    """Build the encoder `settings` names for `role`, on the device `resolve_device` picks for it."""
    factory = _BACKENDS.get(settings.backend) or _plugin(settings.backend)
    if factory is None:
        raise InputError(
            f"unknown encoder backend {settings.backend!r} for the {role} encoder "
            f"(NOBACKFILL_{role.upper()}__BACKEND; known: {', '.join(backends())})"
        )
    encoder = factory(settings, resolve_device(settings.device, role))
    if not isinstance(encoder, Encoder):
        raise InputError(f"backend {settings.backend!r} returned {type(encoder).__name__}, which is not an Encoder")
    if settings.simulated_cost_ms > 0 or settings.simulated_cost_per_item_ms > 0:
        from service.encoders.simulated_cost import SimulatedCostEncoder

        return SimulatedCostEncoder(encoder, settings.simulated_cost_ms, settings.simulated_cost_per_item_ms)
    return encoder


def identity_of(encoder: Encoder, backend: str) -> ModelIdentity:
    """The identity artifacts record for an encoder built from backend `backend`."""
    return ModelIdentity(
        backend=backend, model_id=encoder.model_id, fingerprint=fingerprint_of(encoder), dim=encoder.dim
    )
