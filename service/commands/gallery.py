"""`nobackfill gallery build|info|eval`: build a frozen IVF-PQ gallery, inspect it, measure recall and latency.

`--backend milvus` builds and describes a Milvus collection instead (service/index/milvus_build.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import typer

if TYPE_CHECKING:
    from service.encoders.identity import ModelIdentity
    from service.index.sources import NpySource, SyntheticSource

app = typer.Typer(no_args_is_help=True)
FEATURE_CHUNK = 65536


@app.command("build")
def build(
    out: Path | None = typer.Option(None, "--out", help="Gallery folder to create (backend faiss)."),
    size: int | None = typer.Option(None, "--size", help="Synthetic world: items 0..N-1 (image view)."),
    synthetic_model: str = typer.Option(
        "old", "--synthetic-model", help="--size galleries: old, or new for a re-indexed baseline to benchmark against."
    ),
    from_npy: Path | None = typer.Option(None, "--from-npy", help="Your old-model embeddings (.npy or dir of shards)."),
    ids_npy: Path | None = typer.Option(None, "--ids", help="int64 ids per row of --from-npy (default: row number)."),
    from_segment: Path | None = typer.Option(
        None, "--from-segment", help="A finished new-model segment: the gallery of the cut-over (and next upgrade)."
    ),
    allow_partial: bool = typer.Option(False, "--allow-partial", help="--from-segment: build from a partial one."),
    model_id: str | None = typer.Option(
        None, "--model-id", help="Old model id for --from-npy (default: from OUT.json beside the .npy, else unknown)."
    ),
    features: str = typer.Option(
        "raw", "--features", help="raw embeddings, or psp / lsp features of old-model LOGITS (classifiers)."
    ),
    top_k: int | None = typer.Option(None, "--top-k", help="psp/lsp: keep the k largest entries per row."),
    nlist: int | None = typer.Option(None, "--nlist", help="IVF lists (default about 4 sqrt(N))."),
    pq_m: int = typer.Option(64, "--pq-m", help="PQ sub-quantizers (must divide the dimension)."),
    nbits: int = typer.Option(8, "--nbits", help="Bits per PQ code."),
    opq: bool = typer.Option(False, "--opq", help="Learn an OPQ rotation before PQ."),
    train_size: int | None = typer.Option(None, "--train-size", help="Training sample size."),
    chunk_size: int = typer.Option(65536, "--chunk-size", min=1, help="Vectors added per chunk (bounds memory)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing gallery."),
    items: Path | None = typer.Option(
        None, "--items", help="The item store of these rows (`encode --items-out`): its identity is recorded."
    ),
    backend: str = typer.Option("faiss", "--backend", help="faiss (a local folder) or milvus (a collection)."),
    uri: str | None = typer.Option(None, "--uri", help="milvus: http://host:19530, or a milvus-lite ./x.db."),
    collection: str | None = typer.Option(None, "--collection", help="milvus: collection to create or resume."),
    token: str | None = typer.Option(None, "--token", envvar="MILVUS_TOKEN", help="milvus: user:password or key."),
    index: str | None = typer.Option(
        None,
        "--index",
        help="milvus: IVF_PQ (a server's default), IVF_FLAT (milvus-lite's), IVF_SQ8, HNSW, FLAT, AUTOINDEX; "
        "milvus-lite also HNSW_SQ and BRUTE_FORCE, not IVF_PQ.",
    ),
    metric: str = typer.Option("IP", "--metric", help="milvus: IP, or COSINE (same ranking on unit rows)."),
) -> None:
    """Build a gallery: train on a sample, add in chunks, publish atomically with its fingerprint."""
    from service.errors import InputError
    from service.index.build import build_gallery
    from service.index.params import resolve

    if backend == "milvus":
        if (size is None) == (from_npy is None) or features != "raw":
            raise InputError(
                "--backend milvus loads raw old-model embeddings: give --from-npy FILE_OR_DIR, "
                "or --size N for the synthetic world"
            )
        _build_milvus(uri, collection, token, from_npy, size, ids_npy, model_id, index, nlist, pq_m, metric)
        return
    if backend != "faiss":
        raise InputError(f"--backend must be faiss or milvus, got {backend!r}")
    if out is None:
        raise InputError("give --out GALLERY_DIR (the folder to create)")
    if sum(x is not None for x in (size, from_npy, from_segment)) != 1:
        raise InputError("give exactly one of --size (synthetic world), --from-npy FILE_OR_DIR or --from-segment DIR")
    if features not in ("raw", "psp", "lsp"):
        raise InputError(f"--features must be raw, psp or lsp, got {features!r}")
    if features != "raw" and from_npy is None:
        raise InputError("--features psp/lsp needs --from-npy with the old model's logits")
    features_file = None
    if from_npy is not None:
        if not from_npy.exists():
            raise InputError(f"{from_npy}: no such file or directory")
        if features != "raw":
            features_file = _logit_features(from_npy, out, features, top_k)
    elif size is not None and size <= 0:
        raise InputError(f"--size must be positive, got {size}")
    try:
        if from_segment is not None:
            from service.segment.source import SegmentSource

            source: Any = SegmentSource(from_segment, allow_partial)
        else:
            source = _source(size, from_npy, ids_npy, model_id, rows=features_file, synthetic_model=synthetic_model)
        params = resolve(
            source.ntotal,
            source.dim,
            nlist=nlist,
            pq_m=pq_m,
            nbits=nbits,
            opq=opq,
            train_size=train_size,
            chunk_size=chunk_size,
        )
        extra = {"items": _items_identity(items, source.ntotal)} if items is not None else None
        meta = build_gallery(
            source, out, params, force=force, log=lambda line: typer.echo(line, err=True), extra_meta=extra
        )
    finally:
        if features_file is not None:  # the features are a build input only; the index holds them now
            features_file.unlink(missing_ok=True)
    size_mib = meta["index_bytes"] / 2**20
    typer.echo(
        f"built {out}: {meta['ntotal']:,} vectors, d={meta['d']}, {meta['factory']}, {size_mib:,.1f} MiB "
        f"in {meta['build']['total_s']:.0f} s, sha256 {str(meta['sha256'])[:16]}..."
    )


def _items_identity(items: Path, ntotal: int) -> dict[str, Any]:
    """The identity of the item store behind the rows; InputError when it holds another number of items."""
    from service.errors import InputError
    from service.items.store import ItemStore

    store = ItemStore.open(items)
    try:
        if store.count != ntotal:
            raise InputError(f"item store {items} holds {store.count:,} items, but the gallery gets {ntotal:,} rows")
        return store.identity.as_dict()
    finally:
        store.close()


def _milvus_client(uri: str | None, collection: str | None, token: str | None) -> Any:
    """A MilvusClient for --uri; InputError without --uri / --collection."""
    from service.errors import InputError
    from service.index.milvus import connect

    if not uri or not collection:
        raise InputError("--backend milvus needs --uri URI and --collection NAME")
    return connect(uri, token, timeout_s=30.0)


def _build_milvus(
    uri: str | None,
    collection: str | None,
    token: str | None,
    from_npy: Path | None,
    size: int | None,
    ids_npy: Path | None,
    model_id: str | None,
    index: str | None,
    nlist: int | None,
    pq_m: int,
    metric: str,
) -> None:
    """`gallery build --backend milvus`: load --from-npy (or the synthetic world) into the collection, index, load."""
    from service.errors import InputError
    from service.index.milvus_build import build_collection, chosen_index, index_params, progress_default

    if from_npy is not None and not from_npy.exists():
        raise InputError(f"{from_npy}: no such file or directory")
    if uri is None or collection is None:
        raise InputError("--backend milvus needs --uri URI and --collection NAME")
    index_type = chosen_index(index, uri)  # one the target builds, before a row is inserted
    source = _source(size, from_npy, ids_npy, model_id)  # --size: the same rows and ids as the faiss build's
    index_params(index_type, nlist, pq_m, source.ntotal, source.dim)  # bad --pq-m before connecting
    client = _milvus_client(uri, collection, token)
    try:
        done = build_collection(
            client,
            collection,
            source,
            index_type=index_type,
            nlist=nlist,
            pq_m=pq_m,
            metric=metric.upper(),
            progress=progress_default(),
            log=lambda line: typer.echo(line, err=True),
        )
    finally:
        client.close()
    typer.echo(
        f"built milvus collection {collection}: {done['row_count']:,} rows ({done['inserted']:,} inserted, "
        f"{done['skipped']:,} already there), {done['index']} {done['params']}, in {done['total_s']:.0f} s"
    )


def _source(
    size: int | None,
    from_npy: Path | None,
    ids_npy: Path | None,
    model_id: str | None,
    rows: Path | None = None,
    synthetic_model: str = "old",
) -> NpySource | SyntheticSource:
    """--size: the synthetic world; --from-npy: its rows (or `rows` derived from them) with the old model's identity."""
    from service.index.sources import NpySource, SyntheticSource

    if from_npy is None:
        assert size is not None
        return SyntheticSource(size, model=synthetic_model)
    identity = _npy_identity(from_npy, model_id)
    recorded = model_id or (identity.model_id if identity else "unknown")
    return NpySource(rows or from_npy, ids_npy, recorded, identity.as_dict() if identity else None)


