"""What `--help` tells a newcomer: where the settings are, every subcommand, the defaults of options left out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.commands import backfill
from service.commands.settings_reference import reference

BOX = re.compile(r"[│╭╮╰╯─]")


def shown(*args: str) -> str:
    """What the command prints, frames dropped and whitespace collapsed (rich wraps help to the terminal)."""
    done = CliRunner().invoke(app, list(args))
    assert done.exit_code == 0, done.output
    return " ".join(BOX.sub(" ", done.output).split())


def test_serve_help_points_at_the_settings_and_names_the_migrations() -> None:
    text = shown("serve", "--help")
    assert "`nobackfill settings`" in text and "docs/settings.md" in text
    for setting in ("NOBACKFILL_INDEX__SEGMENT_DIR", "NOBACKFILL_INDEX__ITEM_STORE", "NOBACKFILL_OLD__BACKEND=none"):
        assert setting in text


def test_backfill_help_lists_every_subcommand() -> None:
    text = shown("backfill", "--help")
    names = [command.name for command in backfill.app.registered_commands]
    assert "cascade" in names
    for name in names:
        assert re.search(rf"\b{name}\b", text), name


@pytest.mark.parametrize(
    ("option", "default"), [("--fraction", "every item"), ("--rate", "unthrottled"), ("--hits", "artifacts/hits")]
)
def test_backfill_run_shows_the_default_of_an_option_left_out(option: str, default: str) -> None:
    text = shown("backfill", "run", "--help")
    # The first default after the option's name and metavar: its own, when it shows one.
    found = re.search(rf"{option} <.*?\[default: \(([^)]*)\)\]", text)
    assert found is not None and found.group(1) == default


def test_the_settings_command_prints_every_setting() -> None:
    text = shown("settings")
    for section in reference():
        for setting in section.settings:
            assert setting.env in text


def test_backfill_run_refuses_fraction_with_limit_and_an_unknown_order_before_any_model_loads(tmp_path: Path) -> None:
    from tests.support.cli import cli

    # The model folder does not exist: had the model been loaded first, that would be the error.
    model = ["--backend", "sentence-transformers", "--path", tmp_path / "no-model", "--new-model-id", "x"]
    base = ["backfill", "run", "--segment", tmp_path / "seg", "--input", tmp_path / "items.txt", *model]
    both = cli(*base, "--fraction", "0.5", "--limit", "10")
    assert both.returncode == 2 and both.stderr.strip().endswith("give --fraction or --limit, not both")
    unknown = cli(*base, "--order", "hottest")
    assert unknown.returncode == 2 and "'hottest' is not one of 'given', 'random', 'hot'" in unknown.stderr
