"""`assess`: every verdict is reachable, from ranks built for it and through the command on upgrades built for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from service.scoring.assess import VERDICTS, decide
from tests.support.cli import cli
from tests.support.upgrade_standin import make_world, write_split

N = 1000


def found_first(share: float) -> np.ndarray:
    """Ranks where the first `share` of the queries find their item first and the rest miss the top 10.

    Nested shares (each better search keeps what the worse one found, as an upgrade mostly does).
    """
    return np.where(np.arange(N) < round(share * N), 0, 50).astype(np.int64)


@pytest.mark.parametrize(
    ("old", "new", "bridge", "expected"),
    [
        (0.60, 0.605, 0.60, "no upgrade needed"),  # the new model gains under 2 points
        (0.60, 0.70, 0.69, "bridge suffices"),  # the bridge keeps ~99 % of the re-indexed R@10
        (0.60, 0.80, 0.66, "bridge now, backfill"),  # better than old, far from new
        (0.60, 0.80, 0.60, "re-index"),  # the bridge is the old system again
        (0.60, 0.80, 0.50, "re-index"),  # the bridge loses
    ],
)
def test_each_verdict_is_reached_by_the_case_built_for_it(old: float, new: float, bridge: float, expected: str) -> None:
    verdict, why, figures = decide(found_first(old), found_first(new), found_first(bridge), "slerp")
    assert verdict == expected, (why, figures)
    assert verdict in VERDICTS and why


def test_the_thresholds_move_the_verdict() -> None:
    old, new = found_first(0.6), found_first(0.7)
    assert decide(old, new, new.copy(), "slerp")[0] == "bridge suffices"
    assert decide(old, new, new.copy(), "slerp", min_gain=0.5)[0] == "no upgrade needed"
    assert decide(old, new, found_first(0.68), "slerp", min_retention=0.999)[0] == "bridge now, backfill"


def write_rotated(out: Path, source: Path, seed: int) -> Path:
    """A copy of a split whose new model is the old one turned by a random rotation: no gain at all."""
    shutil.copytree(source, out)
    old_q, old_t = np.load(source / "old_query.npy"), np.load(source / "old_target.npy")
    rotation, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((old_q.shape[1], old_q.shape[1])))
    np.save(out / "new_query.npy", (old_q @ rotation).astype(np.float32))
    np.save(out / "new_target.npy", (old_t @ rotation).astype(np.float32))
    models = json.loads((out / "models.json").read_text())
    models["new"]["dim"] = old_q.shape[1]
    (out / "models.json").write_text(json.dumps(models))
    return out


def test_the_command_says_no_upgrade_for_a_rotated_model_and_backfill_for_a_real_gain(
    tmp_path: Path, standin_test_split: Path
) -> None:
    support = write_split(tmp_path / "support", 1500, make_world(32, 48, 24), seed=1)
    done = cli("assess", support, standin_test_split, "--gallery-items", 100_000, "--rate", 500, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # R@10 is 0.99 for old->old here: the gain is at R@1 (0.72 -> 0.98), and the bridge keeps far less of that.
    assert result["gain@1"]["low"] > 0.2 and result["verdict"] == "bridge now, backfill", result["why"]
    assert result["backfill_cost"]["seconds"] == pytest.approx(200.0)
    rotated_support = write_rotated(tmp_path / "rotated-support", support, seed=3)
    rotated_test = write_rotated(tmp_path / "rotated-test", standin_test_split, seed=3)
    done = cli("assess", rotated_support, rotated_test, "--report", tmp_path / "report.md")
    assert done.returncode == 0, done.stderr
    assert "verdict: NO UPGRADE NEEDED" in done.stdout
    assert "# Upgrade assessment" in (tmp_path / "report.md").read_text()
    in_sample = cli("assess", rotated_support)
    assert in_sample.returncode == 0 and "in-sample" in in_sample.stderr
