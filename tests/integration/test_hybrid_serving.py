"""Hybrid search served beside a new-model segment that `backfill run` fills (the synthetic world, real FAISS).

The exactness the migration rests on: with nothing moved, hybrid answers what the compatible mode
answers, ids and scores; with everything moved, it answers what a re-indexed service would (the new
model over a gallery of new embeddings).  In between, shards published while the service runs are
searched within a refresh, and a damaged one is refused while the rest serves.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.errors import ArtifactError, SettingsError
from service.query.job import Query
from service.segment.layout import SHARDS, shard_names
from service.segment.reader import Segment
from service.segment.sealed import WIDTHS
from service.settings import ApiSettings, CompatSettings, EncoderSettings, IndexSettings, Settings
from service.vocabulary import Modality
from tests.support.app import Running, serving
from tests.support.cli import cli
from tests.support.stores import items_fixture
from tests.support.world import WORLD_GALLERY_SIZE, World

CAPTION = "item-{:010d} caption-1"
QUERY_ITEMS = [3, 77, 512, 1_999, 4_242, 9_001, 12_345, 19_998]


def settings_for(world: World, segment: Path | None, **index: Any) -> Settings:
    """The session's synthetic world, with the segment beside its gallery."""
    return Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=64, segment_dir=segment, **index),
        compat=CompatSettings(profile_dir=world.profile_dir),
    )


def queries() -> list[dict[str, str]]:
    return [{"text": CAPTION.format(i)} for i in QUERY_ITEMS]


items = items_fixture(WORLD_GALLERY_SIZE)  # the world gallery's item store (what backfill re-encodes)


def backfill(world: World, items: Path, segment: Path, *args: str | int) -> dict[str, Any]:
    """`nobackfill backfill run ... --json` with the synthetic new model beside the world's gallery; its summary."""
    return backfill_with(items, segment, world.gallery_dir, world.profile_dir, "synthetic-new", *args)


