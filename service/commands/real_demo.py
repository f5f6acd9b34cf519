"""`nobackfill demo --real`: a real upgrade from raw text to a served profile, with the CLI alone.

Old model: a static model2vec model distilled from all-MiniLM-L6-v2 (256-d); new model: the packaged
all-MiniLM-L6-v2 itself (384-d); data: docstring summary -> description pairs of the installed
dependencies.  Each step is one `nobackfill` command, skipped when its output exists, so a second
run goes straight to serving:

    realworld models   artifacts/real/models/{minilm-static-256, all-MiniLM-L6-v2}
    realworld corpus   artifacts/real/corpus/{support,test}.jsonl, gallery.{txt,jsonl}, gallery_ids.npy
    support build      artifacts/real/support and artifacts/real/test (both models, models.json)
    encode             artifacts/real/gallery-old.npy (+ .json): the gallery through the OLD model only
    realworld items    artifacts/real/items: id -> text of every gallery item (the operator page shows them)
    gallery build      artifacts/real/gallery (IVF-PQ of the old embeddings, ids = corpus ids, the items' identity)
    fit / eval         artifacts/real/profile; the eval table on the test pairs, saved as artifacts/real/eval.json

A folder prepared before the item store existed keeps its gallery (which then records no item store:
the service only checks the count) and gets the store and the saved eval added.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import typer

from service.commands.invocation import cli_invocation
from service.settings import CompatSettings, EncoderSettings, IndexSettings, Settings

REAL_DIR = Path("artifacts/real")
OLD_MODEL = "minilm-static-256"
NEW_MODEL = "all-MiniLM-L6-v2"
BACKEND = "sentence-transformers"
NPROBE = 32
# Runs one `nobackfill` subcommand as a user would, stopping the demo when it fails.
Run = Callable[..., None]

CURL = """\
curl -s http://{host}:{port}/v1/search -H 'content-type: application/json' \\
  -d '{body}' | {nobackfill} realworld texts --corpus {corpus}"""


@dataclass(frozen=True)
class RealDeployment:
    """Where `demo --real` keeps each artifact."""

    root: Path

    @property
    def old_model(self) -> Path:
        """The static old model's folder."""
        return self.root / "models" / OLD_MODEL

    @property
    def new_model(self) -> Path:
        """The MiniLM new model's folder."""
        return self.root / "models" / NEW_MODEL

    @property
    def corpus(self) -> Path:
        """The docstring corpus folder."""
        return self.root / "corpus"

    @property
    def gallery(self) -> Path:
        """The frozen old-model gallery."""
        return self.root / "gallery"

    @property
    def profile(self) -> Path:
        """The fitted compat profile."""
        return self.root / "profile"

    @property
    def items(self) -> Path:
        """The gallery's item store (id -> text)."""
        return self.root / "items"

    @property
    def saved_eval(self) -> Path:
        """The profile's eval on the test pairs, as `eval --json-out` saves it (the operator page's table)."""
        return self.root / "eval.json"

    def settings(self) -> Settings:
        """The service settings that serve this upgrade (what the printed environment variables say)."""
        return Settings(
            old=EncoderSettings(backend=BACKEND, path=str(self.old_model)),
            new=EncoderSettings(backend=BACKEND, path=str(self.new_model)),
            index=IndexSettings(gallery_dir=self.gallery, nprobe=NPROBE, item_store=self.items),
            compat=CompatSettings(profile_dir=self.profile),
        )

    def environment(self) -> str:
        """The same settings as environment variables for `nobackfill serve`."""
        return "\n".join(
            [
                f"export NOBACKFILL_OLD__BACKEND={BACKEND} NOBACKFILL_OLD__PATH={self.old_model}",
                f"export NOBACKFILL_NEW__BACKEND={BACKEND} NOBACKFILL_NEW__PATH={self.new_model}",
                f"export NOBACKFILL_INDEX__GALLERY_DIR={self.gallery} NOBACKFILL_INDEX__NPROBE={NPROBE}",
                f"export NOBACKFILL_INDEX__ITEM_STORE={self.items}",
                f"export NOBACKFILL_COMPAT__PROFILE_DIR={self.profile}",
                f"export NOBACKFILL_API__UI=true NOBACKFILL_API__UI_EVAL={self.saved_eval}",
            ]
        )

    def onnx_hint(self) -> str:
        """How to serve the new model on ONNX Runtime instead of torch (docs/real-models.md, "The ONNX runtime")."""
        export = self.root / "models" / "new-onnx-int8"  # beside the model folder: inside, it would change its sha256
        return (
            f"faster on CPU, the new model on ONNX Runtime int8: `{cli_invocation()} encoder export {self.new_model} "
            f"--out {export} --int8`, then serve with NOBACKFILL_NEW__RUNTIME=onnx NOBACKFILL_NEW__ONNX_DIR={export} "
            "(same model identity, so the same profile and gallery; docs/real-models.md)"
        )