def _npy_identity(from_npy: Path, model_id: str | None) -> ModelIdentity | None:
    """The old model's identity from the OUT.json beside each .npy (`nobackfill encode`); --model-id overrides its id.

    Shards from different models are refused: one gallery holds one model's space.  Shards without an
    OUT.json add nothing (a warning says how many), and none at all leaves the identity unknown.
    """
    from dataclasses import replace

    from service.bulk.encode import sidecar_identity
    from service.errors import InputError
    from service.index.sources import NpySource

    files = sorted(from_npy.glob("*.npy")) if from_npy.is_dir() else [from_npy]
    found: dict[Path, ModelIdentity] = {}
    for file in files:
        shard = NpySource(file)
        identity = sidecar_identity(file, shard.ntotal, shard.dim)
        if identity is not None:
            found[file] = identity
    if not found:
        return None
    first_file, first = next(iter(found.items()))
    for file, identity in found.items():
        if identity.backend != first.backend or not identity.same_model(first):
            raise InputError(
                f"{file.with_suffix('.json')}: model {identity.model_id} ({identity.backend}), but "
                f"{first_file.with_suffix('.json')} says {first.model_id} ({first.backend}); one gallery, one model"
            )
    if len(found) < len(files):
        typer.echo(
            f"warning: {len(files) - len(found)} of {len(files)} .npy files have no OUT.json beside them", err=True
        )
    if model_id is not None and model_id != first.model_id:
        typer.echo(f"note: recording --model-id {model_id!r} instead of {first.model_id!r} from OUT.json", err=True)
        return replace(first, model_id=model_id)
    return first


