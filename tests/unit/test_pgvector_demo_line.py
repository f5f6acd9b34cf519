"""The settings `demo --pgvector` prints for `nobackfill serve`, pasted, serve what the demo serves."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from service.commands.serve import pgvector_serve_settings
from service.settings import CompatSettings, IndexSettings, Settings


def test_the_printed_settings_pasted_give_the_demos_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    demo = Settings(
        index=IndexSettings(
            backend="pgvector",
            pgvector_dsn=f"postgresql://postgres:@/postgres?host={tmp_path / 'pgvector'}",
            pgvector_table="demo_items",
            item_store=tmp_path / "items",
        ),
        compat=CompatSettings(profile_dir=tmp_path / "profile"),
    )
    for name in [n for n in os.environ if n.startswith("NOBACKFILL_")]:
        monkeypatch.delenv(name)
    for word in shlex.split(pgvector_serve_settings(demo)):  # as a shell reads the pasted line
        name, _, value = word.partition("=")
        monkeypatch.setenv(name, value)
    pasted = Settings()
    assert pasted.index == demo.index
    assert pasted.compat == demo.compat
