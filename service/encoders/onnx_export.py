"""`nobackfill encoder export`: a SentenceTransformer folder to an ONNX graph the `onnx` runtime serves.

What is exported is the model's whole module stack after tokenisation (the transformer, its Pooling
and, when present, Normalize) as one graph, with torch.onnx.export's TorchScript exporter
(`dynamo=False`: it needs no onnxscript and traces a BERT-style encoder cleanly) and dynamic batch and
sequence axes; the attention runs as "eager" while tracing, the form ONNX Runtime's fusions know.
`--int8` then quantises the MatMul weights to int8 per output channel (onnxruntime.quantization's
dynamic quantisation: activations are quantised on the fly, so no calibration set is needed; per
channel, because per-tensor int8 moved MiniLM's rows to a cosine of 0.90 to float32, per channel 0.97).

Before anything is published the export is checked where it matters, through the runtime's own code
(onnx_runtime.OnnxEncoder): the saved tokenizer must give `preprocess`'s very tokens, and the rows
are compared with torch float32's on the check texts (built-in ones of every length, empty and
truncated included, plus --check-texts).  An fp32 export below a cosine of 1 - 1e-4 on any text is
refused (something in the graph differs); an int8 export's cosines are recorded in onnx.json and
printed, since losing some agreement is what int8 trades for speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import warnings
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from service.atomic_dir import check_output, readable_by_others, sibling_dir, staging
from service.encoders.identity import ModelIdentity, weights_fingerprint
from service.encoders.onnx_record import MODEL_NAME, OUTPUT_NAME, RECORD_NAME, OnnxExport, Precision, write_record
from service.encoders.onnx_runtime import BACKEND, OnnxEncoder, require_onnxruntime, session_options
from service.encoders.sentence_transformers import runs_directly
from service.encoders.torch_runtime import loading
from service.errors import InputError
from service.manifest import write_manifest

OPSET = 17
# fp32 must agree with torch this well on every check text; below it the graph computes something else.
FP32_MIN_COSINE = 1 - 1e-4
# Texts of every length the check runs: empty, one word, sentences, and one past any model's max_seq_length.
CHECK_TEXTS = (
    "",
    "a",
    "What is the capital of France?",
    "how do I reset my password",
    "Cheap flights from London to New York in December",
    "The quick brown fox jumps over the lazy dog.",
    "  Leading and trailing spaces, MIXED case, and punctuation!?  ",
    "numbers 3.14159 and 2,718 and dates like 2024-05-17",
    "Ünïcödé, accents: café, naïve, Zürich; CJK: 東京; emoji: 🙂",
    "A longer passage that goes on for a while, describing a product in detail: its size, its weight, "
    "the materials it is made of, how it should be cleaned, and what the warranty covers when it breaks.",
    "install the package, then run the tests, then read the report and fix whatever failed first",
    "Why is the sky blue? Rayleigh scattering of sunlight by the molecules of the air.",
    "word " * 600,  # truncated at max_seq_length
)
LIBRARIES = ("torch", "transformers", "sentence-transformers", "onnx", "onnxruntime")


def export_model(
    model_dir: Path,
    out: Path,
    *,
    int8: bool = False,
    model_id: str | None = None,
    check_texts: list[str] | None = None,
    force: bool = False,
) -> OnnxExport:
    """Export model_dir into the folder `out` (published whole, or not at all); returns what onnx.json records."""
    model_dir, out = model_dir.expanduser(), out.expanduser()
    _check_paths(model_dir, out, force)
    require_onnxruntime()
    fingerprint = weights_fingerprint(model_dir)
    model = _load(model_dir)
    texts = [*CHECK_TEXTS, *(check_texts or [])]
    scratch = sibling_dir(out.parent / f"{out.name}-scratch")  # the fp32 graph an int8 one is quantised from
    try:
        with staging(out, marker=RECORD_NAME) as tmp:
            try:
                inputs = _export_graph(model, texts, (scratch if int8 else tmp) / MODEL_NAME)
                if int8:
                    _quantise(scratch / MODEL_NAME, tmp / MODEL_NAME)
            except Exception as exc:  # the exporter and the quantiser raise whatever their passes raise
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise InputError(f"cannot export {model_dir} to ONNX: {type(exc).__name__}: {first}") from exc
            _tokenizer(model).save_pretrained(str(tmp))
            precision: Precision = "int8" if int8 else "fp32"
            identity = ModelIdentity(
                backend=BACKEND, model_id=model_id or model_dir.name, fingerprint=fingerprint, dim=_dim(model)
            )
            export = OnnxExport(
                source=identity,
                precision=precision,
                inputs=inputs,
                max_seq_length=int(model.max_seq_length),
                opset=OPSET,
                made_with=_versions(),
            )
            check = agreement(model, _runtime_of(tmp, export), texts)
            if precision == "fp32" and check["min_cosine"] < FP32_MIN_COSINE:
                raise InputError(
                    f"the ONNX graph of {model_dir} does not compute the model's rows: cosine to torch "
                    f"{check['min_cosine']:.6f} on its worst check text (at least {FP32_MIN_COSINE} expected)"
                )
            export = dataclasses.replace(export, check=check)
            write_record(tmp, export)
            write_manifest(tmp)
            readable_by_others(tmp)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return export


def _check_paths(model_dir: Path, out: Path, force: bool) -> None:
    """The cheap refusals, before any library loads."""
    if not model_dir.is_dir():
        raise InputError(f"model folder {model_dir} does not exist")
    if out.resolve().is_relative_to(model_dir.resolve()):
        # model.onnx counts as a weight file: inside the model folder it would change the model's fingerprint.
        raise InputError(f"--out {out} is inside the model folder {model_dir}: write the export beside it")
    check_output(out, force)


def _load(model_dir: Path) -> Any:
    """The SentenceTransformer, float32 on CPU, eager attention; InputError for a model the export cannot carry."""
    with loading(BACKEND, model_dir):
        from sentence_transformers import SentenceTransformer

        from service.quiet import quiet_transformers

        quiet_transformers()
        model = SentenceTransformer(
            str(model_dir), device="cpu", local_files_only=True, model_kwargs={"attn_implementation": "eager"}
        )
    model.eval()
    model.float()
    first = model[0]
    if not hasattr(first, "auto_model") or getattr(first, "tokenizer", None) is None:
        raise InputError(
            f"{model_dir}: only transformer models export to ONNX (its first module is {type(first).__name__}); "
            "a static model is already fast on torch"
        )
    if not runs_directly(model):
        raise InputError(f"{model_dir}: a model with a default prompt or a truncation dimension does not export yet")
    if not isinstance(model.max_seq_length, int):
        raise InputError(f"{model_dir}: the model declares no max_seq_length to truncate at")
    return model


def _tokenizer(model: Any) -> Any:
    """The first module's tokenizer (the text side of a processor, where the module holds one)."""
    tokenizer = model[0].tokenizer
    return getattr(tokenizer, "tokenizer", tokenizer)


