"""`nobackfill gallery build|info|eval` — placeholder. helper-2 writes this; see service/index/LEAD_NOTE.md."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)