def _logit_features(logits_path: Path, out: Path, mode: str, top_k: int | None) -> Path:
    """Write PSP/LSP features of a logits .npy chunk by chunk beside `out`; returns the new file."""
    from service.compat.psp import gallery_features
    from service.errors import InputError

    if logits_path.is_dir():
        raise InputError(f"{logits_path}: --features psp/lsp takes one logits .npy, not a folder")
    logits = np.load(logits_path, mmap_mode="r")
    if logits.ndim != 2 or logits.dtype.kind != "f":
        raise InputError(f"{logits_path}: expected float logits [n, classes], got {logits.dtype} {logits.shape}")
    target = out.parent / f".{out.name}.{mode}-features.npy"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = np.lib.format.open_memmap(target, mode="w+", dtype=np.float32, shape=logits.shape)
    try:
        for start in range(0, logits.shape[0], FEATURE_CHUNK):
            block = np.asarray(logits[start : start + FEATURE_CHUNK], dtype=np.float32)
            if not np.isfinite(block).all():
                raise InputError(f"{logits_path}: NaN or inf in rows {start}..{start + len(block) - 1}")
            rows[start : start + len(block)] = gallery_features(block, mode, top_k)  # type: ignore[arg-type]
        rows.flush()
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return target


@app.command("adopt")
def adopt(
    index_file: Path = typer.Argument(..., help="A faiss index file your own pipeline built.", metavar="INDEX_FILE"),
    out: Path = typer.Option(..., "--out", help="The gallery folder to write (new)."),
    model_id: str = typer.Option(..., "--model-id", help="The old model that made the index's vectors."),
    backend: str | None = typer.Option(None, "--backend", help="That model's backend, recorded beside its id."),
    ids: Path | None = typer.Option(
        None, "--ids", help="int64 gallery id of each row, in the order they were added (the labels are positions)."
    ),
    metric: str | None = typer.Option(
        None, "--metric", help="ip or l2: confirms the index's own metric.", show_default="the index's"
    ),
    items: Path | None = typer.Option(
        None, "--items", help="The item store behind it: must hold exactly the index's ids (recorded, as `build` does)."
    ),
) -> None:
    """Adopt an existing FAISS index (IVF, HNSW, Flat; IDMap or not) as the frozen gallery, without rewriting it."""
    from service.index.adopted import adopt as adopt_index

    meta = adopt_index(index_file, out, model_id, backend, ids, metric, items)
    kind = meta["index"]
    # A Flat or HNSW index without an id map answers with positions: taken as the ids unless --ids maps them.
    positions = ids is None and not kind["id_map"] and kind["family"] != "ivf"
    labels = (
        f"labels are positions 0..{meta['ntotal'] - 1:,} (no id map), taken as the gallery ids: pass --ids "
        "IDS.npy if yours differ"
        if positions
        else f"labels are {meta['labels']}"
    )
    typer.echo(
        f"adopted {index_file} into {out} ({meta['source']['how']}): a faiss index, {kind['type']}"
        + (" with its id map" if kind["id_map"] else "")
        + f", {meta['ntotal']:,} rows of dim {meta['d']} by {kind['metric']}"
        + (f", {kind['nlist']:,} lists" if kind["nlist"] else "")
        + f"; {labels}; sha256 {meta['sha256'][:16]}..."
    )
    # Every setting serving needs: the profile, and the encoders unless they are the synthetic defaults.
    encoders = (
        ""
        if backend is None or backend.startswith("synthetic")
        else f"NOBACKFILL_OLD__BACKEND={backend} NOBACKFILL_OLD__PATH=OLD_MODEL_DIR "
        "NOBACKFILL_NEW__BACKEND=NEW_BACKEND NOBACKFILL_NEW__PATH=NEW_MODEL_DIR "
    )
    typer.echo(
        f"serve it: NOBACKFILL_INDEX__GALLERY_DIR={out} NOBACKFILL_COMPAT__PROFILE_DIR=PROFILE_DIR {encoders}"
        f"nobackfill serve   (PROFILE_DIR: the profile fitted from {model_id} to the new model, `nobackfill fit`)"
    )


