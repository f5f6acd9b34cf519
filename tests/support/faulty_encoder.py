"""A test-only encoder backend that misbehaves on request: the synthetic models plus injected faults.

Backends `faulty-old` / `faulty-new` wrap `synthetic-old` / `synthetic-new` (same model id and dim,
so the startup check accepts them against the synthetic world's artifacts).  A marker in an input
picks the fault for that input; the marker is stripped before the synthetic model sees the text:

    !nan / !nan-old / !nan-new      that row comes back NaN
    !zero / !zero-old / !zero-new   that row comes back all zero (a static model's out-of-vocabulary row)
    !raise / !raise-new ...         the whole batch raises
    !hang / !hang-new ...           the batch sleeps HANG_S seconds first (a stuck model)
A marker without a role applies to both encoders.  An image input (base64, as the API passes it)
carries its marker in a PNG text chunk `fault` (`faulty_image("!hang-old")`) and is decoded to RGB here,
as the `clip` backend decodes it, so bytes the API's header check lets through but that do not decode
(a truncated JPEG) fail in the encoder as they would with a real model.  `install()` registers the two
backends in this process; `python tests/support/faulty_encoder.py serve ...` runs `nobackfill` with them
registered (chaos runs).

Backend `faulty-hang-load` is `faulty-new` after FAULTY_LOAD_S seconds (default an hour: a load that
hangs) spent building it, and, when FAULTY_LOAD_GATE names a file, not before that file exists (a
test holds a load for exactly as long as it needs, instead of guessing a duration).  It is an
entry-point plug-in, so that an encoder child process (`isolation: process`), which knows no backend
registered from code, finds it: `plugin_path(root)` is the PYTHONPATH that declares it.
"""

from __future__ import annotations

import base64
import io
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, PngImagePlugin

from service.encoders.base import Embeddings, Encoder, Modality, Wrapper
from service.encoders.registry import ENTRY_POINT_GROUP, create_encoder, register_backend
from service.images import rgb_image
from service.settings import EncoderSettings

HANG_S = float(os.environ.get("FAULTY_HANG_S", "2.0"))
_MARKER = re.compile(r"\s*!(nan|zero|raise|hang)(?:-(old|new))?")


class FaultyEncoder(Wrapper):
    """Delegates to a synthetic encoder, then applies the faults its inputs ask for."""

    def __init__(self, inner: Encoder, role: str) -> None:
        super().__init__(inner)
        self.role = role

    def _faults(self, text: str) -> set[str]:
        return {fault for fault, role in _MARKER.findall(text) if role in ("", self.role)}

    def encode(self, batch: list[str], modality: Modality = "text") -> Embeddings:
        """The synthetic rows, with the requested faults applied."""
        markers = batch if modality == "text" else [_image_marker(i, payload) for i, payload in enumerate(batch)]
        faults = [self._faults(text) for text in markers]
        if any("raise" in f for f in faults):
            raise RuntimeError("injected encoder failure")
        if any("hang" in f for f in faults):
            time.sleep(HANG_S)
        rows = np.array(self.inner.encode([_MARKER.sub("", text) for text in batch], modality), dtype=np.float32)
        for i, f in enumerate(faults):
            if "nan" in f:
                rows[i] = np.nan
            elif "zero" in f:
                rows[i] = 0.0
        return rows


def _image_marker(i: int, payload: str) -> str:
    """The fault marker of a base64 image (its PNG text chunk `fault`); InputError when it does not decode."""
    return str(rgb_image(payload, f"image {i}").info.get("fault", ""))


def faulty_image(marker: str = "", side: int = 8, colour: tuple[int, int, int] = (10, 120, 200)) -> str:
    """A base64 PNG (the API's image_b64) whose text chunk `fault` holds `marker` (e.g. "!hang-old")."""
    chunks = PngImagePlugin.PngInfo()
    chunks.add_text("fault", marker)
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buffer, format="PNG", pnginfo=chunks)
    return base64.b64encode(buffer.getvalue()).decode()


def _factory(role: str):  # type: ignore[no-untyped-def]
    def build(settings: EncoderSettings, device: str) -> Encoder:  # noqa: ARG001
        inner_settings = settings.model_copy(update={"backend": f"synthetic-{role}"})
        return FaultyEncoder(create_encoder(inner_settings, role), role)  # type: ignore[arg-type]

    return build


def hang_while_loading(settings: EncoderSettings, device: str) -> Encoder:
    """Backend `faulty-hang-load`: FAULTY_LOAD_S seconds (read now, default 3600), then FAULTY_LOAD_GATE's file
    to exist (when set), before `faulty-new` is built."""
    time.sleep(float(os.environ.get("FAULTY_LOAD_S", "3600")))
    gate = os.environ.get("FAULTY_LOAD_GATE")
    while gate and not Path(gate).exists():
        time.sleep(0.05)
    build = _factory("new")
    encoder: Encoder = build(settings, device)
    return encoder


def plugin_path(root: Path) -> str:
    """A PYTHONPATH whose processes find backend `faulty-hang-load` through the entry-point group."""
    info = root / "nobackfill_faulty-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nobackfill-faulty\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nfaulty-hang-load = faulty_encoder:hang_while_loading\n"
    )
    return os.pathsep.join([str(root), str(Path(__file__).resolve().parent)])


def install() -> None:
    """Register `faulty-old` and `faulty-new` in this process."""
    register_backend("faulty-old", _factory("old"))
    register_backend("faulty-new", _factory("new"))


if __name__ == "__main__":
    install()
    from service.cli import main

    sys.argv = ["nobackfill", *sys.argv[1:]]
    main()
