"""The settings reference (`nobackfill settings`, docs/settings.md) is the settings model's, and says true things."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from service.commands.settings_reference import DOC_PATH, REGENERATE, Setting, as_markdown, as_text, reference
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [setting for section in reference() for setting in section.settings]
ENV_NAME = re.compile(r"NOBACKFILL_[A-Z0-9]+__[A-Z0-9_]+")


def test_docs_settings_md_is_the_models_reference() -> None:
    written = (ROOT / DOC_PATH).read_text(encoding="utf-8")
    assert written == as_markdown(reference()), f"{DOC_PATH} is not the settings model's: run `{REGENERATE}`"


def test_every_setting_has_one_line_of_meaning() -> None:
    assert len(SETTINGS) > 100  # every leaf of every section, old and new each in full
    for setting in SETTINGS:
        assert setting.meaning.strip(), f"{setting.env}: no docstring line under its field (settings/sections.py)"
        assert "\n" not in setting.meaning, setting.env


def value_at(settings: Settings, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(settings, section), name)


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.default != "unset"], ids=lambda s: s.env)
def test_each_variable_set_to_its_shown_default_gives_the_default(
    setting: Setting, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both the name and the default as printed must be what the service reads: a wrong env name would
    # be refused (no such setting), a wrong default would read back as another value.
    for name in [n for n in os.environ if n.startswith("NOBACKFILL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv(setting.env, setting.default)
    assert value_at(Settings(), setting.key) == value_at(Settings.model_construct(), setting.key)


def test_the_terminal_reference_names_every_setting_with_its_default() -> None:
    text = as_text(reference())
    for setting in SETTINGS:
        assert f"  {setting.env}  (" in text and f"default: {setting.default})" in text


@pytest.mark.parametrize("document", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_every_setting_a_document_names_exists(document: str) -> None:
    path = ROOT / document if document == "README.md" else ROOT / "docs" / document
    named = set(ENV_NAME.findall(path.read_text(encoding="utf-8")))
    assert named - {s.env for s in SETTINGS} == set(), f"{document} names settings the model does not have"