def _support_build(run: Run, real: RealDeployment, pairs: Path, out: Path) -> None:
    """Encode a pairs file with both models into a support-layout folder (skipped when present)."""
    if (out / "models.json").exists():
        return
    run(
        "support", "build", "--pairs", pairs, "--out", out, "--old-backend", BACKEND, "--old-path", real.old_model,
        "--new-backend", BACKEND, "--new-path", real.new_model,
    )  # fmt: skip


def prepare(real: RealDeployment, run: Run) -> None:
    """Build every artifact of the real upgrade that is missing, in order."""
    if not (real.old_model.is_dir() and real.new_model.is_dir()):
        typer.echo("building the models (the static one is distilled from MiniLM: ~30 s)")
        run("realworld", "models", "--out", real.root / "models")
    if not (real.corpus / "corpus.json").exists():
        run("realworld", "corpus", "--out", real.corpus)
    _support_build(run, real, real.corpus / "support.jsonl", real.root / "support")
    _support_build(run, real, real.corpus / "test.jsonl", real.root / "test")
    embeddings = real.root / "gallery-old.npy"
    if not embeddings.with_suffix(".json").exists():
        run("encode", "--backend", BACKEND, "--path", real.old_model, "--input", real.corpus / "gallery.txt",
            "--out", embeddings, "--force")  # fmt: skip
    if not (real.items / "items.json").exists():
        run("realworld", "items", "--corpus", real.corpus, "--out", real.items, "--force")
    if not (real.gallery / "gallery.json").exists():
        run("gallery", "build", "--from-npy", embeddings, "--ids", real.corpus / "gallery_ids.npy",
            "--items", real.items, "--out", real.gallery, "--force")  # fmt: skip
    fitted = not (real.profile / "profile.json").exists()
    if fitted:
        run("fit", real.root / "support", "--out", real.profile, "--force")
    if fitted or not real.saved_eval.exists():
        run("eval", real.profile, real.root / "test", "--json-out", real.saved_eval)


def example_query(real: RealDeployment) -> str:
    """The first test query from numpy's docstrings (a familiar question; its description is in the gallery)."""
    sources = {}
    with (real.corpus / "gallery.jsonl").open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            sources[row["id"]] = str(row.get("source", ""))
    with (real.corpus / "test.jsonl").open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    numpy_rows = [row for row in rows if sources.get(row["target_id"], "").startswith("numpy.")]
    return str((numpy_rows or rows)[0]["query"])


def curl_example(real: RealDeployment, host: str, port: int) -> str:
    """A curl that asks a real question and shows the texts of the top hits."""
    body = json.dumps({"queries": [{"text": example_query(real)}], "k": 5})
    quoted = body.replace("'", "'\\''")
    return CURL.format(host=host, port=port, body=quoted, corpus=real.corpus, nobackfill=cli_invocation())
