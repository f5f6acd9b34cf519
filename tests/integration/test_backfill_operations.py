"""`backfill run / status / repair` as an operator meets them: the model check, damaged shards, stops, two runs.

The synthetic world's gallery (real FAISS) and item store; every command through the CLI.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from service.backfill.run import one_run_at_a_time
from service.segment.catalog import moved_ids
from service.segment.layout import SHARDS, VECTORS, shard_names
from service.segment.reader import Segment
from service.segment.sealed import INDEX_JSON, INDEXES, QUERY_RECALL_TARGET, RECALL_TARGET, WIDTHS, sealed_names
from tests.support.cli import NOBACKFILL, cli
from tests.support.stores import items_fixture
from tests.support.world import WORLD_GALLERY_SIZE, World

items = items_fixture(WORLD_GALLERY_SIZE)  # the world gallery's item store (what backfill re-encodes)


def _run_args(world: World, items: Path, segment: Path, *extra: str | int | Path) -> list[str | int | Path]:
    return ["backfill", "run", "--segment", segment, "--input", items, "--gallery", world.gallery_dir, *extra]


def test_a_model_nothing_can_check_is_refused_before_it_loads(world: World, items: Path, tmp_path: Path) -> None:
    segment = tmp_path / "segment"
    done = cli(*_run_args(world, items, segment, "--backend", "synthetic-next", "--limit", 10))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "nothing says which model its rows must come from" in done.stderr and not segment.exists()
    wrong = cli(*_run_args(world, items, segment, "--backend", "synthetic-next", "--new-model-id", "synthetic-new"))
    assert wrong.returncode == 2 and "--new-model-id synthetic-new was confirmed" in wrong.stderr
    assert not segment.exists()


def test_a_confirmed_model_creates_the_segment_and_another_is_refused_there(
    world: World, items: Path, tmp_path: Path
) -> None:
    segment = tmp_path / "segment"
    first = cli(*_run_args(world, items, segment, "--backend", "synthetic-new", "--new-model-id", "synthetic-new",
                           "--limit", 40))  # fmt: skip
    assert first.returncode == 0, first.stderr
    # The segment now records the model: another one is refused with no flag at all, and with a profile.
    for extra in ((), ("--profile", world.profile_dir)):
        other = cli(*_run_args(world, items, segment, "--backend", "synthetic-next", "--limit", 10, *extra))
        assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert len(moved_ids(segment)) == 40


def test_a_damaged_shard_is_reported_quarantined_and_moved_again(world: World, items: Path, tmp_path: Path) -> None:
    segment = tmp_path / "segment"
    args = _run_args(world, items, segment, "--backend", "synthetic-new", "--profile", world.profile_dir)
    assert cli(*args, "--limit", 300, "--shard-size", 100, "--batch-size", 50).returncode == 0  # 3 shards of 100
    before = moved_ids(segment).tolist()
    damaged = shard_names(segment)[1]
    path = segment / SHARDS / damaged / VECTORS
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))

    status = cli("backfill", "status", segment)
    assert status.returncode == 1 and "moved 200 of" in status.stdout
    assert f"nobackfill backfill repair {segment}" in status.stderr

    repaired = cli("backfill", "repair", segment)
    assert repaired.returncode == 0, repaired.stderr
    assert "moved 1 shard(s)" in repaired.stdout and "100 rows count as not moved" in repaired.stdout
    assert (segment / "quarantine" / damaged / VECTORS).is_file() and damaged not in shard_names(segment)
    assert Segment.open(segment).refused == {}  # nothing left for the service to log at its start
    assert cli("backfill", "status", segment).returncode == 0

    again = cli(*args, "--limit", 100)
    assert again.returncode == 0, again.stderr
    assert moved_ids(segment).tolist() == before  # the quarantined shard's items moved again
    assert cli("backfill", "repair", segment).stdout.startswith(f"segment {segment}: every shard is intact")


def test_a_second_run_on_one_segment_is_refused_in_one_line(world: World, items: Path, tmp_path: Path) -> None:
    segment = tmp_path / "segment"
    args = _run_args(world, items, segment, "--backend", "synthetic-new", "--profile", world.profile_dir)
    assert cli(*args, "--limit", 10).returncode == 0
    with one_run_at_a_time(segment):  # as a run in another process holds it
        second = cli(*args, "--limit", 10)
    assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr
    assert "a `backfill run` (pid " in second.stderr and "is moving items into it" in second.stderr
    assert len(moved_ids(segment)) == 10
    assert cli(*args, "--limit", 10).returncode == 0  # the lock went with its holder


def test_sigterm_keeps_what_was_encoded_and_exits_143(world: World, items: Path, tmp_path: Path) -> None:
    segment = tmp_path / "segment"
    args = _run_args(world, items, segment, "--backend", "synthetic-new", "--profile", world.profile_dir)
    # Throttled, so the run is still going when the first shard has landed.
    run = subprocess.Popen(
        [*NOBACKFILL, *map(str, [*args, "--limit", 5000, "--rate", 400, "--shard-size", 50, "--batch-size", 25])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not shard_names(segment):  # a condition, however slow the box: the first shard is published
            assert run.poll() is None, run.communicate()
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 143, err
    assert "stopped by SIGTERM: what was encoded is kept" in err
    kept = moved_ids(segment)
    assert 0 < len(kept) < 5000 and np.array_equal(kept, np.arange(len(kept)))  # given order, nothing partial
    assert cli("backfill", "status", segment).returncode == 0  # every published shard intact
    rest = cli(*args, "--limit", 5000 - len(kept))
    assert rest.returncode == 0 and moved_ids(segment).tolist() == list(range(5000))


def test_a_run_seals_at_its_end_and_backfill_index_seals_on_demand(world: World, items: Path, tmp_path: Path) -> None:
    segment = tmp_path / "segment"
    args = _run_args(world, items, segment, "--backend", "synthetic-new", "--profile", world.profile_dir)
    below = cli(*args, "--limit", 300, "--seal-rows", 500, "--json")
    assert below.returncode == 0 and json.loads(below.stdout)["sealed"] is None  # 300 rows: below the minimum
    at = cli(*args, "--limit", 300, "--seal-rows", 500, "--json")
    sealed = json.loads(at.stdout)["sealed"]
    assert sealed["rows"] == 600 and sealed["shards"] == 2 and sealed_names(segment) == [sealed["index"]]
    assert cli(*args, "--limit", 50, "--seal-rows", 0).returncode == 0
    on_demand = cli("backfill", "index", segment)
    assert on_demand.returncode == 0 and "sealed 50 rows of 1 shard(s)" in on_demand.stdout
    again = cli("backfill", "index", segment)
    assert "nothing to seal" in again.stdout and len(sealed_names(segment)) == 2
    served = Segment.open(segment)
    assert served.snapshot.sealed_blocks == 2 and served.describe()["sealed_rows"] == 650
    # Each seal's measured width, as the run's summary, the reader and `backfill status` say it.
    assert sealed["ef_search"] in WIDTHS and sealed["recall"] >= RECALL_TARGET
    assert "searched at ef " in on_demand.stdout and "(recall@10 " in on_demand.stdout
    status = json.loads(cli("backfill", "status", segment, "--json").stdout)["sealed_indexes"]
    assert {s["name"]: s["ef_search"] for s in status} == served.describe()["sealed_ef_search"]
    assert sorted(s["rows"] for s in status) == [50, 600]
    assert f"sealed index {sealed['index']}: 600 rows, searched at ef" in cli("backfill", "status", segment).stdout


def test_given_served_queries_a_seal_measures_its_width_on_them(world: World, items: Path, tmp_path: Path) -> None:
    """--probe-queries: the world's support queries (a folder as `traffic export` writes one) are what the seals of
    `backfill run` and `backfill index` measure their width on; another model's queries are refused in one line."""
    segment = tmp_path / "segment"
    args = _run_args(world, items, segment, "--backend", "synthetic-new", "--profile", world.profile_dir)
    unsealed = cli(*args, "--limit", 100, "--seal-rows", 500, "--probe-queries", world.support_dir)
    assert unsealed.returncode == 0, unsealed.stderr  # below --seal-rows: it says what the flag did not do
    assert "not sealed (100 rows no index covers, fewer than --seal-rows 500), so --probe-queries measured" in (
        unsealed.stdout
    )
    few = tmp_path / "few"
    few.mkdir()
    for name in ("old_query.npy", "new_query.npy", "models.json"):
        shutil.copy(world.support_dir / name, few / name)
    for name in ("old_query.npy", "new_query.npy"):
        np.save(few / name, np.load(few / name)[:99])
    refused = cli(*args, "--limit", 10, "--probe-queries", few)
    assert refused.returncode == 2 and "99 queries (all-zero rows left out); a recall of 0.99 needs" in refused.stderr
    missing = cli("backfill", "index", segment, "--probe-queries", tmp_path / "nowhere")
    assert missing.returncode == 2 and missing.stderr.startswith(f"error: --probe-queries {tmp_path / 'nowhere'}:")
    done = cli(*args, "--limit", 500, "--seal-rows", 500, "--probe-queries", world.support_dir, "--json")
    assert done.returncode == 0, done.stderr
    sealed = json.loads(done.stdout)["sealed"]
    assert sealed["probes"] == "400 support queries" and sealed["recall"] >= QUERY_RECALL_TARGET
    recorded = json.loads((segment / INDEXES / sealed["index"] / INDEX_JSON).read_text())
    assert recorded["width_probes"] == "400 support queries" and recorded["ef_search"] == sealed["ef_search"]
    foreign = tmp_path / "foreign"
    shutil.copytree(world.support_dir, foreign)
    models_text = (foreign / "models.json").read_text()
    models = json.loads(models_text)
    models["new"]["model_id"] = "someone-elses-model"
    (foreign / "models.json").write_text(json.dumps(models))
    assert cli(*args, "--limit", 50, "--seal-rows", 0).returncode == 0
    refused = cli("backfill", "index", segment, "--probe-queries", foreign)
    assert refused.returncode == 2 and "queries are someone-elses-model's, but the segment's rows are" in refused.stderr
    assert len(sealed_names(segment)) == 1  # nothing sealed on the refusal
    narrow = tmp_path / "narrow"  # no models.json to name a model: the width of its rows is still checked
    narrow.mkdir()
    for name in ("old_query.npy", "new_query.npy"):
        np.save(narrow / name, np.load(world.support_dir / name)[:, :16])
    refused = cli("backfill", "index", segment, "--probe-queries", narrow)
    assert refused.returncode == 2 and "16-d new-model queries, but the segment's rows are" in refused.stderr
    served = tmp_path / "served"  # the same queries as `traffic export` writes them: its models.json says so
    shutil.copytree(world.support_dir, served)
    (served / "models.json").write_text(json.dumps(json.loads(models_text) | {"source": "traffic"}))
    on_demand = cli("backfill", "index", segment, "--probe-queries", served)
    assert on_demand.returncode == 0 and "of exact on 400 served queries)" in on_demand.stdout
    status = json.loads(cli("backfill", "status", segment, "--json").stdout)["sealed_indexes"]
    assert sorted(s["width_probes"] for s in status) == ["400 served queries", "400 support queries"]
    assert "(its seal's measurement on 400 support queries;" in cli("backfill", "status", segment).stdout
