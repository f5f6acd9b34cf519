"""`nobackfill backfill run|status|index|cutover|repair|curve|cascade`: move items into the segment, score it offline.

Thin over service/backfill/: cheap checks first (segment, gallery, items, profile), then the model
loads, then the run (run.py).  Every refusal is one `error:` line and exit 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from service.commands import render
from service.commands.backfill_scoring import cascade, curve
from service.vocabulary import Modality, Order

# --probe-queries: fewer queries than this (each 10 neighbours) cannot tell 0.99 from 0.98.
MIN_PROBE_QUERIES = 100

if TYPE_CHECKING:  # types only: `--help` stays free of numpy
    from service.compat.io import QueryPairs
    from service.encoders.identity import ModelIdentity
    from service.rows import F32

app = typer.Typer(no_args_is_help=True)
# Where --hits reads without one: the service's default hits folder (traffic.hits_dir's default; the
# service/traffic/hits.py DEFAULT_FOLDER), not imported from there, to keep `--help` free of numpy.
HITS_FOLDER = Path("artifacts/hits")
# The segments in the user's own store that --segment / SEGMENT name (commands/store_segment.py).
IN_STORES = "pgvector:COLUMN, pgvector-table:TABLE, qdrant:VECTOR, qdrant-collection:NAME or milvus-collection:NAME"


def _segment_argument(help_text: str) -> Any:
    """The SEGMENT argument of status, index, cutover and repair."""
    return typer.Argument(..., help=help_text, metavar="SEGMENT")


@app.command("run")
def run(
    segment: Path = typer.Option(
        ...,
        "--segment",
        help="Segment folder (created on the first run), pgvector:COLUMN (a new column of the pgvector "
        "table the NOBACKFILL_INDEX__PGVECTOR_* settings name) or pgvector-table:TABLE (a side table beside it); "
        "qdrant:VECTOR (a named vector of the NOBACKFILL_INDEX__QDRANT_* collection) or qdrant-collection:NAME; "
        "milvus-collection:NAME (a collection beside the NOBACKFILL_INDEX__MILVUS_* one).",
    ),
    add_column: bool = typer.Option(
        False,
        "--add-column",
        "--add-table",
        "--add-vector",
        "--add-collection",
        help="pgvector:COLUMN: add the column when it is not there (ALTER TABLE, no rewrite); pgvector-table:TABLE: "
        "create the side table; qdrant:VECTOR (--add-vector): add the named vector; qdrant-collection:NAME, "
        "milvus-collection:NAME: create it.",
    ),
    input_path: Path = typer.Option(
        ..., "--input", help="The gallery's items: an item store, or a file / image folder as `encode` reads it."
    ),
    field: str | None = typer.Option(None, "--field", help="JSONL: the key holding each input."),
    id_field: str | None = typer.Option(None, "--id-field", help="JSONL: the key holding each gallery id."),
    modality: Modality = typer.Option(Modality.text, "--modality", help="text, or image (inputs are image files)."),
    ids: Path | None = typer.Option(None, "--ids", help="int64 gallery id per input (default: the input's position)."),
    gallery: Path | None = typer.Option(
        None, "--gallery", help="The frozen gallery folder (needed when the segment is created; checked after)."
    ),
    backend: str = typer.Option(..., "--backend", help="New model's backend: sentence-transformers, clip, ..."),
    path: Path | None = typer.Option(None, "--path", help="New model folder (none for the synthetic backends)."),
    model_id: str | None = typer.Option(None, "--model-id", help="Model id to record (default: the folder's name)."),
    profile: Path | None = typer.Option(
        None, "--profile", help="Compat profile: the new model must be the profile's new model."
    ),
    new_model_id: str | None = typer.Option(
        None,
        "--new-model-id",
        help="Without --profile or an existing segment: confirms the new model (its model id must be this).",
    ),
    order: Order = typer.Option(
        Order.given, "--order", help="given (input order), random (seeded) or hot (hits first)."
    ),
    fraction: float | None = typer.Option(
        None,
        "--fraction",
        min=0.0,
        max=1.0,
        help="Stop once the segment holds this share of the gallery.",
        show_default="every item",
    ),
    limit: int | None = typer.Option(None, "--limit", min=0, help="Move at most this many items in this run."),
    rate: float | None = typer.Option(
        None, "--rate", min=0.001, help="At most this many items per second.", show_default="unthrottled"
    ),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Items per encoder call."),
    shard_size: int = typer.Option(4096, "--shard-size", min=1, help="Rows per published shard."),
    part: str | None = typer.Option(
        None,
        "--part",
        help="Move only part I of N (I/N, counted from 0: a Kubernetes Indexed Job's JOB_COMPLETION_INDEX); "
        "N runs fill one segment side by side.",
        show_default="every item",
    ),
    seal_rows: int = typer.Option(
        10_000,
        "--seal-rows",
        min=0,
        help="At the end, seal the rows no index covers into an HNSW index once there are this many (0: never).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of --order random (and of the rest after the hot ids)."),
    probe_queries: Path | None = typer.Option(
        None,
        "--probe-queries",
        help="A traffic export or support folder: the seal measures its index's search width on these new-model "
        "queries (recall@10 0.99 of exact) instead of on its own rows.",
    ),
    hits: str | None = typer.Option(
        None,
        "--hits",
        help="--order hot: the service's hit counts, a folder (its traffic.hits_dir) or a redis:// URL.",
        show_default=str(HITS_FOLDER),
    ),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda:0, ..."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="Torch CPU threads (default: all usable cores)."),
    onnx: Path | None = typer.Option(
        None,
        "--onnx",
        help="Run the model on ONNX Runtime (CPU): the folder `nobackfill encoder export` wrote from --path.",
    ),
    nice: int = typer.Option(
        0, "--nice", min=0, max=19, help="Lower this run's CPU priority by N, below a service on the same box."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the run's summary as JSON."),
) -> None:
    """Re-encode gallery items with the new model into the segment; resumable, throttled, in the chosen order."""
    import os

    # With --nice, below the service's priority: on a shared box its requests then preempt the backfill's
    # bursts (encoding, a shard's sha256).  docs/backfill.md has the served p99 with and without.
    os.nice(nice)
    from service.backfill.run import Part, RunOptions, describe_report, run_backfill
    from service.backfill.sources import open_items
    from service.bulk.encode import load_encoder
    from service.errors import InputError
    from service.vocabulary import Role

    if fraction is not None and limit is not None:  # before the model loads: a typo fails at once
        raise InputError("give --fraction or --limit, not both")
    my_part = Part.parse(part) if part is not None else None  # before the model loads: a typo fails at once
    column = _store_segment(segment)
    if column is None:
        _need_a_model_reference(segment, profile, new_model_id)
    elif profile is None and new_model_id is None and not column.exists():
        raise InputError(
            f"{column.where}: no column yet and no --profile: pass --profile PROFILE_DIR or --new-model-id ID "
            "to confirm the model its rows come from"
        )
    _refuse_an_artifact_as_items(input_path)
    probes = _probe_queries(probe_queries, in_store=column is not None)  # before the model loads: fails at once
    source = open_items(input_path, modality, field, id_field, ids)
    gallery_ref = _gallery_ref(segment, gallery, source) if column is None else column.gallery_ref()
    hot = _hot_ids(hits) if order == Order.hot else None
    encoder, identity = load_encoder(
        backend, path, role=Role.new, device=device, model_id=model_id, threads=threads, onnx_dir=onnx
    )
    if profile is not None:
        _check_profile(profile, identity)
    if new_model_id is not None and identity.model_id != new_model_id:
        raise InputError(
            f"--new-model-id {new_model_id} was confirmed, but the encoder is "
            f"{render.model_name(identity.backend, identity.model_id)}"
        )
    seal_queries = _probe_rows(probes, identity)
    options = RunOptions(
        order=order,
        fraction=fraction,
        limit=limit,
        rate=rate,
        batch_size=batch_size,
        shard_size=shard_size,
        seed=seed,
        progress=not as_json,
        seal_rows=seal_rows,
        part=my_part,
        seal_queries=seal_queries,
        seal_queries_kind="served" if probes is None else probes.kind,
    )
    target = segment if column is None else column.target(add_column)
    report = run_backfill(target, source, encoder, identity, gallery_ref, options, hot=hot)
    summary = describe_report(report, gallery_ref.ntotal)
    if as_json:
        typer.echo(json.dumps(summary))
        return
    from service.segment.catalog import moved_ids

    # Read from the segment: other writers may have moved items meanwhile.
    now = len(moved_ids(segment)) if column is None else column.moved()
    unit = "shard(s)" if column is None else "transaction(s)"
    typer.echo(
        f"moved {report.moved:,} items into {column.where if column else segment} in {len(report.shards)} "
        f"{unit}, {summary['seconds']} s "
        f"({summary['items_per_s']} items/s); the segment holds {now:,} of {gallery_ref.ntotal:,} "
        f"({now / gallery_ref.ntotal:.1%})"
        + (f"; {report.zero_rows} all-zero rows stay old" if report.zero_rows else "")
        + (f" (this run: part {options.part})" if options.part is not None else "")
    )
    if summary["sealed"]:
        sealed = summary["sealed"]
        typer.echo(f"sealed {sealed['rows']:,} rows of {sealed['shards']} shard(s){_taking_in(sealed['absorbed'])} "
                   f"into index {sealed['index']} in {sealed['seconds']} s, searched at ef {sealed['ef_search']} "
                   f"(recall@10 {sealed['recall']:.3f} of exact on {sealed['probes']}); the service serves it from its "
                   "next refresh")  # fmt: skip
    elif probes is not None and not report.interrupted:  # the queries were read for a seal that did not happen
        left = "" if report.sealed is None else f"{report.sealed.rows:,} rows no index covers, fewer than "
        typer.echo(
            f"not sealed ({left}--seal-rows {seal_rows:,}), so --probe-queries measured nothing; "
            f"`nobackfill backfill index {segment} --probe-queries {probe_queries}` seals them now"
        )
    if report.interrupted:
        typer.echo(
            f"stopped by {report.interrupted}: what was encoded is kept; run the same command again to continue",
            err=True,
        )
        raise typer.Exit(143 if report.interrupted == "SIGTERM" else 130)


def _store_segment(segment: Path) -> Any:
    """The store face `--segment` names (commands/store_segment.py), or None for a folder."""
    from service.commands.store_segment import store_segment

    return store_segment(str(segment))


def _need_a_model_reference(segment: Path, profile: Path | None, new_model_id: str | None) -> None:
    """Refuse a run that nothing could check the new model against (no profile, no segment, no confirmation)."""
    from service.errors import InputError
    from service.segment.layout import SEGMENT_JSON

    if profile is None and new_model_id is None and not (segment / SEGMENT_JSON).is_file():
        raise InputError(
            f"{segment}: no segment yet and no --profile: nothing says which model its rows must come from; "
            "pass --profile PROFILE_DIR (the profile's new model is checked), or --new-model-id ID to confirm the model"
        )


def _refuse_an_artifact_as_items(input_path: Path) -> None:
    """--input given a gallery or a segment folder: say so, not that a folder of image files needs --modality image."""
    from service.errors import InputError
    from service.segment.layout import SEGMENT_JSON

    for marker, what in (("gallery.json", "a gallery"), (SEGMENT_JSON, "a segment")):
        if (input_path / marker).is_file():
            raise InputError(
                f"--input {input_path} is {what} ({marker}), not the gallery's items: give their item store "
                "(`encode --items-out`, `synth items`), or the file / image folder `encode` reads"
            )


def _gallery_ref(segment: Path, gallery: Path | None, source: Any) -> Any:
    """The frozen gallery the segment sits beside: from --gallery (checked against the items), else segment.json."""
    from service.errors import InputError
    from service.index.artifact import read_checked_meta
    from service.segment.layout import SEGMENT_JSON, GalleryRef, read_segment_meta

    if gallery is None:
        if not (segment / SEGMENT_JSON).is_file():
            raise InputError(f"{segment}: no segment yet; pass --gallery GALLERY_DIR to create it beside that gallery")
        return read_segment_meta(segment).gallery
    meta = read_checked_meta(gallery)
    recorded = meta.get("items")
    if recorded is not None and source.identity is not None and source.identity.as_dict() != recorded:
        raise InputError(
            f"{source.where} is item store {source.identity.sha256[:12]}... ({source.identity.count:,} items), but "
            f"gallery {gallery} was built from {str(recorded.get('sha256'))[:12]}... ({recorded.get('count')} items)"
        )
    return GalleryRef(str(meta["sha256"]), int(meta["ntotal"]))


def _hot_ids(hits: str | None) -> Any:
    """The hit counts' ids, hottest first, from --hits or the service's settings; InputError when there are none."""
    from service.errors import InputError
    from service.traffic.hits import read_hits

    ids, _ = read_hits(hits)
    if not len(ids):
        raise InputError("--order hot: no hit counts yet (the service counts them while it serves)")
    return ids


def _check_profile(profile_dir: Path, identity: Any) -> None:
    """Refuse a new model other than the profile's, in one line."""
    from service.compat.profile import load_profile
    from service.encoders.identity import ModelIdentity
    from service.errors import InputError

    profile = load_profile(profile_dir)
    recorded = (profile.models or {}).get("new")
    theirs = (
        ModelIdentity.from_dict(recorded, f"{profile_dir} (new model)")
        if recorded
        else ModelIdentity(identity.backend, profile.new_model_id, None, profile.new_dim)
    )
    if not theirs.same_model(identity):
        raise InputError(
            f"the new model is {render.model_name(identity.backend, identity.model_id)} (dim {identity.dim}, "
            "fingerprint "
            f"{(identity.fingerprint or 'none')[:12]}), but profile {profile.profile_id} was fitted for "
            f"{theirs.model_id} (dim {theirs.dim}, fingerprint {(theirs.fingerprint or 'none')[:12]}); "
            "backfill with the profile's new model"
        )


