"""`nobackfill gallery build|info`: build a frozen IVF-PQ gallery and inspect it."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("build")
def build(
    out: Path = typer.Option(..., "--out", help="Gallery folder to create."),
    size: int | None = typer.Option(None, "--size", help="Synthetic world: items 0..N-1 (old model, image view)."),
    from_npy: Path | None = typer.Option(None, "--from-npy", help="Your old-model embeddings (.npy or dir of shards)."),
    ids_npy: Path | None = typer.Option(None, "--ids", help="int64 ids per row of --from-npy (default: row number)."),
    model_id: str = typer.Option("unknown", "--model-id", help="Old model id recorded for --from-npy galleries."),
    nlist: int | None = typer.Option(None, "--nlist", help="IVF lists (default about 4 sqrt(N))."),
    pq_m: int = typer.Option(64, "--pq-m", help="PQ sub-quantizers (must divide the dimension)."),
    nbits: int = typer.Option(8, "--nbits", help="Bits per PQ code."),
    opq: bool = typer.Option(False, "--opq", help="Learn an OPQ rotation before PQ."),
    train_size: int | None = typer.Option(None, "--train-size", help="Training sample size."),
    force: bool = typer.Option(False, "--force", help="Replace an existing gallery."),
) -> None:
    """Build a gallery: train on a sample, add in chunks, publish atomically with its fingerprint."""
    from service.errors import InputError
    from service.index.build import build_gallery
    from service.index.params import resolve
    from service.index.sources import NpySource, Source, SyntheticSource

    if (size is None) == (from_npy is None):
        raise InputError("give exactly one of --size (synthetic world) or --from-npy FILE_OR_DIR")
    source: Source
    if from_npy is not None:
        if not from_npy.exists():
            raise InputError(f"{from_npy}: no such file or directory")
        source = NpySource(from_npy, ids_npy, model_id)
    else:
        assert size is not None
        if size <= 0:
            raise InputError(f"--size must be positive, got {size}")
        source = SyntheticSource(size)
    params = resolve(source.ntotal, source.dim, nlist=nlist, pq_m=pq_m, nbits=nbits, opq=opq, train_size=train_size)
    meta = build_gallery(source, out, params, force=force)
    typer.echo(f"built {out}: {meta['ntotal']:,} vectors, d={meta['d']}, sha256 {str(meta['sha256'])[:16]}...")


@app.command("info")
def info(gallery_dir: Path = typer.Argument(..., help="Gallery folder.")) -> None:
    """Print gallery.json and the index file size (no fingerprint check: that happens on load)."""
    from service.index.artifact import read_meta

    typer.echo(json.dumps(read_meta(gallery_dir), indent=2, sort_keys=True))