def _dim(model: Any) -> int:
    """The sentence embedding's width, as the library declares it (sentence-transformers 6 renamed the method)."""
    get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(get_dim())


def _traced_module(model: Any, inputs: tuple[str, ...]) -> Any:
    """A torch module taking the token tensors `inputs` positionally and returning the model's pooled rows."""
    import torch

    class SentenceEmbedding(torch.nn.Module):
        """The model's modules after tokenisation, as one forward over plain tensors (what the exporter traces)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            rows: torch.Tensor = self.model(dict(zip(inputs, tensors, strict=True)))[OUTPUT_NAME]
            return rows

    return SentenceEmbedding().eval()


def _export_graph(model: Any, texts: list[str], path: Path) -> tuple[str, ...]:
    """Trace the model on a padded batch of check texts into `path`; returns the graph's input names."""
    import torch

    # Two texts of different lengths: the trace sees padding, so the attention mask is used, not skipped.
    sample = _tokenizer(model)(
        [texts[3], texts[9]],
        padding=True,
        truncation="longest_first",
        max_length=model.max_seq_length,
        return_tensors="pt",
    )
    inputs = tuple(name for name in ("input_ids", "attention_mask", "token_type_ids") if name in sample)
    axes = {name: {0: "batch", 1: "sequence"} for name in inputs} | {OUTPUT_NAME: {0: "batch"}}
    with _quiet_export(), torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(
            _traced_module(model, inputs),
            tuple(sample[name] for name in inputs),
            str(path),
            dynamo=False,
            input_names=list(inputs),
            output_names=[OUTPUT_NAME],
            dynamic_axes=axes,
            opset_version=OPSET,
            do_constant_folding=True,
        )
    return inputs


def _quantise(source: Path, target: Path) -> None:
    """Dynamic int8 quantisation of the MatMul weights, per output channel."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet_export():
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True)


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """The exporter's and quantiser's warnings (tracer notes, deprecations, "consider pre-processing") unsaid."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def _runtime_of(folder: Path, export: OnnxExport) -> OnnxEncoder:
    """The runtime's encoder over the folder being written (its own passes, tokenizer and unit rows)."""
    import onnxruntime
    from transformers import AutoTokenizer

    session = onnxruntime.InferenceSession(
        str(folder / MODEL_NAME), session_options(1), providers=["CPUExecutionProvider"]
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return OnnxEncoder(session, tokenizer, export, folder, folder, export.source.model_id, "", threads=1)


def agreement(model: Any, runtime: OnnxEncoder, texts: list[str]) -> dict[str, float]:
    """Tokens identical to `preprocess`'s (else InputError), then the cosine of the runtime's rows to torch's."""
    import torch

    for start in range(0, len(texts), 8):
        batch = texts[start : start + 8]
        ours = runtime.tokenizer(
            batch, padding=True, truncation="longest_first", max_length=runtime.max_seq_length, return_tensors="np"
        )
        theirs = model.preprocess(batch)
        for name in runtime.export.inputs:
            if not np.array_equal(np.asarray(ours[name]), theirs[name].numpy()):
                raise InputError(
                    f"the saved tokenizer's {name} differ from the model's own preprocessing (texts {start}-"
                    f"{start + len(batch) - 1}): this model's preprocessing does not export yet"
                )
    with torch.inference_mode():
        reference = model.encode(texts, batch_size=8, convert_to_numpy=True, normalize_embeddings=True)
    rows = np.concatenate([runtime.encode(texts[i : i + 8]) for i in range(0, len(texts), 8)])
    nonzero = np.linalg.norm(reference, axis=1) > 0
    cosines = (rows * reference).sum(axis=1)[nonzero]
    return {"texts": float(len(texts)), "min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean())}


def _versions() -> dict[str, str]:
    """Versions of the libraries that made the export."""
    found = {}
    for name in LIBRARIES:
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found
