"""`nobackfill encode` and `nobackfill support build`: raw inputs to embeddings with the service's own encoders.

Thin layers over service.bulk: cheap checks first (outputs, every input, images opened), then the
model loads and encodes chunk by chunk.  A bad input is one `error: FILE:LINE: ...` line and exit 2
unless --skip-bad; a failure or Ctrl-C leaves no output behind.
"""

from __future__ import annotations

from pathlib import Path

import typer

from service.vocabulary import Modality

support_app = typer.Typer(no_args_is_help=True)


def encode(
    backend: str = typer.Option(
        ..., "--backend", help="Encoder backend: sentence-transformers, clip, synthetic-old, ..."
    ),
    path: Path | None = typer.Option(None, "--path", help="Local model folder (none for the synthetic backends)."),
    input_path: Path = typer.Option(
        ..., "--input", help="Text file (one input per line), JSONL file (with --field), image folder or image list."
    ),
    out: Path = typer.Option(..., "--out", help="Embeddings .npy to write; OUT.json is written beside it."),
    modality: Modality = typer.Option(Modality.text, "--modality", help="text, or image (inputs are image files)."),
    field: str | None = typer.Option(None, "--field", help="JSONL: the key holding each input (implies JSONL)."),
    id_field: str | None = typer.Option(None, "--id-field", help="JSONL: an integer id per row, for --ids-out."),
    ids_out: Path | None = typer.Option(
        None,
        "--ids-out",
        help="Also write int64 ids per row: --id-field's, else the 0-based input line (not into a shard folder).",
    ),
    items_out: Path | None = typer.Option(
        None,
        "--items-out",
        help="Also write an item store (id -> input) for backfill, keyed as the gallery is (--ids-out, else the row).",
    ),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Inputs per encoder call."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda:0, ..."),
    fp16: bool = typer.Option(True, "--fp16/--no-fp16", help="Half precision on CUDA, as the service's setting."),
    cpu_bf16: bool = typer.Option(False, "--cpu-bf16", help="bfloat16 on CPU, as the service's cpu_bf16 setting."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="Torch CPU threads (default: all usable cores)."),
    onnx: Path | None = typer.Option(
        None,
        "--onnx",
        help="Run the model on ONNX Runtime (CPU): the folder `nobackfill encoder export` wrote from --path.",
    ),
    model_id: str | None = typer.Option(None, "--model-id", help="Model id to record (default: the folder's name)."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip bad inputs (listed in OUT.json) instead of failing."),
    force: bool = typer.Option(False, "--force", help="Replace an existing OUT.npy / OUT.json."),
) -> None:
    """Encode a file of inputs into OUT.npy (float32 unit rows) and OUT.json (model identity, count, skips)."""
    from service.bulk.encode import check_outputs, encode_file, load_encoder, write_items
    from service.bulk.inputs import input_spec, scan
    from service.commands import render
    from service.errors import InputError
    from service.items.store import check_output as check_items_output

    if id_field is not None and ids_out is None:
        raise InputError("--id-field names the ids to write: give --ids-out IDS.npy too")
    check_outputs(out, ids_out, force)
    if items_out is not None:
        check_items_output(items_out, force)
    spec = input_spec(input_path, modality, field, id_field)
    checked = scan(spec, skip_bad=skip_bad)
    if checked.skipped:
        typer.echo(f"skipping {len(checked.skipped)} bad input(s), first: {checked.skipped[0].message()}", err=True)
    encoder, identity = load_encoder(
        backend, path, device=device, model_id=model_id, fp16=fp16, cpu_bf16=cpu_bf16, threads=threads, onnx_dir=onnx
    )
    _warn_ignored_id(backend, model_id, identity.model_id)
    meta = encode_file(encoder, identity, spec, checked, out, ids_out=ids_out, batch_size=batch_size)
    model = render.model_name(identity.backend, identity.model_id)
    typer.echo(
        f"wrote {out}: {meta['count']:,} x {meta['dim']} float32 ({model}), "
        f"{meta['skipped']} skipped, {meta['blank_lines']} blank line(s) ignored, {meta['seconds']} s; "
        f"description in {out.with_suffix('.json')}"
    )
    if items_out is not None:
        stored = write_items(spec, checked, items_out, by_id=ids_out is not None, force=force)
        typer.echo(f"wrote item store {items_out}: {stored['count']:,} {stored['modality']} items")