@app.command("info")
def info(
    gallery_dir: Path | None = typer.Argument(None, help="Gallery folder (backend faiss).", metavar="GALLERY_DIR"),
    verify: bool = typer.Option(False, "--verify", help="Also check the sha256 of index.faiss and open it."),
    backend: str = typer.Option("faiss", "--backend", help="faiss (a folder) or milvus (a collection)."),
    uri: str | None = typer.Option(None, "--uri", help="milvus: http://host:19530, or a milvus-lite ./x.db."),
    collection: str | None = typer.Option(None, "--collection", help="milvus: the collection."),
    token: str | None = typer.Option(None, "--token", envvar="MILVUS_TOKEN", help="milvus: user:password or key."),
) -> None:
    """Print gallery.json; with --verify, load the gallery as the service does (fingerprint check)."""
    from service.errors import InputError
    from service.index.artifact import read_meta

    if backend == "milvus":
        from service.index.milvus_build import describe_collection

        client = _milvus_client(uri, collection, token)
        assert collection is not None
        try:
            described = describe_collection(client, collection)
        finally:
            client.close()
        typer.echo(json.dumps(described, indent=2, sort_keys=True, default=str))
        if described["index"] is None:
            raise InputError(
                f"collection {collection} has no vector index: serving it would fail (Milvus loads only an indexed "
                "collection); re-run `nobackfill gallery build --backend milvus` with the same --uri and "
                "--collection (it resumes, and indexes what is there)"
            )
        return
    if backend != "faiss":
        raise InputError(f"--backend must be faiss or milvus, got {backend!r}")
    if gallery_dir is None:
        raise InputError("give the gallery folder (or --backend milvus --uri URI --collection NAME)")
    meta = read_meta(gallery_dir)
    typer.echo(json.dumps(meta, indent=2, sort_keys=True))
    if verify:
        from service.index.adopted import AdoptedGallery, is_adopted
        from service.index.gallery import Gallery

        if is_adopted(gallery_dir):
            adopted = AdoptedGallery.load(gallery_dir)
            typer.echo(f"verified: sha256 matches, {adopted.ntotal:,} vectors, faiss index type {adopted.kind['type']}")
            return
        gallery = Gallery.load(gallery_dir, progress=True)
        typer.echo(f"verified: sha256 matches, {gallery.ntotal:,} vectors, nlist {gallery.nlist}")


