"""`nobackfill synth support|test`: support / test folders from the synthetic upgrade world.

Item ranges (so no support item is ever a gallery or test item):
- galleries built with `gallery build --size N` hold items 0..N-1 (image view, old model);
- `synth test` queries captions of items drawn from 0..G-1 (G = --gallery-size, default N);
- `synth support` uses items from SUPPORT_FIRST_ITEM = 10^12 upward.
Both write models.json (the two synthetic models' identities) as `support build` does, so `fit`
records the right ids without being told.

--modality picks the query side: text (default) queries a caption against the items' image views,
image queries the image view against the items' captions (an image -> text upgrade), so one set of
support items gives a text and an image support set for a profile that serves both
(`fit --support text=DIR --support image=DIR`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import typer

from service.vocabulary import Modality

app = typer.Typer(no_args_is_help=True)


SUPPORT_FIRST_ITEM = 10**12
# The options `support` and `test` share.
QUERY_MODALITY = typer.Option(
    Modality.text, help="Query modality: text (caption -> image) or image (image -> caption)."
)
OLD_MODEL = typer.Option("old", "--old-model", help="Simulated model of the gallery: old, new or next.")
NEW_MODEL = typer.Option("new", "--new-model", help="Simulated model replacing it: old, new or next.")
SUPPORT_CAPTION = 0
TEST_CAPTION = 1


def _write(
    out: Path,
    query_items: np.ndarray,
    target_items: np.ndarray,
    caption: int,
    force: bool,
    modality: str = "text",
    models: tuple[str, str] = ("old", "new"),
) -> None:
    """Encode queries and targets with both simulated models (text: caption -> image, image: image -> caption)."""
    from service.atomic_dir import check_output, staging
    from service.bulk.support import models_json
    from service.encoders.identity import MODELS_JSON, ModelIdentity
    from service.encoders.synthetic import IMAGE_VIEW, SYNTHETIC_MODELS, synthetic_encoder
    from service.errors import InputError

    unknown = [name for name in models if name not in SYNTHETIC_MODELS]
    if unknown:
        raise InputError(f"no simulated model {unknown[0]!r}; they are {', '.join(SYNTHETIC_MODELS)}")
    check_output(out, force)
    if models[0] == models[1]:
        raise InputError(f"--old-model and --new-model are both {models[0]}: an upgrade needs two models")
    old, new = (synthetic_encoder(name) for name in models)
    query_view, target_view = (caption, IMAGE_VIEW) if modality == "text" else (IMAGE_VIEW, caption)
    arrays: dict[str, npt.NDArray[Any]] = {
        "old_query.npy": old.encode_items(query_items, query_view),
        "new_query.npy": new.encode_items(query_items, query_view),
        "old_target.npy": old.encode_items(target_items, target_view),
        "new_target.npy": new.encode_items(target_items, target_view),
        "query_ids.npy": query_items.astype(np.int64),
        "target_ids.npy": target_items.astype(np.int64),
    }
    old_model, new_model = (
        ModelIdentity(f"synthetic-{name}", e.model_id, None, e.dim) for name, e in zip(models, (old, new), strict=True)
    )
    target_modality = "image" if modality == "text" else "text"
    record = models_json(old_model, new_model, modality, target_modality, len(query_items), targets=len(target_items))
    with staging(out, marker=MODELS_JSON) as tmp:
        for name, array in arrays.items():
            np.save(tmp / name, array)
        (tmp / MODELS_JSON).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    typer.echo(f"wrote {len(query_items):,} queries and {len(target_items):,} targets to {out}")


@app.command("support")
def support(
    n: int = typer.Option(20_000, "--n", min=1, help="Support pairs (caption query + image target per item)."),
    out: Path = typer.Option(..., "--out", help="Folder to write."),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty folder."),
    modality: Modality = QUERY_MODALITY,
    old_model: str = OLD_MODEL,
    new_model: str = NEW_MODEL,
) -> None:
    """A support set for `nobackfill fit`, from items disjoint from every gallery."""
    items = np.arange(SUPPORT_FIRST_ITEM, SUPPORT_FIRST_ITEM + n, dtype=np.int64)
    _write(out, items, items, SUPPORT_CAPTION, force, modality.value, (old_model, new_model))


@app.command("test")
def test(
    n: int = typer.Option(..., "--n", min=1, help="Test queries (captions of gallery items)."),
    out: Path = typer.Option(..., "--out", help="Folder to write."),
    gallery_size: int | None = typer.Option(None, "--gallery-size", min=1, help="Targets: items 0..G-1 (default N)."),
    seed: int = typer.Option(0, "--seed", help="Which gallery items are queried."),
    force: bool = typer.Option(False, "--force", help="Overwrite a non-empty folder."),
    modality: Modality = QUERY_MODALITY,
    old_model: str = OLD_MODEL,
    new_model: str = NEW_MODEL,
) -> None:
    """A test set for `nobackfill eval`: captions of gallery items against the gallery's image views."""
    from service.errors import InputError

    size = gallery_size or n
    if n > size:
        raise InputError(f"--n {n} is more than the {size} gallery items to query")
    targets = np.arange(size, dtype=np.int64)
    queries = np.sort(np.random.default_rng(seed).choice(size, n, replace=False)).astype(np.int64)
    _write(out, queries, targets, TEST_CAPTION, force, modality.value, (old_model, new_model))


@app.command("items")
def items(
    size: int = typer.Option(..., "--size", min=1, help="Gallery items 0..N-1, as `gallery build --size N` holds."),
    out: Path = typer.Option(..., "--out", help="Item store folder to write."),
    force: bool = typer.Option(False, "--force", help="Replace an existing item store."),
) -> None:
    """The item store of a synthetic gallery: id i -> `item-000000000i image` (what backfill re-encodes)."""
    from service.encoders.synthetic import IMAGE_VIEW, format_item
    from service.items.store import write_item_store

    rows = ((i, format_item(i, IMAGE_VIEW)) for i in range(size))
    # Text: the synthetic encoders read the view from the string itself (docs/synthetic-world.md).
    meta = write_item_store(out, rows, Modality.text, f"synthetic world, items 0..{size - 1}", force=force)
    # Not "(image view)": on the text demo that reads as if the items were images; they are texts that
    # name the view the gallery was built from.
    typer.echo(
        f"wrote item store {out}: {meta['count']:,} synthetic items, as the texts the synthetic models read "
        f"({format_item(0, IMAGE_VIEW)!r} ...)"
    )
