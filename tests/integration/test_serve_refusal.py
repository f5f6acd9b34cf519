"""`nobackfill serve` refuses settings that can never work before anything starts: exit 2, one line, no process left.

The checks themselves (Settings() under env vars and the YAML file) are tests/unit/test_settings.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests.support.servers import free_port


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NOBACKFILL_ setting of the test runner's own environment leaks into these tests."""
    for name in list(os.environ):
        if (name.upper().startswith("NOBACKFILL_") and "__" in name) or name == "NOBACKFILL_CONFIG_FILE":
            monkeypatch.delenv(name)


def _marked(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries `marker` (a serve started by the test, or anything it started)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("SERVE_REFUSAL_MARK") == marker:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"NOBACKFILL_INDEX__GALERY_DIR": "/srv/gallery"}, "NOBACKFILL_INDEX__GALERY_DIR"),
        ({"NOBACKFILL_API__MAX_IN_FLIGHT": "8"}, "NOBACKFILL_API__MAX_IN_FLIGHT=8"),
    ],
)
def test_serve_with_a_bad_setting_exits_2_in_one_line_and_starts_nothing(env: dict[str, str], named: str) -> None:
    port, marker = free_port(), uuid.uuid4().hex
    inherited = {k: v for k, v in os.environ.items() if not ("__" in k and k.upper().startswith("NOBACKFILL_"))}
    full_env = {
        **inherited,
        "SERVE_REFUSAL_MARK": marker,
        "NOBACKFILL_API__PORT": str(port),
        # Encoders in child processes: had the settings been taken, serve would start two of them.
        "NOBACKFILL_OLD__ISOLATION": "process",
        "NOBACKFILL_NEW__ISOLATION": "process",
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve"], env=full_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid settings: ") and named in lines[0], done.stderr
    assert done.stdout == ""
    assert _marked(marker) == []  # no uvicorn worker, no encoder child outlives the refusal
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens on its port


def test_serve_with_nothing_configured_names_the_variables_and_the_demo(tmp_path: Path) -> None:
    inherited = {k: v for k, v in os.environ.items() if not ("__" in k and k.upper().startswith("NOBACKFILL_"))}
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve"],
        env={**inherited, "NOBACKFILL_API__PORT": str(free_port())},
        cwd=tmp_path,  # a fresh folder: the default artifacts/gallery and artifacts/profile are not there
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "NOBACKFILL_INDEX__GALLERY_DIR=artifacts/gallery: no such folder" in lines[0]
    assert "NOBACKFILL_COMPAT__PROFILE_DIR=artifacts/profile: no such folder" in lines[0]
    assert "make demo" in lines[0] and "make serve" in lines[0]