@app.command("status")
def status(
    segment: Path = _segment_argument("Segment folder, " + IN_STORES),
    hits: str | None = typer.Option(
        None,
        "--hits",
        help="The service's hit counts, a folder (its traffic.hits_dir) or a redis:// URL.",
        show_default=str(HITS_FOLDER),
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """Share of items moved, share of recent hits on moved items, and the shards with their models."""
    from service.errors import InputError

    column = _store_segment(segment)
    if column is None and not segment.is_dir():  # said before the heavy imports, not as "no segment.json"
        raise InputError(f"{segment}: no such folder (`backfill run --segment {segment} --gallery ...` creates it)")
    from service.backfill.status import segment_status
    from service.segment.writer import WRITER as CASCADE_WRITER
    from service.traffic.hits import read_hits

    counts = read_hits(hits, missing_ok=True)
    known = counts if len(counts[0]) else None
    report = segment_status(segment, known) if column is None else column.status(known)
    if as_json:
        typer.echo(json.dumps(report))
        return
    model = report["model"]
    where = segment if column is None else column.where
    typer.echo(f"segment {where}: {render.model_name(model['backend'], model['model_id'])} (dim {model['dim']})")
    held = (
        f"in {len(report['shards'])} shard(s)"
        if column is None
        else f"(index on the {column.noun}: {report['index'] or 'none, searched exactly; `backfill index` builds one'})"
    )
    typer.echo(
        f"  moved {report['moved']:,} of {report['gallery']['ntotal']:,} items ({report['coverage']:.1%}) {held}"
        + (f", {report['damaged_shards']} damaged" if report["damaged_shards"] else "")
    )
    by_writer = report["moved_by_writer"]
    if by_writer:
        parts = ", ".join(f"{writer} {count:,}" for writer, count in by_writer.items())
        legend = f" ({CASCADE_WRITER}: traffic, through the re-rank cascade)" if CASCADE_WRITER in by_writer else ""
        typer.echo(f"  moved by: {parts}{legend}")
    share = report.get("hits", {}).get("share_on_moved")
    typer.echo(
        "  recent hits on moved items: "
        + (f"{share:.1%} of the counted hits" if share is not None else "none counted (the service counts them)")
    )
    for sealed in report.get("sealed_indexes", []):  # (folder segments: a store's index is its own)
        typer.echo(
            f"  sealed index {sealed['name']}: {sealed['rows']:,} rows, searched at ef {sealed['ef_search']} "
            f"(its seal's measurement on {sealed['width_probes']}; NOBACKFILL_INDEX__SEGMENT_EF_SEARCH overrides it)"
        )
    for shard in report["shards"]:
        if "damaged" in shard:
            typer.echo(f"  {shard['name']}: DAMAGED ({shard['damaged']})")
        else:
            typer.echo(
                f"  {shard['name']}: {shard['count']:,} rows, "
                f"{render.model_name(str(shard['model'].get('backend')), str(shard['model'].get('model_id')))}, "
                f"by {shard['writer']}, {shard['created_at']}"
            )
    if report["damaged_shards"]:
        typer.echo(
            f"{report['damaged_shards']} damaged shard(s): their items count as not moved. "
            f"`nobackfill backfill repair {segment}` moves them into the quarantine folder; "
            "then `backfill run` moves those items again",
            err=True,
        )
        raise typer.Exit(1)


@app.command("index")
def index(
    segment: Path = _segment_argument("Segment folder, " + IN_STORES),
    m: int = typer.Option(16, "--m", min=2, help="pgvector:COLUMN: the HNSW index's m (pgvector's default)."),
    ef_construction: int = typer.Option(
        64, "--ef-construction", min=4, help="pgvector:COLUMN: its ef_construction (pgvector's default)."
    ),
    probe_queries: Path | None = typer.Option(
        None,
        "--probe-queries",
        help="A traffic export or support folder: the seal measures its index's search width on these new-model "
        "queries (recall@10 0.99 of exact) instead of on its own rows.",
    ),
) -> None:
    """Seal the rows no index covers into one HNSW index stored in the segment (every reader then serves it).

    For pgvector:COLUMN: CREATE INDEX CONCURRENTLY on the column (HNSW, inner product), never implicitly.
    """
    column = _store_segment(segment)
    if column is not None:  # pgvector builds an index on the column; Qdrant and Milvus index by themselves
        _probe_queries(probe_queries, in_store=True)
        typer.echo(column.index(m, ef_construction))
        return
    from service.segment.layout import read_segment_meta
    from service.segment.sealed import seal

    meta = read_segment_meta(segment)  # one line when the folder is no segment
    probes = _probe_queries(probe_queries, in_store=False)
    queries = _probe_rows(probes, meta.model)
    # Beside a running backfill: it seals what is published.
    kind = "served" if probes is None else probes.kind
    done = seal(segment, min_rows=1, writer="backfill index", queries=queries, queries_kind=kind)
    if done.name is None:
        typer.echo(f"segment {segment}: every intact shard is in a sealed index already; nothing to seal")
        return
    typer.echo(
        f"sealed {done.rows:,} rows of {done.shards} shard(s){_taking_in(done.absorbed)} into index {done.name} "
        f"in {done.seconds:.1f} s, searched at ef {done.ef_search} (recall@10 {done.recall:.3f} of exact on "
        f"{done.probes}); the service serves it from its next refresh"
    )


@dataclass(frozen=True)
class Probes:
    """--probe-queries as read: the folder's query pairs, and what they are ("served": a traffic export's)."""

    pairs: QueryPairs
    kind: str


def _probe_queries(folder: Path | None, in_store: bool) -> Probes | None:
    """--probe-queries read (None without it); one line, naming the flag, when the segment is in a store (its
    index is the store's own), the folder is no query folder, or it holds fewer than MIN_PROBE_QUERIES."""
    if folder is None:
        return None
    from service.compat.io import load_query_pairs
    from service.encoders.identity import MODELS_JSON
    from service.errors import ArtifactError, InputError

    if in_store:
        raise InputError(
            "--probe-queries measures a sealed index's width: only a segment folder seals one (a store's "
            "segment is indexed by the store)"
        )
    try:
        pairs = load_query_pairs(folder)
        described = json.loads((folder / MODELS_JSON).read_text()) if (folder / MODELS_JSON).is_file() else {}
    except (InputError, ArtifactError, ValueError) as exc:
        raise InputError(f"--probe-queries {folder}: {exc} (a `traffic export --out` or support folder)") from exc
    if len(pairs.new) < MIN_PROBE_QUERIES:
        raise InputError(
            f"--probe-queries {folder}: {len(pairs.new)} queries (all-zero rows left out); a recall of 0.99 needs "
            f"at least {MIN_PROBE_QUERIES} to be measured"
        )
    source = described.get("source") if isinstance(described, dict) else None
    return Probes(pairs, "served" if source == "traffic" else "support")


def _probe_rows(probes: Probes | None, model: ModelIdentity) -> F32 | None:
    """The new-model query rows of --probe-queries, refused in one line unless the segment's model made them."""
    if probes is None:
        return None
    from service.errors import InputError

    pairs = probes.pairs

    if pairs.new_model is not None and pairs.new_model.model_id != model.model_id:
        raise InputError(
            f"--probe-queries {pairs.path}: its new-model queries are {pairs.new_model.model_id}'s, but the "
            f"segment's rows are {model.model_id}'s"
        )
    if pairs.new.shape[1] != model.dim:
        raise InputError(
            f"--probe-queries {pairs.path}: {pairs.new.shape[1]}-d new-model queries, but the segment's rows are "
            f"{model.dim}-d"
        )
    return pairs.new


def _taking_in(absorbed: int) -> str:
    """The seal line's note of the smaller indexes a seal rebuilt into its own (sealed.py says why)."""
    return f", taking in {absorbed} smaller index{'es' if absorbed > 1 else ''}" if absorbed else ""


@app.command("cutover")
def cutover(
    segment: Path = _segment_argument(IN_STORES + " (a segment folder is cut over by serving it alone)"),
    how: str = typer.Option("view", "--how", help="view (a view reads the new column under the old name) or rename."),
    view: str | None = typer.Option(None, "--view", help="--how view: the view's name.", show_default="TABLE_COLUMN"),
    apply: bool = typer.Option(False, "--apply", help="Run the statements (one transaction); else print them."),
    alias: str | None = typer.Option(
        None,
        "--alias",
        help="qdrant-collection:NAME, milvus-collection:NAME: the alias to create on it.",
        show_default="COLLECTION_current",
    ),
) -> None:
    """Print (or --apply) what makes your application read the new rows natively: SQL, or an alias call."""
    from service.errors import InputError

    column = _store_segment(segment)
    if column is None:
        raise InputError(
            f"{segment}: a segment folder is cut over by serving it alone (NOBACKFILL_OLD__BACKEND=none, "
            "docs/backfill.md); `backfill cutover` writes a pgvector table's SQL (pgvector:COLUMN)"
        )
    for line in column.cutover(apply, how, view, alias):
        typer.echo(line)


@app.command("repair")
def repair(segment: Path = _segment_argument("Segment folder.")) -> None:
    """Move the shards the service refuses (damaged) into SEGMENT/quarantine, never deleting one."""
    from service.backfill.repair import QUARANTINE, repair_segment

    done = repair_segment(segment)
    if not done.quarantined:
        typer.echo(f"segment {segment}: every shard is intact; nothing to repair")
        return
    for name, reason in done.quarantined.items():
        typer.echo(f"  quarantined {name} ({reason})")
    unknown = f" (and {done.unknown_rows} shard(s) whose count is unreadable)" if done.unknown_rows else ""
    typer.echo(
        f"moved {len(done.quarantined)} shard(s) into {segment / QUARANTINE}: {done.rows:,} rows{unknown} "
        "count as not moved; run `nobackfill backfill run` again to move those items"
    )
    if done.indexes:
        typer.echo(f"  and {len(done.indexes)} sealed index(es) over them; the next seal covers their other shards")


# The offline scoring of a migration (no segment touched): commands/backfill_scoring.py.
app.command("curve")(curve)
app.command("cascade")(cascade)
