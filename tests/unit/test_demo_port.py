"""`nobackfill demo` serves on --port, else on the settings' api.port (NOBACKFILL_API__PORT), else 8000.

The demo's artifacts are stand-in files (it only checks that they exist) and uvicorn is replaced by a
recorder, so nothing is built or served.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from service.commands import serve

PORT_ENV = "NOBACKFILL_API__PORT"


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The demo's artifacts as present (nothing to build); what `_run` would bind, recorded instead of served."""
    demo_dir = tmp_path / "demo"
    for name, text in {
        "gallery/gallery.json": json.dumps({"ntotal": 10}),
        "profile/profile.json": "{}",
        "items/items.json": "{}",
        "eval.json": "{}",
    }.items():
        (demo_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (demo_dir / name).write_text(text)
    monkeypatch.setattr(serve, "DEMO_DIR", demo_dir)
    monkeypatch.delenv(PORT_ENV, raising=False)
    bound: list[tuple[str, int]] = []

    def record(_settings: Any, host: str, port: int, _workers: int) -> None:
        bound.append((host, port))

    monkeypatch.setattr(serve, "_run", record)
    return bound


def demo(*args: str, env: dict[str, str] | None = None) -> str:
    """Run `demo` as the CLI would; its printed output."""
    app = typer.Typer()
    app.command()(serve.demo)
    done = CliRunner().invoke(app, list(args), env=env)
    assert done.exit_code == 0, done.output
    return done.output


def test_the_demo_serves_on_8000_when_nothing_names_a_port(served: list[tuple[str, int]]) -> None:
    output = demo()
    assert served == [("127.0.0.1", 8000)]
    assert "http://127.0.0.1:8000/v1/search" in output


def test_the_demo_serves_on_the_port_setting(served: list[tuple[str, int]]) -> None:
    output = demo(env={PORT_ENV: "8301"})
    assert served == [("127.0.0.1", 8301)]
    assert "http://127.0.0.1:8301/v1/search" in output
    assert "http://127.0.0.1:8301/ui/" in output


def test_the_port_option_wins_over_the_setting(served: list[tuple[str, int]]) -> None:
    demo("--port", "8302", env={PORT_ENV: "8301"})
    assert served == [("127.0.0.1", 8302)]