@app.command("eval")
def evaluate(
    gallery_dir: Path = typer.Argument(..., help="Gallery folder.", metavar="GALLERY_DIR"),
    queries: int = typer.Option(200, "--queries", min=1, help="Evaluation queries."),
    nprobe: str = typer.Option("1,4,8,16,32,64", "--nprobe", help="Comma-separated nprobe values."),
    sample: int = typer.Option(
        100_000, "--sample", min=1, help="Entries in the sub-gallery used for recall (a built gallery)."
    ),
    batch: int = typer.Option(256, "--batch", min=1, help="Batch size for the batched latency."),
    from_npy: Path | None = typer.Option(
        None, "--from-npy", help="Source vectors, if they moved since the build; an adopted PQ/SQ index's rows."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (with the recommended nprobe)."),
    ef_search: str = typer.Option(
        "16,32,64,128,256,512", "--ef-search", help="An adopted HNSW index: comma-separated efSearch values."
    ),
) -> None:
    """Recall@1/@10 against exact search and latency per nprobe (or efSearch, for an adopted HNSW index)."""
    from service.index.adopted import is_adopted
    from service.index.gallery import Gallery
    from service.scoring.gallery_eval import evaluate_gallery, format_report, source_of

    probes = _widths(nprobe, "--nprobe")
    if is_adopted(gallery_dir):  # the user's own index: measured whole, at its own family's width
        _evaluate_adopted(gallery_dir, probes, _widths(ef_search, "--ef-search"), queries, batch, from_npy, as_json)
        return
    gallery = Gallery.load(gallery_dir, progress=True)
    report = evaluate_gallery(
        gallery, source_of(gallery, from_npy), queries=queries, nprobes=probes, sample=sample, batch=batch
    )
    typer.echo(json.dumps(report.as_dict(), indent=2) if as_json else format_report(report))


def _widths(given: str, flag: str) -> tuple[int, ...]:
    """Comma-separated positive integers, or InputError naming the flag."""
    from service.errors import InputError

    try:
        widths = tuple(int(p) for p in given.split(",") if p.strip())
    except ValueError as exc:
        raise InputError(f"{flag} must be comma-separated integers, got {given!r}") from exc
    if not widths or min(widths) < 1:
        raise InputError(f"{flag} needs positive integers, got {given!r}")
    return widths


def _evaluate_adopted(
    gallery_dir: Path,
    nprobes: tuple[int, ...],
    ef_searches: tuple[int, ...],
    queries: int,
    batch: int,
    from_npy: Path | None,
    as_json: bool,
) -> None:
    """`gallery eval` of an adopted index at the widths its family takes, with the service's own settings."""
    from service.index.adopted import AdoptedGallery
    from service.index.adopted_rows import AdoptedRows
    from service.scoring.adopted_eval import evaluate_adopted, format_adopted_report
    from service.settings import Settings

    settings = Settings().index  # NOBACKFILL_INDEX__*: the width the service would search at
    gallery = AdoptedGallery.load(gallery_dir, ef_search=settings.adopted_ef_search)
    family = gallery.kind["family"]
    if family == "hnsw":
        served, widths = gallery.ef_search, (*ef_searches, gallery.ef_search or 16)
    elif family == "ivf":
        served, widths = min(settings.nprobe, gallery.max_nprobe or settings.nprobe), (*nprobes, settings.nprobe)
    else:
        served, widths = None, ()
    rows = AdoptedRows(gallery, from_npy)
    report = evaluate_adopted(gallery, rows, widths, queries=queries, batch=batch, served_width=served)
    typer.echo(json.dumps(report.as_dict(), indent=2) if as_json else format_adopted_report(report))


@app.command("hubness")
def hubness(
    gallery_dir: Path = typer.Argument(
        ..., help="The frozen FAISS gallery, built or adopted (its vectors are read back).", metavar="GALLERY_DIR"
    ),
    profile_dir: Path = typer.Argument(..., help="The profile whose head maps the queries.", metavar="PROFILE_DIR"),
    queries: Path = typer.Option(
        ..., "--queries", help="A support folder, or an exported traffic folder: the (old, new) queries to map."
    ),
    out: Path = typer.Option(..., "--out", help="Sidecar folder to write (NOBACKFILL_COMPAT__HUBNESS_DIR)."),
    k: int = typer.Option(10, "--k", min=1, help="Nearest mapped queries averaged per item."),
    modality: str | None = typer.Option(None, "--query-modality", help="Modality of the queries (default: first)."),
    chunk_size: int = typer.Option(16_384, "--chunk-size", min=1, help="Gallery rows scored at a time."),
    from_npy: Path | None = typer.Option(
        None, "--from-npy", help="The gallery's source vectors, if moved; an adopted PQ/SQ index's rows."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing sidecar."),
) -> None:
    """Per-item hubness bias (CSLS) of a gallery against a profile's mapped queries, for serving and `eval`."""
    import time

    from service.atomic_dir import check_output
    from service.compat.hubness import biases, mapped_queries, write_hubness
    from service.compat.procrustes import normalize_rows
    from service.compat.profile import load_profile
    from service.index.adopted import AdoptedGallery, is_adopted
    from service.index.adopted_rows import AdoptedRows
    from service.index.gallery import Gallery
    from service.index.sources import Source, chunks
    from service.progress import progress_bar
    from service.scoring.gallery_eval import source_of

    check_output(out, force)
    profile = load_profile(profile_dir)
    gallery: Gallery | AdoptedGallery
    source: Source
    if is_adopted(gallery_dir):  # the user's own index: its rows read back (or --from-npy for PQ / SQ codes)
        gallery = AdoptedGallery.load(gallery_dir)
        source = AdoptedRows(gallery, from_npy)
    else:
        gallery = Gallery.load(gallery_dir)
        source = source_of(gallery, from_npy)
    modality = modality or (sorted(profile.alphas) or ["text"])[0]
    mapped, where = mapped_queries(profile, queries, modality)
    started = time.perf_counter()
    bar = progress_bar(total=gallery.ntotal, unit="item", desc="hubness")

    def scored() -> Any:
        for ids, rows in chunks(source, chunk_size):
            yield ids, normalize_rows(rows)
            bar.update(len(ids))

    ids, bias = biases(scored(), mapped, k)
    bar.close()
    seconds = time.perf_counter() - started
    meta = {
        "gallery_fingerprint": gallery.fingerprint,
        "profile_id": profile.profile_id,
        "head": str(profile.head),
        "k": k,
        "queries": int(len(mapped)),
        "queries_from": f"{where} {queries}",
        "modality": modality,
        "items": int(len(ids)),
        "seconds": round(seconds, 1),
    }
    write_hubness(out, ids, bias, meta)
    typer.echo(
        f"wrote hubness sidecar {out}: {len(ids):,} items against {len(mapped):,} mapped {where} queries (k {k}) "
        f"in {seconds:.1f} s; mean bias {float(bias.mean()):.4f}, max {float(bias.max()):.4f}"
    )
