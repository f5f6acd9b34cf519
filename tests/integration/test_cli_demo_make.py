"""`make demo PORT=N` hands the port to `nobackfill demo` (what the demo does with it: tests/unit/test_demo_port.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def demo_command(*make_args: str, target: str = "demo") -> str:
    """The `nobackfill demo` line `make demo` (or `target`) would run (make -n: printed, nothing run)."""
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, *make_args], capture_output=True, text=True, timeout=60, check=True
    )
    return next(line for line in done.stdout.splitlines() if "nobackfill demo" in line)


def test_make_demo_passes_its_port_to_the_demo() -> None:
    assert demo_command("PORT=8300").split()[-2:] == ["--port", "8300"]


def test_make_demo_without_a_port_leaves_it_to_the_settings() -> None:
    assert "--port" not in demo_command("PORT=")


def test_make_demo_pgvector_runs_the_table_demo_and_passes_its_port() -> None:
    assert demo_command("PORT=8300", target="demo-pgvector").split()[-3:] == ["--pgvector", "--port", "8300"]
    assert demo_command("PORT=", target="demo-pgvector").split()[-1] == "--pgvector"


def serve_environment(tmp_path: Path, *make_args: str, **env: str) -> dict[str, str]:
    """The NOBACKFILL_* variables `make serve` hands to `nobackfill serve`.

    Run in a copy of the Makefile over stand-in demo artifacts, with BIN pointing at a `nobackfill`
    that prints its environment instead of serving.
    """
    import os

    tmp_path.mkdir()
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").touch()  # newer than pyproject.toml: nothing is installed
    for name in ("artifacts/demo/profile/profile.json", "artifacts/demo/eval.json", "artifacts/demo/items/items.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    fake = tmp_path / "bin" / "nobackfill"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nenv | grep '^NOBACKFILL_' | sort\n")
    fake.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NOBACKFILL_")}
    done = subprocess.run(
        ["make", "-s", "-C", str(tmp_path), "serve", f"BIN={fake.parent}", *make_args],
        capture_output=True, text=True, timeout=60, check=True, env={**clean, **env},
    )  # fmt: skip
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if line.startswith("NOBACKFILL_"))


def test_make_serve_shows_the_demos_saved_eval_with_the_demos_profile_only(tmp_path: Path) -> None:
    demo = serve_environment(tmp_path / "demo")
    assert demo["NOBACKFILL_COMPAT__PROFILE_DIR"] == "artifacts/demo/profile"
    assert demo["NOBACKFILL_API__UI_EVAL"] == "artifacts/demo/eval.json"
    assert demo["NOBACKFILL_INDEX__ITEM_STORE"] == "artifacts/demo/items"
    other = serve_environment(tmp_path / "other", NOBACKFILL_COMPAT__PROFILE_DIR="elsewhere/profile")
    assert other["NOBACKFILL_COMPAT__PROFILE_DIR"] == "elsewhere/profile" and "NOBACKFILL_API__UI_EVAL" not in other


def test_make_serve_passes_its_port_and_leaves_the_setting_alone_without_one(tmp_path: Path) -> None:
    assert serve_environment(tmp_path / "port", "PORT=8300")["NOBACKFILL_API__PORT"] == "8300"
    assert serve_environment(tmp_path / "setting", NOBACKFILL_API__PORT="8301")["NOBACKFILL_API__PORT"] == "8301"
    assert "NOBACKFILL_API__PORT" not in serve_environment(tmp_path / "none")
