"""Backend `clip`: a Hugging Face CLIP-family folder, text and image queries from one model.

Loads with transformers, offline: the model (`AutoModel`, anything with get_text_features and
get_image_features: CLIP and its relatives), its tokenizer and its image processor.  The image
processor is the PIL / numpy one (`use_fast=False`): the fast ones need torchvision, whose wheels on
these machines replace the CPU torch with a CUDA build.
Image inputs are base64-encoded image files, exactly the API's `image_b64`; decoding and
preprocessing happen inside `encode`, i.e. on the encoder's worker thread, never on the event loop.
Text is truncated at the text tower's position limit (/v1/info says how long that is).
"""

from __future__ import annotations

import base64
import io
from typing import Any

from service.encoders.base import Embeddings
from service.encoders.torch_runtime import LocalModel, TorchEncoder, loading, local_model, unit_rows
from service.errors import InputError
from service.images import rgb_image
from service.quiet import quiet_transformers
from service.settings import EncoderSettings
from service.vocabulary import Modality

BACKEND = "clip"
WARMUP_TEXT = "a photo"
_WARMUP_IMAGE_SIDE = 8


class ClipEncoder(TorchEncoder):
    """A CLIP-family model from a local folder behind the Encoder protocol (text and image)."""

    modalities: tuple[Modality, ...] = (Modality.text, Modality.image)

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        image_processor: Any,
        local: LocalModel,
    ) -> None:
        super().__init__(local)
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        config = model.config
        self.dim = int(config.projection_dim)
        positions = int(config.text_config.max_position_embeddings)
        limit = getattr(tokenizer, "model_max_length", positions)
        self.max_text_tokens = min(positions, int(limit)) if isinstance(limit, int) else positions

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """Unit float32 [len(batch), dim] rows of texts, or of base64 image files."""
        if modality == "text":
            return self._text(batch)
        if modality == "image":
            return self._images(batch)
        raise InputError(f"model {self.model_id!r} ({BACKEND}) encodes text and image, not {modality}")

    def _text(self, batch: list[str]) -> Embeddings:
        tokens = self.tokenizer(
            batch, padding=True, truncation=True, max_length=self.max_text_tokens, return_tensors="pt"
        ).to(self.device)
        with self.runtime.run():
            return unit_rows(_features(self.model.get_text_features(**tokens)))

    def _images(self, batch: list[str]) -> Embeddings:
        images = [rgb_image(payload, f"image {i}") for i, payload in enumerate(batch)]
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        with self.runtime.run():
            pixels = pixels.to(self.device, dtype=self.runtime.dtype)
            return unit_rows(_features(self.model.get_image_features(pixel_values=pixels)))

    def warmup(self) -> None:
        """Encode one text and one small image, so both towers and both preprocessors are initialised."""
        from PIL import Image

        self.encode([WARMUP_TEXT], Modality.text)
        buffer = io.BytesIO()
        Image.new("RGB", (_WARMUP_IMAGE_SIDE, _WARMUP_IMAGE_SIDE), (127, 127, 127)).save(buffer, format="PNG")
        self.encode([base64.b64encode(buffer.getvalue()).decode()], Modality.image)

    def details(self) -> dict[str, Any]:
        """Backend, folder, text truncation length, dtype, threads."""
        return {
            "backend": BACKEND,
            "path": str(self.folder),
            "max_seq_length": self.max_text_tokens,
            "truncation": f"texts longer than {self.max_text_tokens} tokens are truncated",
            **self.runtime.details(),
        }


def _features(output: Any) -> Any:
    """The projected embeddings: transformers 4 returns the tensor, 5 an output whose pooler_output holds it."""
    return output if hasattr(output, "ndim") else output.pooler_output


def clip_encoder(settings: EncoderSettings, device: str) -> ClipEncoder:
    """Load settings.path as a CLIP-family model with its tokenizer and PIL image processor on `device`."""
    local = local_model(settings, device, BACKEND)
    folder = local.folder
    with loading(BACKEND, folder):
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        quiet_transformers()
        model = AutoModel.from_pretrained(str(folder), local_files_only=True, dtype=local.runtime.dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]
            str(folder), local_files_only=True, use_fast=False
        )
    if not (hasattr(model, "get_text_features") and hasattr(model, "get_image_features")):
        raise InputError(
            f"the model in {folder} ({type(model).__name__}) is not CLIP-family (no text and image towers)"
        )
    model.to(device).eval()
    return ClipEncoder(model, tokenizer, image_processor, local)
