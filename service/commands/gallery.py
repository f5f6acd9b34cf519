"""`nobackfill gallery build|info|eval` — being written by helper-5 (see service/index/__init__.py)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)
