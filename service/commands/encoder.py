"""`nobackfill encoder export`: a sentence-transformers model folder to the ONNX export runtime `onnx` serves.

Then serve it with NOBACKFILL_<ROLE>__RUNTIME=onnx and NOBACKFILL_<ROLE>__ONNX_DIR=OUT, the role's
path still naming MODEL_DIR (the model's identity is its weights'; docs/real-models.md).  The work is
service/encoders/onnx_export.py's; this module only parses and reports.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("export")
def export(
    model_dir: Path = typer.Argument(..., help="A local sentence-transformers model folder (a transformer model)."),
    out: Path = typer.Option(..., "--out", help="Folder to write model.onnx, its tokenizer, onnx.json, manifest.json."),
    int8: bool = typer.Option(
        False, "--int8", help="Quantise the weights to int8 (dynamic, per channel): faster on CPU, rows a little off."
    ),
    model_id: str | None = typer.Option(
        None, "--model-id", help="Model id to record (default: the folder's name; the runtime uses its own setting)."
    ),
    check_texts: Path | None = typer.Option(
        None, "--check-texts", help="Also compare the export with torch on these texts (one per line)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out folder."),
) -> None:
    """Export MODEL_DIR to ONNX (fp32, or int8 with --int8), checked against torch before it is written."""
    from service.encoders.onnx_export import export_model
    from service.errors import InputError

    extra: list[str] = []
    if check_texts is not None:
        try:
            extra = [line for line in check_texts.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--check-texts {check_texts}: unreadable ({exc})") from exc
    done = export_model(model_dir, out, int8=int8, model_id=model_id, check_texts=extra, force=force)
    check = done.check
    typer.echo(
        f"wrote {out}: {done.source.model_id} ({done.source.dim}-d) as {done.precision} ONNX, opset {done.opset}; "
        f"cosine to torch float32 over {int(check['texts'])} check texts: min {check['min_cosine']:.6f}, "
        f"mean {check['mean_cosine']:.6f}"
    )