@support_app.command("build")
def support_build(
    pairs_path: Path = typer.Option(..., "--pairs", help='JSONL rows {"query": ..., "target": ...}, ids optional.'),
    old_backend: str = typer.Option(..., "--old-backend", help="Backend of the old model (the gallery's)."),
    old_path: Path | None = typer.Option(None, "--old-path", help="Old model folder (none for synthetic backends)."),
    new_backend: str = typer.Option(..., "--new-backend", help="Backend of the new model."),
    new_path: Path | None = typer.Option(None, "--new-path", help="New model folder (none for synthetic backends)."),
    out: Path = typer.Option(..., "--out", help="Support folder to create (for `nobackfill fit`)."),
    modality: Modality = typer.Option(Modality.text, "--modality", help="Query modality."),
    target_modality: Modality | None = typer.Option(
        None, "--target-modality", help="Target (gallery) modality (default: --modality)."
    ),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Inputs per encoder call."),
    device: str = typer.Option("auto", "--device", help="auto (old cuda:0, new cuda:1 when there are two), cpu, ..."),
    fp16: bool = typer.Option(True, "--fp16/--no-fp16", help="Half precision on CUDA, as the service's setting."),
    cpu_bf16: bool = typer.Option(False, "--cpu-bf16", help="bfloat16 on CPU, as the service's cpu_bf16 setting."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="Torch CPU threads (default: all usable cores)."),
    old_model_id: str | None = typer.Option(None, "--old-model-id", help="Old model id (default: its folder's name)."),
    new_model_id: str | None = typer.Option(None, "--new-model-id", help="New model id (default: its folder's name)."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip bad rows (listed in models.json), not fail."),
    force: bool = typer.Option(False, "--force", help="Replace an existing support folder."),
) -> None:
    """Encode query / target pairs with the old and the new model into a support folder with models.json."""
    from service.bulk.pairs import read_pairs
    from service.bulk.support import EncodeOptions, ModelSource, build_support, check_support_out

    target = target_modality or modality
    check_support_out(out, force)
    pairs = read_pairs(pairs_path, modality, target, skip_bad=skip_bad)
    if pairs.skipped:
        typer.echo(f"skipping {len(pairs.skipped)} bad row(s), first: {pairs.skipped[0].message()}", err=True)
    if pairs.blank:
        typer.echo(f"ignoring {pairs.blank} blank line(s) in {pairs_path}", err=True)
    models = build_support(
        pairs,
        ModelSource(old_backend, old_path, old_model_id),
        ModelSource(new_backend, new_path, new_model_id),
        out,
        query_modality=modality,
        target_modality=target,
        options=EncodeOptions(device=device, batch_size=batch_size, fp16=fp16, cpu_bf16=cpu_bf16, threads=threads),
        log=lambda line: typer.echo(line, err=True),
    )
    for role, given in (("old", old_model_id), ("new", new_model_id)):
        _warn_ignored_id(models[role]["backend"], given, models[role]["model_id"])
    typer.echo(
        f"wrote {out}: {models['pairs']:,} queries, {models['targets']:,} targets, {models['skipped']} skipped; "
        f"old {models['old']['model_id']} ({models['old']['dim']}-d), new {models['new']['model_id']} "
        f"({models['new']['dim']}-d)"
    )


def _warn_ignored_id(backend: str, given: str | None, recorded: str) -> None:
    """Say so when a backend (the synthetic ones) keeps its own model id despite --model-id."""
    if given is not None and given != recorded:
        typer.echo(f"warning: backend {backend} ignores the given model id {given!r}; recorded {recorded!r}", err=True)
