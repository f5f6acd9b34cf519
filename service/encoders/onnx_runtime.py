"""Runtime `onnx` of backend sentence-transformers: the model as exported, run by ONNX Runtime on CPU.

    NOBACKFILL_NEW__BACKEND=sentence-transformers
    NOBACKFILL_NEW__PATH=models/all-MiniLM-L6-v2       the source model: its identity, as with torch
    NOBACKFILL_NEW__RUNTIME=onnx
    NOBACKFILL_NEW__ONNX_DIR=models/minilm-onnx-int8   what `nobackfill encoder export` wrote from it

The graph holds the transformer and the model's own pooling and Normalize modules (onnx_export.py), so
pooling is the sentence-transformers path's by construction; the texts are tokenised as its
`preprocess` does (padding to the longest, longest-first truncation at max_seq_length) by the
tokenizer saved beside the graph, in the same length-sorted passes of cpu_forward_batch_size texts,
and the rows go through the same unit-norm rule (zero, never NaN, for a row without a direction).

Identity: model_id and fingerprint are the source folder's, computed as the torch backend computes
them, and the export must record that same fingerprint (else a one-line refusal): profiles and
galleries made with torch rows serve unchanged.  /v1/info says runtime onnx and the precision.

Threads: ONNX Runtime's intra-op pool, cpu_threads(settings.threads) threads (half the usable CPUs by
default, as for torch); its spinning is off, since the other encoder, the event loop and the search
threads share the cores and a spinning pool would take them between batches.  CPU only: the CUDA
provider (onnxruntime-gpu) is not wired in.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.encoders.base import Embeddings, TextOnly, cpu_threads
from service.encoders.identity import weights_fingerprint
from service.encoders.onnx_record import MODEL_NAME, OUTPUT_NAME, OnnxExport, check_source, read_export
from service.encoders.torch_runtime import go_offline, load_failure, model_folder, model_id
from service.errors import ArtifactError, InputError
from service.settings import EncoderSettings
from service.vocabulary import Modality

if TYPE_CHECKING:
    import onnxruntime

BACKEND = "sentence-transformers"
RUNTIME = "onnx"
ONNX_EXTRA = "pip install 'nobackfill[onnx]'"


class OnnxEncoder(TextOnly):
    """An exported SentenceTransformer behind the Encoder protocol (text only), on ONNX Runtime's CPU provider."""

    def __init__(
        self,
        session: onnxruntime.InferenceSession,
        tokenizer: Any,
        export: OnnxExport,
        folder: Path,
        onnx_dir: Path,
        model_id: str,
        fingerprint: str,
        threads: int,
        forward_batch_size: int = 0,
    ) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.export = export
        self.folder = folder
        self.onnx_dir = onnx_dir
        self.model_id = model_id
        self.fingerprint = fingerprint
        self.threads = threads
        self.device = "cpu"
        self.dim = export.source.dim
        self.max_seq_length = export.max_seq_length
        self.forward_batch_size = forward_batch_size

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """Unit float32 [len(batch), dim] rows; InputError for any modality but text."""
        self.refuse_other_modalities(modality, f"{BACKEND}, runtime onnx")
        if not batch:
            return np.zeros((0, self.dim), dtype=np.float32)
        passes_of = self.forward_batch_size or len(batch)
        # Longest first, as the torch backend (and SentenceTransformer.encode) orders its passes, so a
        # short text is not padded to a long one's length; rows go back in input order.
        order = np.argsort([-len(text) for text in batch], kind="stable")
        rows = [
            self._forward([batch[i] for i in order[start : start + passes_of]])
            for start in range(0, len(batch), passes_of)
        ]
        return unit_rows(np.concatenate(rows)[np.argsort(order, kind="stable")])

    def _forward(self, texts: list[str]) -> np.ndarray:
        """One pass: tokenise as sentence-transformers' preprocess does, run the graph, its pooled rows."""
        features = self.tokenizer(
            texts, padding=True, truncation="longest_first", max_length=self.max_seq_length, return_tensors="np"
        )
        feed = {name: np.asarray(features[name], dtype=np.int64) for name in self.export.inputs}
        (rows,) = self.session.run([OUTPUT_NAME], feed)
        return np.asarray(rows)

    def details(self) -> dict[str, Any]:
        """Backend, runtime, precision, folders, truncation length, threads, and the export's agreement check."""
        return {
            "backend": BACKEND,
            "runtime": RUNTIME,
            "precision": self.export.precision,
            "path": str(self.folder),
            "onnx_dir": str(self.onnx_dir),
            "max_seq_length": self.max_seq_length,
            "truncation": f"inputs longer than {self.max_seq_length} tokens are truncated",
            "forward_batch_size": self.forward_batch_size or None,
            "threads": self.threads,
            "export_check": self.export.check or None,
        }


def unit_rows(x: np.ndarray) -> Embeddings:
    """float32 rows scaled to unit norm; a zero or non-finite row comes back as zero, never NaN (as torch's)."""
    x = np.asarray(x, dtype=np.float32)
    x = np.where(np.isfinite(x).all(axis=1, keepdims=True), x, np.float32(0))
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.where(norms > 0, norms, np.float32(1)), dtype=np.float32)


def session_options(threads: int) -> onnxruntime.SessionOptions:
    """`threads` intra-op threads, no inter-op parallelism, no spinning, every graph optimisation."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: its warnings about unused initialisers say nothing to a user
    return options


def require_onnxruntime() -> None:
    """InputError naming the extra when onnxruntime is not installed (checked before anything loads)."""
    if importlib.util.find_spec("onnxruntime") is None:
        raise InputError(f"runtime onnx needs ONNX Runtime, which is not installed: {ONNX_EXTRA}")


def onnx_encoder(settings: EncoderSettings, device: str) -> OnnxEncoder:
    """Load settings.onnx_dir, checked against settings.path's weights, on ONNX Runtime's CPU provider."""
    if device != "cpu":
        raise InputError(
            f"runtime onnx runs on the CPU (device {device} requested): set the encoder's device to cpu, "
            "or use runtime torch on a GPU"
        )
    if not settings.onnx_dir:
        raise InputError("runtime onnx needs onnx_dir: the folder `nobackfill encoder export` wrote")
    require_onnxruntime()
    folder = model_folder(settings, BACKEND)
    onnx_dir = Path(settings.onnx_dir).expanduser()
    export = read_export(onnx_dir)
    fingerprint = weights_fingerprint(folder)
    check_source(export, onnx_dir, folder, fingerprint)
    threads = cpu_threads(settings.threads)
    go_offline()
    try:
        import onnxruntime
        from transformers import AutoTokenizer

        session = onnxruntime.InferenceSession(
            str(onnx_dir / MODEL_NAME), session_options(threads), providers=["CPUExecutionProvider"]
        )
        tokenizer = AutoTokenizer.from_pretrained(str(onnx_dir), local_files_only=True)
    except ImportError as exc:
        raise InputError(f"runtime onnx: {exc.name or 'a library'} failed to import ({ONNX_EXTRA}): {exc}") from exc
    except Exception as exc:  # onnxruntime and transformers raise their own types for a bad file
        raise load_failure(onnx_dir, exc) from exc
    unfed = sorted({i.name for i in session.get_inputs()} - set(export.inputs))
    if unfed:
        raise ArtifactError(
            f"ONNX export {onnx_dir}: the graph takes {', '.join(unfed)}, which its onnx.json does not list"
        )
    return OnnxEncoder(
        session,
        tokenizer,
        export,
        folder,
        onnx_dir,
        model_id(settings, folder),
        fingerprint,
        threads,
        settings.cpu_forward_batch_size,
    )
