"""The `nobackfill` command line: wires the command groups and renders errors as one line, exit 2."""

from __future__ import annotations

import sys

import typer

import service
from service.commands import (
    assess,
    backfill,
    encode,
    encoder,
    fit,
    gallery,
    profile,
    realworld,
    serve,
    settings_reference,
    synth,
    traffic,
)
from service.errors import NobackfillError

# The click exceptions typer raises: its own vendored copy in typer >= 0.22, click itself before.
CLICK = sys.modules[typer.BadParameter.__module__]

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
profile_app = typer.Typer(no_args_is_help=True, help="Inspect compatibility profiles.")

app.command("fit")(fit.fit)
app.command("eval")(fit.evaluate)
app.command("assess")(assess.assess)
profile_app.command("show")(profile.profile_show)
profile_app.command("compare")(profile.profile_compare)
app.add_typer(profile_app, name="profile")
app.add_typer(gallery.app, name="gallery", help="Build, inspect and evaluate frozen IVF-PQ galleries.")
app.add_typer(synth.app, name="synth", help="Write support / test sets from the synthetic upgrade world.")
app.add_typer(realworld.app, name="realworld", help="Build the real upgrade's corpus and models (offline).")
app.command("serve")(serve.serve)
app.command("demo")(serve.demo)
app.command("settings")(settings_reference.settings)
app.command("encode")(encode.encode)
app.add_typer(encode.support_app, name="support", help="Build support sets for `fit` from your own pairs and models.")
app.add_typer(traffic.app, name="traffic", help="Export the (old, new) query pairs sampled from live traffic.")
app.add_typer(
    encoder.app, name="encoder", help="Export a sentence-transformers model to ONNX for the `onnx` runtime (CPU)."
)
app.add_typer(
    backfill.app, name="backfill", help="Move gallery items into the new-model segment, and score a migration offline."
)


def _print_version(asked: bool) -> None:
    """`--version`: the package version, then exit."""
    if asked:
        typer.echo(f"nobackfill {service.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version."),
) -> None:
    """nobackfill: upgrade a retrieval system's embedding model without re-encoding its gallery."""


def main() -> None:
    """Console entry point: run the CLI; our errors and click's usage errors alike are one `error: ...` line."""
    try:
        code = app(standalone_mode=False)
    except NobackfillError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        sys.exit(2)
    except CLICK.NoArgsIsHelpError as exc:  # `nobackfill gallery` alone: its help, as before
        exc.show()
        sys.exit(exc.exit_code)
    except CLICK.ClickException as exc:  # a missing or misspelt option: typer would draw a box around it
        command = exc.ctx.command_path if isinstance(exc, CLICK.UsageError) and exc.ctx else "nobackfill"
        typer.echo(f"error: {exc.format_message()} (see `{command} --help`)", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
