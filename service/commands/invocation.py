"""How to run `nobackfill` from the user's shell, for the commands the CLI prints to be pasted."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def cli_invocation() -> str:
    """`nobackfill` when that name on PATH is this install, else this install's script (relative to the cwd)."""
    script = Path(sys.executable).parent / "nobackfill"  # the venv's console script, beside its python
    on_path = shutil.which("nobackfill")
    if on_path is not None and script.exists() and Path(on_path).resolve() == script.resolve():
        return "nobackfill"
    if not script.exists():  # run as `python -m service.cli` from a checkout without the script
        return f"{sys.executable} -m service.cli"
    try:
        return str(script.absolute().relative_to(Path.cwd()))  # .venv/bin/nobackfill after `make install`
    except ValueError:
        return str(script)