def backfill_with(
    items: Path, segment: Path, gallery: Path, profile: Path, backend: str, *args: str | int
) -> dict[str, Any]:
    """`nobackfill backfill run ... --json` with these gallery, profile and model; its summary."""
    done = cli(
        "backfill", "run", "--segment", segment, "--input", items, "--gallery", gallery,
        "--backend", backend, "--profile", profile, "--json", *args,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@pytest.fixture(scope="module")
def full_segment(world: World, items: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A segment holding every gallery item."""
    segment = tmp_path_factory.mktemp("full") / "segment"
    backfill(world, items, segment, "--fraction", 1.0, "--shard-size", 5_000)
    return segment


async def search(service: Running, mode: str, k: int = 10) -> list[dict[str, Any]]:
    response = await service.search(queries=queries(), k=k, mode=mode)
    assert response.status_code == 200, response.text
    return list(response.json()["results"])


async def in_chunks(service: Running, many: list[dict[str, str]], mode: str | None) -> list[dict[str, Any]]:
    """The results of `many` queries, asked 50 at a time (a request holds at most api.max_queries)."""
    results: list[dict[str, Any]] = []
    for start in range(0, len(many), 50):
        asked = {"mode": mode} if mode else {}
        response = await service.search(queries=many[start : start + 50], k=10, **asked)
        assert response.status_code == 200, response.text
        results += response.json()["results"]
    return results


async def test_at_zero_moved_hybrid_is_the_compatible_search(world: World, tmp_path: Path) -> None:
    async with serving(settings_for(world, tmp_path / "not-yet")) as service:
        info = (await service.client.get("/v1/info")).json()
        assert info["default_mode"] == "hybrid"
        assert {"hybrid", "new"} <= set(info["modes"])
        assert info["segment"]["created"] is False and info["segment"]["coverage"] == 0
        await search(service, "slerp")  # both requests then read the old queries from the cache alike
        hybrid, slerp = await search(service, "hybrid"), await search(service, "slerp")
        for h, s in zip(hybrid, slerp, strict=True):
            assert h["ids"] == s["ids"]
            assert h["scores"] == s["scores"]
            assert h["segment_hits"] == 0 and h["mode"] == "hybrid"
        default = (await service.search(queries=queries(), k=10)).json()["results"]
        assert [r["ids"] for r in default] == [r["ids"] for r in hybrid]
        assert {r["score_scale"] for r in hybrid} == {"old"}  # nothing moved: the gallery's own scores


async def test_at_all_moved_hybrid_is_the_reindexed_search(world: World, full_segment: Path) -> None:
    snapshot = Segment.open(full_segment).snapshot
    assert snapshot.count == WORLD_GALLERY_SIZE
    ids = np.concatenate([block.ids for block in snapshot.blocks])
    rows = np.concatenate([block.vectors() for block in snapshot.blocks])
    # The segment searched exactly, as the exact re-indexed service is: what its sealed HNSW index
    # loses against exact is the index's recall, measured in docs/backfill.md, not the merge's.
    exact = settings_for(world, full_segment, segment_exact=True)
    async with serving(exact) as service:
        hybrid, new = await search(service, "hybrid"), await search(service, "new")
        new_queries = service.pipeline.new.encoder.encode([CAPTION.format(i) for i in QUERY_ITEMS], "text")
        # The re-indexed service: the new queries against every item's new embedding, exactly.
        reindexed = ids[np.argsort(-(new_queries @ rows.T), axis=1, kind="stable")[:, :10]]
        for h, n, expected in zip(hybrid, new, reindexed.tolist(), strict=True):
            assert h["ids"] == n["ids"] == expected
            assert h["segment_hits"] == 10
        info = (await service.client.get("/v1/info")).json()
        assert info["segment"]["coverage"] == 1.0
        assert info["segment"]["shards"] == len(shard_names(full_segment))


async def test_shards_published_while_serving_are_searched_within_a_refresh(
    world: World, items: Path, tmp_path: Path
) -> None:
    segment = tmp_path / "segment"
    async with serving(settings_for(world, segment, segment_refresh_s=0.1)) as service:
        before = await search(service, "hybrid")
        assert all(r["segment_hits"] == 0 for r in before)
        await asyncio.to_thread(backfill, world, items, segment, "--fraction", 0.5, "--order", "random")
        for _ in range(100):  # the refresh loop runs every 0.1 s
            info = (await service.client.get("/v1/info")).json()
            if info["segment"]["coverage"] >= 0.5:
                break
            await asyncio.sleep(0.1)
        assert info["segment"]["created"] is True
        assert info["segment"]["coverage"] == pytest.approx(0.5, abs=1e-4)
        after = await search(service, "hybrid")
        assert sum(r["segment_hits"] for r in after) > 0
        metrics = (await service.client.get("/metrics")).text
        assert "nobackfill_backfill_coverage_ratio 0.5" in metrics


async def test_a_request_mixing_modalities_answers_each_query_as_it_answers_it_alone(
    world: World, items: Path, tmp_path: Path
) -> None:
    """Hybrid merges each modality's rows under its own calibration, then puts them back in the request's order."""
    segment = tmp_path / "segment"
    backfill(world, items, segment, "--fraction", 0.5, "--order", "random")
    mixed = [
        Query(Modality.image, "item-0000000042 image") if i % 3 == 1 else Query(Modality.text, CAPTION.format(item))
        for i, item in enumerate(QUERY_ITEMS)
    ]
    async with serving(settings_for(world, segment)) as service:
        # The world's profile is fitted on text only: an image query needs its weight given.
        together = (await service.pipeline.search(mixed, k=10, mode="hybrid", alpha=0.5)).results
        alone = [(await service.pipeline.search([q], k=10, mode="hybrid", alpha=0.5)).results[0] for q in mixed]
    assert {q.modality for q in mixed} == {Modality.image, Modality.text}
    assert sum(r.segment_hits or 0 for r in together) > 0  # both sides answered
    for both, one in zip(together, alone, strict=True):
        assert (both.ids, both.segment_hits, both.score_scale) == (one.ids, one.segment_hits, one.score_scale)
        np.testing.assert_allclose(both.scores, one.scores, atol=5e-5)  # a batch of 8 rounds its matmuls otherwise


async def test_a_damaged_shard_is_refused_and_the_rest_serves(world: World, full_segment: Path, tmp_path: Path) -> None:
    segment = tmp_path / "segment"
    shutil.copytree(full_segment, segment)
    names = shard_names(segment)
    async with serving(settings_for(world, segment, segment_refresh_s=0.1)) as service:
        coverage = service.pipeline.segment.segment.coverage
        # A shard appears damaged (what a disk or a bad copy does): refused at the next refresh.
        bad = segment / SHARDS / "99999999999999999999-damaged"
        shutil.copytree(segment / SHARDS / names[0], bad)
        with (bad / "vectors.npy").open("r+b") as f:
            f.seek(-8, 2)
            f.write(b"\x00" * 8)
        for _ in range(100):
            info = (await service.client.get("/v1/info")).json()
            if info["segment"]["refused_shards"]:
                break
            await asyncio.sleep(0.1)
        assert list(info["segment"]["refused_shards"]) == [bad.name]
        assert info["segment"]["coverage"] == coverage
        assert len(await search(service, "hybrid")) == len(QUERY_ITEMS)


async def test_hybrid_without_a_segment_is_refused_with_the_setting_named(world: World) -> None:
    async with serving(settings_for(world, None)) as service:
        response = await service.search(queries=queries(), k=5, mode="hybrid")
        assert response.status_code == 400
        assert "NOBACKFILL_INDEX__SEGMENT_DIR" in response.json()["error"]["message"]


async def test_a_segment_of_another_gallery_is_refused_at_start(world: World, tmp_path: Path) -> None:
    segment = tmp_path / "segment"
    segment.mkdir()
    document = {
        "format_version": 1,
        "model": {"backend": "synthetic-new", "model_id": "synthetic-new", "fingerprint": None, "dim": 768},
        "gallery": {"fingerprint": "ab" * 32, "ntotal": WORLD_GALLERY_SIZE},
    }
    (segment / "segment.json").write_text(json.dumps(document))
    with pytest.raises(ArtifactError, match="sits beside gallery abababababab"):
        async with serving(settings_for(world, segment)):
            pass


def test_a_backfill_with_another_model_than_the_profiles_is_refused_in_one_line(
    world: World, items: Path, tmp_path: Path
) -> None:
    done = cli(
        "backfill", "run", "--segment", tmp_path / "segment", "--input", items, "--gallery", world.gallery_dir,
        "--backend", "synthetic-old", "--profile", world.profile_dir,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "backfill with the profile's new model" in lines[0], done.stderr
    assert not (tmp_path / "segment").exists()


def cut_over_settings(segment: Path, tmp_path: Path) -> Settings:
    """The new model alone over `segment`: the old gallery and profile are gone (their folders do not exist)."""
    return Settings(
        api=ApiSettings(ui=True),  # the operator page too
        old=EncoderSettings(backend="none"),
        index=IndexSettings(gallery_dir=tmp_path / "retired-gallery", segment_dir=segment),
        compat=CompatSettings(profile_dir=tmp_path / "retired-profile"),
    )


async def test_after_the_cut_over_the_new_model_alone_answers_as_hybrid_did_at_100_percent(
    world: World, full_segment: Path, tmp_path: Path
) -> None:
    # 200 queries, the segment as it is served by default: its sealed HNSW index (backfill run built
    # it at the end), not the exact setting.  Hybrid at 100 %, mode new and the cut-over read the same
    # stored index, so they give the same ids in the same order.
    many = [{"text": CAPTION.format(i)} for i in range(0, WORLD_GALLERY_SIZE, WORLD_GALLERY_SIZE // 200)]
    async with serving(settings_for(world, full_segment)) as service:
        assert (await service.client.get("/v1/info")).json()["segment"]["sealed_indexes"] == 1
        hybrid, new = await in_chunks(service, many, "hybrid"), await in_chunks(service, many, "new")
    assert len(hybrid) == 200 and [r["ids"] for r in hybrid] == [r["ids"] for r in new]
    # Which scale the scores are on: hybrid's segment scores mapped onto the old one, new's raw.
    assert {r["score_scale"] for r in hybrid} == {"calibrated"} and {r["score_scale"] for r in new} == {"new"}
    async with serving(cut_over_settings(full_segment, tmp_path)) as service:
        default = await in_chunks(service, many, None)
        assert [r["ids"] for r in default] == [r["ids"] for r in hybrid]
        assert {r["score_scale"] for r in default} == {"new"}
        assert {r["mode"] for r in default} == {"new"}
        info = (await service.client.get("/v1/info")).json()
        assert info["old_model"] == {"backend": "none"} and info["modes"] == ["new"]
        assert info["gallery"]["backend"] == "segment" and info["gallery"]["coverage"] == 1.0
        assert info["segment"]["merge"].startswith("none (cut over")  # no profile, so no merge to describe
        refused = await service.search(queries=queries(), k=10, mode="slerp")
        assert refused.status_code == 400
        assert "not served after the cut-over" in refused.json()["error"]["message"]  # no profile to name
        assert (await service.client.get("/readyz")).status_code == 200
        # Composed without an old model or a profile (pipeline/parts.py): nothing stands in for them.
        assert service.pipeline.old is None and service.pipeline.profile is None and service.pipeline.traffic is None
        health = (await service.client.get("/ui/api/health")).json()
        assert health["status"] == "ready" and health["encoders"]["old"] == {"backend": "none"}
        assert (await service.client.get("/ui/api/profile")).json()["profile"] is None


async def test_a_requests_ef_search_reaches_the_segments_graph_in_hybrid_new_and_the_cut_over(
    world: World, full_segment: Path, tmp_path: Path
) -> None:
    many = [{"text": CAPTION.format(i)} for i in range(0, WORLD_GALLERY_SIZE, WORLD_GALLERY_SIZE // 100)]

    async def ids_at(service: Running, mode: str | None, ef_search: int | None) -> list[list[int]]:
        asked = {key: value for key, value in (("mode", mode), ("ef_search", ef_search)) if value is not None}
        found = []
        for start in range(0, len(many), 50):
            response = await service.search(queries=many[start : start + 50], k=10, **asked)
            assert response.status_code == 200, response.text
            found += [r["ids"] for r in response.json()["results"]]
        return found

    async with serving(settings_for(world, full_segment)) as service:
        narrow, wide = await ids_at(service, "new", 1), await ids_at(service, "new", 4096)
        assert await ids_at(service, "hybrid", 1) == narrow and await ids_at(service, "hybrid", 4096) == wide
        for bad in (0, 4097):
            refused = await service.search(queries=queries(), k=10, mode="new", ef_search=bad)
            assert refused.status_code == 400 and "ef_search must be in 1..4096" in refused.json()["error"]["message"]
        segment = (await service.client.get("/v1/info")).json()["segment"]
        # No setting: each sealed index at the width its seal measured (sealed.measured_width).
        assert segment["ef_search"] is None and set(segment["sealed_ef_search"].values()) <= set(WIDTHS)
    async with serving(settings_for(world, full_segment, segment_exact=True)) as service:
        exact = await ids_at(service, "new", None)
    async with serving(cut_over_settings(full_segment, tmp_path)) as service:
        assert await ids_at(service, None, 1) == narrow and await ids_at(service, None, 4096) == wide
    recall = [np.mean([len(set(e) & set(g)) / 10 for e, g in zip(exact, got, strict=True)]) for got in (narrow, wide)]
    assert recall[0] < recall[1] and recall[1] > 0.99  # the width reached the graph: wider finds more of the exact

    # The served queries' recall, sampled (every search here) and measured exactly in the background.
    for width, low in ((1, True), (4096, False)):
        async with serving(settings_for(world, full_segment, segment_recall_every=1)) as service:
            await ids_at(service, "new", width)
            await asyncio.to_thread(service.pipeline.segment.recall.wait)
            sampled = (await service.client.get("/v1/info")).json()["segment"]["sampled_recall"]
        assert sampled["every"] == 1 and sampled["queries"] >= 50  # at least the first request of 50 queries
        assert (sampled["mean"] < 0.99) if low else (sampled["mean"] > 0.99), sampled


async def test_a_cut_over_before_every_item_moved_is_refused_at_start(
    world: World, items: Path, tmp_path: Path
) -> None:
    segment = tmp_path / "segment"
    backfill(world, items, segment, "--fraction", 0.3)
    with pytest.raises(ArtifactError, match=r"holds 6,000 of the gallery's 20,000 items \(30.0%\)"):
        async with serving(cut_over_settings(segment, tmp_path)):
            pass


def test_a_cut_over_without_a_segment_is_refused_in_one_line() -> None:
    with pytest.raises(SettingsError) as refused:
        Settings(old=EncoderSettings(backend="none"))
    assert "NOBACKFILL_OLD__BACKEND=none (the cut-over) needs NOBACKFILL_INDEX__SEGMENT_DIR" in refused.value.message
    assert "\n" not in refused.value.message


async def test_the_finished_segment_is_the_gallery_of_the_next_upgrade(
    items: Path, full_segment: Path, tmp_path: Path
) -> None:
    # synthetic-new replaced synthetic-old; now synthetic-next replaces synthetic-new, from the finished segment.
    gallery, support, profile, segment = (tmp_path / name for name in ("gallery", "support", "profile", "segment"))
    for args in (
        ("gallery", "build", "--from-segment", full_segment, "--out", gallery, "--nlist", 64),
        ("synth", "support", "--n", 2000, "--out", support, "--old-model", "new", "--new-model", "next"),
        ("fit", support, "--out", profile, "--folds", 3),
    ):
        done = cli(*args)
        assert done.returncode == 0, done.stderr
    settings = Settings(
        old=EncoderSettings(backend="synthetic-new"),
        new=EncoderSettings(backend="synthetic-next"),
        # The segment searched exactly, to compare with the exact re-indexed ranking below.
        index=IndexSettings(gallery_dir=gallery, nprobe=64, segment_dir=segment, segment_exact=True),
        compat=CompatSettings(profile_dir=profile),
    )
    async with serving(settings) as service:
        await search(service, "slerp")
        hybrid, slerp = await search(service, "hybrid"), await search(service, "slerp")
        assert [r["ids"] for r in hybrid] == [r["ids"] for r in slerp]
        # The bridge works over the new gallery: each caption's item is in its top-10 (R@10 is 0.99 there).
        assert sum(item in r["ids"] for r, item in zip(hybrid, QUERY_ITEMS, strict=True)) >= len(QUERY_ITEMS) - 1
    # Searched exactly below (segment_exact): an HNSW seal of the rows would only cost the test its seconds.
    summary = backfill_with(items, segment, gallery, profile, "synthetic-next", "--fraction", 1.0, "--seal-rows", 0)
    assert summary["moved"] == WORLD_GALLERY_SIZE
    async with serving(settings) as service:
        after = await search(service, "hybrid")
        new_queries = service.pipeline.new.encoder.encode([CAPTION.format(i) for i in QUERY_ITEMS], "text")
    snapshot = Segment.open(segment).snapshot
    ids = np.concatenate([block.ids for block in snapshot.blocks])
    rows = np.concatenate([block.vectors() for block in snapshot.blocks])
    reindexed = ids[np.argsort(-(new_queries @ rows.T), axis=1, kind="stable")[:, :10]]
    assert [r["ids"] for r in after] == reindexed.tolist()


async def test_the_item_store_is_opened_beside_the_gallery_and_another_is_refused(
    world: World, items: Path, tmp_path: Path
) -> None:
    async with serving(settings_for(world, None, item_store=items)) as service:
        info = (await service.client.get("/v1/info")).json()
        assert info["items"]["count"] == WORLD_GALLERY_SIZE
        assert service.pipeline.items.get_many([42, WORLD_GALLERY_SIZE]) == ["item-0000000042 image", None]
    small = tmp_path / "small"
    assert cli("synth", "items", "--size", 100, "--out", small).returncode == 0
    with pytest.raises(ArtifactError, match="holds 100 items, but the gallery holds 20,000"):
        async with serving(settings_for(world, None, item_store=small)):
            pass
