"""The CLI's lines a newcomer misread (issue 48): each says what is there, once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service.backfill import status as backfill_status
from service.cli import app
from service.errors import InputError


def invoke(*args: str | Path) -> Any:
    """Run the CLI in process; the result (its exception, when a NobackfillError refused the call)."""
    return CliRunner().invoke(app, [str(arg) for arg in args])


def refusal(*args: str | Path) -> str:
    """The one `error:` line a refused call prints (the message of its InputError)."""
    done = invoke(*args)
    assert isinstance(done.exception, InputError), done.output
    return done.exception.message


def test_status_of_a_missing_folder_says_there_is_no_such_folder(tmp_path: Path) -> None:
    message = refusal("backfill", "status", tmp_path / "nowhere")
    assert message.startswith(f"{tmp_path / 'nowhere'}: no such folder")
    assert "segment.json" not in message


def test_a_gallery_given_as_input_is_called_a_gallery(tmp_path: Path) -> None:
    gallery = tmp_path / "gallery"
    gallery.mkdir()
    (gallery / "gallery.json").write_text("{}")
    message = refusal(
        "backfill", "run", "--segment", tmp_path / "segment", "--input", gallery, "--gallery", gallery,
        "--backend", "synthetic-new", "--new-model-id", "synthetic-new",
    )  # fmt: skip
    assert f"--input {gallery} is a gallery (gallery.json)" in message
    assert "--modality image" not in message


def status_report(writers: dict[str, int]) -> dict[str, Any]:
    """What segment_status reports for a small healthy segment moved by `writers`."""
    model = {"backend": "synthetic-new", "model_id": "synthetic-new", "dim": 768}
    return {
        "model": model,
        "moved": sum(writers.values()),
        "gallery": {"ntotal": 1000},
        "coverage": sum(writers.values()) / 1000,
        "shards": [
            {"name": "s1", "count": count, "model": model, "writer": writer, "created_at": "2026-12-07T02:46:21Z"}
            for writer, count in writers.items()
        ],
        "damaged_shards": 0,
        "moved_by_writer": writers,
        "hits": {},
    }


@pytest.mark.parametrize(
    ("writers", "legend"), [({"backfill run": 100}, False), ({"backfill run": 100, "service-cascade": 5}, True)]
)
def test_status_names_the_model_once_and_explains_only_the_writers_it_shows(
    writers: dict[str, int], legend: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backfill_status, "segment_status", lambda *_: status_report(writers))
    done = invoke("backfill", "status", tmp_path, "--hits", tmp_path / "no-hits")
    assert done.exit_code == 0, done.output
    assert f"segment {tmp_path}: synthetic-new (dim 768)" in done.output
    assert "s1: 100 rows, synthetic-new, by backfill run" in done.output  # each shard names it once too
    assert "synthetic-new synthetic-new" not in done.output
    assert ("through the re-rank cascade" in done.output) == legend


def test_synth_items_does_not_call_a_text_item_store_an_image_view(tmp_path: Path) -> None:
    done = invoke("synth", "items", "--size", "3", "--out", tmp_path / "items")
    assert done.exit_code == 0, done.output
    assert "image view" not in done.output
    assert "3 synthetic items, as the texts the synthetic models read ('item-0000000000 image' ...)" in done.output
