"""The vocabulary: every word is complete where it is defined, and typer, pydantic and JSON all take it."""

from __future__ import annotations

import json

import pytest
import typer
from pydantic import BaseModel, ValidationError
from typer.testing import CliRunner

from service.vocabulary import (
    HEAD_FAMILY,
    HEAD_MODES,
    MODE_READS,
    Head,
    HeadFamily,
    Modality,
    Mode,
    heads_of,
)


def test_every_mode_says_what_it_reads_and_every_head_its_family_and_modes() -> None:
    assert set(MODE_READS) == set(Mode)
    assert set(HEAD_FAMILY) == set(Head) == set(HEAD_MODES)
    assert {head for family in HeadFamily for head in heads_of(family)} == set(Head)
    served = {mode for modes in HEAD_MODES.values() for mode in modes}
    # compare is the pipeline's, served with the head beside old; hybrid and new are served beside a segment,
    # cascade beside a segment or an item store
    assert served == set(Mode) - {Mode.compare, Mode.hybrid, Mode.new, Mode.cascade}


def test_reads_follow_from_the_table() -> None:
    assert Mode.old.reads_old and not Mode.old.reads_new and not Mode.old.blends
    assert Mode.aligned.reads_new and not Mode.aligned.reads_old
    assert Mode.slerp.blends and Mode.slerp.takes_alpha
    assert Mode.adapter_slerp.takes_alpha and not Mode.adapter.takes_alpha
    assert not Mode.psp.reads_old and Head.psp.family is HeadFamily.classes


def test_words_are_their_strings() -> None:
    assert Mode.adapter_slerp == "adapter+slerp" and "adapter+slerp" in {Mode.adapter_slerp}
    assert {"text": 1}[Modality.text] == 1
    assert f"{Mode.slerp}" == "slerp" and repr(Mode.slerp) == "'slerp'"
    assert json.dumps({Modality.image: Mode.lsp}) == '{"image": "lsp"}'
    assert Mode.has("compare") and not Mode.has("slerpy") and not Mode.has(3)


def test_pydantic_and_typer_take_the_words() -> None:
    class Body(BaseModel):
        mode: Mode

    assert Body(mode="adapter+slerp").mode is Mode.adapter_slerp  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Body(mode="slerpy")  # type: ignore[arg-type]

    app = typer.Typer()

    @app.command()
    def pick(head: Head = typer.Option(Head.slerp)) -> None:  # noqa: B008 (typer's API)
        typer.echo(f"{head.family}")

    runner = CliRunner()
    assert runner.invoke(app, ["--head", "adapter+slerp"]).output.strip() == "adapter"
    assert runner.invoke(app, ["--head", "nope"]).exit_code == 2
