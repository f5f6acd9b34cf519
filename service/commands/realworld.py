"""`nobackfill realworld corpus|models`: the real upgrade's data and models, built offline (service/realdata/).

    realworld corpus --out DIR    docstring pairs of the installed dependencies -> support / test / gallery files
    realworld models --out DIR    DIR/all-MiniLM-L6-v2 (new, 384-d) and DIR/minilm-static-256 (old, distilled)
    realworld texts --corpus DIR  a /v1/search answer (stdin) -> the texts of its hits (the API gives ids)
    realworld items --corpus DIR --out ITEMS   the gallery's item store (id -> text), for the operator page

Then, with the other commands: `encode` the gallery with the old model, `support build` from
support.jsonl, `fit`, `gallery build --from-npy ... --ids gallery_ids.npy`, `eval` on test.jsonl.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("corpus")
def corpus(
    out: Path = typer.Option(..., "--out", help="Folder to write (support.jsonl, test.jsonl, gallery.*, corpus.json)."),
    support: int = typer.Option(2000, "--support", min=1, help="Support pairs (for `fit`)."),
    test: int = typer.Option(1000, "--test", min=1, help="Test pairs (queries; their targets join the gallery)."),
    distractors: int | None = typer.Option(
        None, "--distractors", min=0, help="Gallery items besides the test targets (default: all remaining pairs)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the shuffle that splits the pairs."),
    packages: str | None = typer.Option(
        None, "--packages", help="Comma-separated import names to read instead of the default dependency list."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a corpus folder written earlier."),
) -> None:
    """Real (query, relevant text) pairs: docstring summaries -> descriptions of the installed dependencies."""
    from service.atomic_dir import check_output
    from service.errors import InputError
    from service.realdata import corpus as realcorpus
    from service.realdata.layout import CORPUS_JSON, CORPUS_WHAT, corpus_meta, write_corpus

    check_output(out, force, marker=CORPUS_JSON, what=CORPUS_WHAT)  # fail before a half-minute of parsing, not after
    names = (
        realcorpus.DEFAULT_PACKAGES if packages is None else tuple(n.strip() for n in packages.split(",") if n.strip())
    )
    if not names:
        raise InputError("--packages names no package")
    started = time.perf_counter()
    collected = realcorpus.collect(names)
    parts = realcorpus.split(collected.pairs, support=support, test=test, distractors=distractors, seed=seed)
    requested = {"support": support, "test": test, "distractors": distractors, "packages": list(names)}
    meta = corpus_meta(collected, parts, seed=seed, requested=requested)
    write_corpus(out, parts, meta, force=force)
    elapsed = time.perf_counter() - started
    for name, count in collected.packages.items():
        typer.echo(f"  {name:<22} {count.version or '?':<14} {count.found:>6,} found  {count.kept:>6,} kept")
    if collected.missing:
        typer.echo(f"  not installed (skipped): {', '.join(collected.missing)}")
    sizes = meta["sizes"]
    typer.echo(
        f"{sizes['pairs']:,} pairs in {elapsed:.0f} s: {sizes['support']:,} support, {sizes['test']:,} test, "
        f"gallery of {sizes['gallery']:,} ({sizes['distractors']:,} distractors) -> {out}"
    )


@app.command("models")
def models(
    out: Path = typer.Option(..., "--out", help="Folder to hold the two model folders."),
    pca_dims: int = typer.Option(256, "--pca-dims", min=2, help="Dimension of the distilled static model."),
    vocab_limit: int | None = typer.Option(
        None, "--vocab-limit", min=1, help="Distil only the first N word pieces (quick tests; default all)."
    ),
    force: bool = typer.Option(False, "--force", help="Rebuild both folders even when complete."),
) -> None:
    """The packaged all-MiniLM-L6-v2 (new) and a static model2vec model distilled from it (old); cached."""
    from service.realdata.models import build_models, embedding_dim

    started = time.perf_counter()
    built = build_models(out, pca_dims=pca_dims, vocab_limit=vocab_limit, force=force)
    typer.echo(f"models ready in {time.perf_counter() - started:.0f} s:")
    typer.echo(f"  old  {built.old}  dim {embedding_dim(built.old)}")
    typer.echo(f"  new  {built.new}  dim {embedding_dim(built.new)}")


@app.command("items")
def items(
    corpus: Path = typer.Option(..., "--corpus", help="The corpus folder the gallery was built from."),
    out: Path = typer.Option(..., "--out", help="Item store folder to write (NOBACKFILL_INDEX__ITEM_STORE)."),
    force: bool = typer.Option(False, "--force", help="Replace an item store written earlier."),
) -> None:
    """The item store of the corpus's gallery: each gallery id -> its text, keyed as `gallery build --ids` keys it."""
    import numpy as np

    from service.errors import InputError
    from service.items.store import write_item_store
    from service.realdata.layout import GALLERY_IDS, GALLERY_JSONL, read_jsonl
    from service.vocabulary import Modality

    rows = read_jsonl(corpus / GALLERY_JSONL)
    ids = np.load(corpus / GALLERY_IDS)
    # The gallery's rows are gallery_ids.npy's ids: a store keyed otherwise would show other items' texts.
    if [int(r["id"]) for r in rows] != ids.tolist():
        raise InputError(f"{corpus}: {GALLERY_JSONL} and {GALLERY_IDS} list other ids; rebuild the corpus")
    meta = write_item_store(
        out, ((int(r["id"]), str(r["text"])) for r in rows), Modality.text, str(corpus / GALLERY_JSONL), force=force
    )
    typer.echo(f"wrote item store {out}: {meta['count']:,} gallery texts of {corpus}")


@app.command("texts")
def texts(
    corpus: Path = typer.Option(..., "--corpus", help="The corpus folder the gallery was built from."),
    response: Path | None = typer.Option(None, "--input", help="A saved /v1/search answer (default: stdin)."),
    width: int = typer.Option(160, "--width", min=20, help="Characters of each text to show."),
) -> None:
    """Show a /v1/search answer with the gallery texts of its hits: `curl ... | nobackfill realworld texts`."""
    from service.errors import InputError
    from service.realdata.layout import GALLERY_JSONL, read_jsonl

    raw = response.read_text(encoding="utf-8") if response else sys.stdin.read()
    try:
        answer: Any = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(f"not a JSON search answer ({exc}): {raw[:200]!r}") from exc
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        raise InputError(f"the service answered {answer['error'].get('code')}: {answer['error'].get('message')}")
    if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
        raise InputError('not a /v1/search answer: expected {"results": [...]}')
    items = {int(row["id"]): row for row in read_jsonl(corpus / GALLERY_JSONL)}

    def show(ids: list[int], scores: list[float]) -> None:
        for rank, (item, score) in enumerate(zip(ids, scores, strict=False), 1):
            row = items.get(int(item))
            text = "(not in this corpus)" if row is None else str(row["text"])
            source = "" if row is None else f"  [{row.get('source', '')}]"
            shown = text if len(text) <= width else text[: width - 3] + "..."
            typer.echo(f"  {rank:>2}. id {item:<6} {score:.3f}{source}\n      {shown}")

    for number, result in enumerate(answer["results"]):
        typer.echo(f"query {number}: mode {result.get('mode')}, cache {result.get('cache')}")
        show(result.get("ids", []), result.get("scores", []))
        if "old_ids" in result:  # mode compare: the old system's answer to the same query
            typer.echo(f"query {number}, the old model alone (overlap {result.get('overlap')}):")
            show(result["old_ids"], result.get("old_scores", []))
