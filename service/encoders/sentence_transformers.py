"""Backend `sentence-transformers`: any SentenceTransformer folder, text queries only.

Transformer models and static models (model2vec through sentence-transformers' StaticEmbedding)
load alike from `settings.path`, with the network forbidden.  Inputs longer than the model's
max_seq_length tokens are truncated by its tokenizer (/v1/info says how long that is).  fp16 on CUDA
when settings.fp16; float32 on CPU, bfloat16 when settings.cpu_bf16.  Rows come back as unit float32;
a static model gives an all-zero row (or, after its Normalize module, a NaN row) for text with no
known token, e.g. an empty string: such rows come back as zero, never NaN, for the pipeline to judge.
model_id: settings.model_id, else the folder's name; fingerprint: sha256 of the weight files.

A batch runs as the library's own `preprocess` and forward, in the passes `encode` would form (longest
text first, rows back in input order), rather than through `SentenceTransformer.encode`, which walks
every module (`eval()`) and every parameter (the device check) on each call: 1-3 ms a call, 5-13 % of
a MiniLM batch of 1-4 texts on one CPU thread and ~40 % of a static model's (docs/benchmarks.md).  A
model whose `encode` would do more than that (a default prompt, a truncation dimension) or a library
without `preprocess` (sentence-transformers 5) goes through `encode` as before.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from service.encoders.base import Embeddings, TextOnly
from service.encoders.torch_runtime import LocalModel, TorchEncoder, loading, local_model, unit_rows
from service.quiet import quiet_transformers
from service.settings import EncoderSettings
from service.vocabulary import Modality

if TYPE_CHECKING:
    import torch

BACKEND = "sentence-transformers"


class SentenceTransformerEncoder(TorchEncoder, TextOnly):
    """A SentenceTransformer from a local folder behind the Encoder protocol (text only)."""

    def __init__(
        self,
        model: Any,
        local: LocalModel,
        forward_batch_size: int = 0,
    ) -> None:
        super().__init__(local)
        self.model = model
        # sentence-transformers 6 renamed the method; 5.x has only the old name.
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = get_dim()
        if dim is None:  # some module stacks do not declare it: ask the model once
            with self.runtime.run():
                dim = int(model.encode([self.WARMUP_TEXT], convert_to_numpy=True).shape[1])
        self.dim = int(dim)
        limit = getattr(model, "max_seq_length", None)
        # Static models report no limit (None or infinity): nothing is truncated.
        self.max_seq_length = int(limit) if isinstance(limit, int | float) and math.isfinite(limit) else None
        # Padding to the longest text costs little on a GPU and much on a CPU: there, length-sorted passes.
        # A static model pads nothing (an embedding bag over its tokens): extra passes would only cost.
        pads = self.max_seq_length is not None and not self.runtime.cuda
        self.forward_batch_size = forward_batch_size if pads else 0
        self.direct = runs_directly(model)  # preprocess + forward here, not encode() (see the module docstring)

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """Unit float32 [len(batch), dim] rows; InputError for any modality but text."""
        self.refuse_other_modalities(modality, BACKEND)
        passes_of = self.forward_batch_size or max(1, len(batch))
        with self.runtime.run():  # unit_rows inside too: on CUDA it must read the rows on this encoder's stream
            if self.direct and batch:
                return unit_rows(self._forward_in_passes(batch, passes_of))
            return unit_rows(
                self.model.encode(
                    batch,
                    # encode sorts the texts by length and runs them in passes of batch_size.
                    batch_size=passes_of,
                    convert_to_tensor=True,
                    normalize_embeddings=False,
                    show_progress_bar=False,
                )
            )

    def _forward_in_passes(self, batch: list[str], passes_of: int) -> torch.Tensor:
        """What `encode` computes: the texts longest first, in passes of `passes_of`, rows back in input order."""
        import torch
        from sentence_transformers.util import batch_to_device

        order = np.argsort([-len(text) for text in batch])  # encode's own order, so its passes and rows
        rows = []
        for start in range(0, len(batch), passes_of):
            features = self.model.preprocess([batch[i] for i in order[start : start + passes_of]])
            rows.append(self.model(batch_to_device(features, torch.device(self.device)))["sentence_embedding"])
        return torch.cat(rows)[torch.from_numpy(np.argsort(order))]

    def details(self) -> dict[str, Any]:
        """Backend, runtime, folder, truncation length, dtype, threads."""
        truncation = (
            f"inputs longer than {self.max_seq_length} tokens are truncated"
            if self.max_seq_length
            else "no token limit (static model)"
        )
        return {
            "backend": BACKEND,
            "runtime": "torch",  # the other is onnx (encoders/onnx_runtime.py)
            "path": str(self.folder),
            "max_seq_length": self.max_seq_length,
            "truncation": truncation,
            "forward_batch_size": self.forward_batch_size or None,
            **self.runtime.details(),
        }


def runs_directly(model: Any) -> bool:
    """Whether `encode` would do nothing to a text batch beyond preprocess and forward (no prompt, no truncation)."""
    prompt = model.prompts.get(model.default_prompt_name) if model.default_prompt_name else None
    return hasattr(model, "preprocess") and not prompt and model.truncate_dim is None


def sentence_transformer_encoder(settings: EncoderSettings, device: str) -> SentenceTransformerEncoder:
    """Load settings.path as a SentenceTransformer on `device` (offline, inference only)."""
    local = local_model(settings, device, BACKEND)
    with loading(BACKEND, local.folder):
        from sentence_transformers import SentenceTransformer

        quiet_transformers()
        model = SentenceTransformer(str(local.folder), device=device, local_files_only=True)
    model.eval()
    # The runtime's dtype, whatever the checkpoint holds: transformers loads a float16 checkpoint (and
    # model2vec saves static models) in float16, which on CPU is slow and not what /v1/info reports.
    model.to(local.runtime.dtype)
    return SentenceTransformerEncoder(model, local, settings.cpu_forward_batch_size)
