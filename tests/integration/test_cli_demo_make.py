"""`make demo PORT=N` hands the port to `nobackfill demo` (what the demo does with it: tests/unit/test_demo_port.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def demo_command(*make_args: str) -> str:
    """The `nobackfill demo` line `make demo` would run (make -n: printed, nothing run)."""
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), "demo", *make_args], capture_output=True, text=True, timeout=60, check=True
    )
    return next(line for line in done.stdout.splitlines() if "nobackfill demo" in line)


def test_make_demo_passes_its_port_to_the_demo() -> None:
    assert demo_command("PORT=8300").split()[-2:] == ["--port", "8300"]


def test_make_demo_without_a_port_leaves_it_to_the_settings() -> None:
    assert "--port" not in demo_command("PORT=")
