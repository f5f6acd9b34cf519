"""`nobackfill realworld corpus / texts` as a user runs them (subprocesses), on numpy's docstrings.

The extraction and cleaning in process: tests/unit/test_realdata.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from service.items.store import ItemStore
from service.realdata import layout
from tests.support.cli import cli, run_cli


def _read(folder: Path) -> dict[str, object]:
    return {
        "support": layout.read_jsonl(folder / layout.SUPPORT_JSONL),
        "test": layout.read_jsonl(folder / layout.TEST_JSONL),
        "gallery": layout.read_jsonl(folder / layout.GALLERY_JSONL),
        "lines": (folder / layout.GALLERY_TXT).read_text(encoding="utf-8").split("\n"),
        "ids": np.load(folder / layout.GALLERY_IDS),
        "meta": json.loads((folder / layout.CORPUS_JSON).read_text(encoding="utf-8")),
    }


def test_corpus_cli_writes_a_consistent_folder(tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    args = ("realworld", "corpus", "--packages", "numpy", "--support", "200", "--test", "100", "--distractors", "50")
    done = run_cli(*args, "--out", out)
    assert "numpy" in done.stdout and "200 support, 100 test, gallery of 150" in done.stdout
    files = _read(out)
    support, test, gallery = files["support"], files["test"], files["gallery"]
    assert isinstance(support, list) and isinstance(test, list) and isinstance(gallery, list)
    assert (len(support), len(test), len(gallery)) == (200, 100, 150)
    assert set(support[0]) == {"query", "target", "query_id", "target_id"}
    for key in ("query", "target"):
        assert not {r[key] for r in support} & {r[key] for r in test}
    gallery_ids = [r["id"] for r in gallery]
    assert len(set(gallery_ids)) == len(gallery_ids) and gallery_ids == sorted(gallery_ids)
    ids = files["ids"]
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.tolist() == gallery_ids
    by_id = {r["id"]: r["text"] for r in gallery}
    assert all(by_id[r["target_id"]] == r["target"] for r in test)  # every test target is in the gallery
    assert not {r["target"] for r in support} & set(by_id.values())
    assert files["lines"] == [r["text"] for r in gallery] + [""]  # one text per line, final newline
    meta = files["meta"]
    assert isinstance(meta, dict)
    assert meta["sizes"] == {
        "pairs": meta["packages"]["numpy"]["kept"],
        "support": 200,
        "test": 100,
        "distractors": 50,
        "gallery": 150,
    }
    assert meta["packages"]["numpy"]["version"] == np.__version__
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]  # no temporary sibling left behind

    # `realworld texts` turns a search answer's ids into these texts.
    answer = tmp_path / "answer.json"
    first = test[0]
    hit = {"ids": [first["target_id"], -7], "scores": [0.9, 0.1], "mode": "slerp", "alpha": 0.5, "cache": "miss"}
    answer.write_text(json.dumps({"results": [hit]}))
    shown = run_cli("realworld", "texts", "--corpus", out, "--input", answer, "--width", "1000").stdout
    assert first["target"] in shown and "(not in this corpus)" in shown and "mode slerp" in shown
    answer.write_text(json.dumps({"error": {"code": "not_ready", "message": "loading"}}))
    refused = run_cli("realworld", "texts", "--corpus", out, "--input", answer, check=False)
    assert refused.returncode == 2 and "not_ready" in refused.stderr
    answer.unlink()

    # `realworld items`: the item store of the gallery, keyed by the ids `gallery build --ids` gives its rows.
    done = cli("realworld", "items", "--corpus", out, "--out", tmp_path / "items")
    assert done.returncode == 0, done.stderr
    store = ItemStore.open(tmp_path / "items")
    assert store.count == len(gallery) and store.modality == "text"
    assert store.get_many(files["ids"]) == [r["text"] for r in gallery]
    assert store.get_many([first["target_id"]]) == [first["target"]]
    store.close()
    assert cli("realworld", "items", "--corpus", out, "--out", tmp_path / "items").returncode == 2  # no --force
    shutil.rmtree(tmp_path / "items")

    # Deterministic: the same arguments give byte-identical files.
    run_cli(*args, "--out", tmp_path / "again")
    for name in (layout.SUPPORT_JSONL, layout.TEST_JSONL, layout.GALLERY_JSONL, layout.GALLERY_TXT, layout.GALLERY_IDS):
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


def test_corpus_cli_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    args = ("realworld", "corpus", "--packages", "numpy", "--support", "20", "--test", "10", "--distractors", "5")
    run_cli(*args, "--out", out)
    refused = run_cli(*args, "--out", out, check=False)
    assert refused.returncode == 2 and "--force" in refused.stderr
    run_cli(*args, "--seed", "1", "--out", out, "--force")
    assert json.loads((out / layout.CORPUS_JSON).read_text())["seed"] == 1

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    refused = run_cli(*args, "--out", foreign, "--force", check=False)
    assert refused.returncode == 2 and "is not a corpus folder; refusing to overwrite it" in refused.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"

    too_many = run_cli(
        "realworld", "corpus", "--packages", "numpy", "--support", str(10**6), "--out", tmp_path / "x", check=False
    )
    assert too_many.returncode == 2 and "fewer than" in too_many.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "mine"]


def test_cli_lists_realworld() -> None:
    assert "realworld" in run_cli("--help").stdout
