"""`nobackfill traffic export`: the sampled (old, new) query pairs of the configured store, as a folder `fit` reads.

The store is the one the service writes (service/traffic/, settings `traffic.*`): the Redis stream when
a Redis URL is set, the local shards otherwise.  The folder is what `fit --add-query-pairs` takes
(docs/traffic-learning.md has the whole rollout: export, refit, compare, reload).
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("export")
def export(
    out: Path = typer.Option(..., "--out", help="Folder to write old_query.npy, new_query.npy and models.json into."),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Export the newest N pairs (default: all)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty --out."),
) -> None:
    """Export the stored traffic pairs of the models served now; pairs of other models are refused."""
    from service.errors import ArtifactError, NobackfillError
    from service.settings import Settings
    from service.traffic.export import export_pairs
    from service.traffic.sampler import create_store

    settings = Settings()
    store = create_store(settings)
    try:
        done = export_pairs(store, out, limit=limit, force=force)
    except NobackfillError:
        raise
    except Exception as exc:  # redis, OSError, a malformed entry: one line, exit 2
        raise ArtifactError(f"the {store.kind} traffic store could not be read: {exc}") from exc
    finally:
        store.close()
    for models, n in done.refused.items():
        typer.echo(f"warning: refused {n} stored pair(s) of models {models} (not the newest pairs' models)", err=True)
    modalities = ", ".join(f"{n} {m}" for m, n in done.modalities.items())
    typer.echo(
        f"wrote {done.pairs} pairs ({modalities} queries) of {done.old.model_id} -> {done.new.model_id} "
        f"from the {store.kind} store to {out}"
    )
