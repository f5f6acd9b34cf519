"""The re-rank cascade served over the synthetic world (real FAISS, the real batcher, a real segment on disk).

Exactness: with every candidate encoded, the cascade's answer is stage 1's candidates ordered by the
new query against the new model's rows of those items, computed here independently.  Then what an
operator relies on: the budget bounds what is encoded and the rest keep their stage-1 order; the
candidates encoded on the path land in the segment, which the next query reads instead of encoding;
a missing item, a failing or all-zero encoding keeps its stage-1 place; the new encoder down skips
the cascade and the answer is stage 1's, with the old model alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service import metrics
from service.encoders.synthetic import SyntheticNewEncoder, format_item
from service.items.store import write_item_store
from service.segment.reader import Segment
from service.settings import CascadeSettings, CompatSettings, EncoderSettings, IndexSettings, Settings
from service.vocabulary import Modality
from tests.support.app import Running, serving
from tests.support.cli import cli
from tests.support.faulty_encoder import install
from tests.support.world import WORLD_GALLERY_SIZE, World

install()

CAPTION = "item-{:010d} caption-1"
QUERY_ITEMS = [3, 77, 512, 1_999, 4_242, 9_001, 12_345, 19_998]


def store_rows(special: dict[int, str | None] | None = None) -> Iterator[tuple[int, str]]:
    """Every gallery item's text; `special` replaces some (None: the id is left out, an extra id keeps the count)."""
    special = special or {}
    dropped = 0
    for i in range(WORLD_GALLERY_SIZE):
        value = special.get(i, format_item(i))
        if value is None:
            dropped += 1
            continue
        yield i, value
    for extra in range(dropped):  # the store must hold as many items as the gallery
        yield WORLD_GALLERY_SIZE + extra, format_item(WORLD_GALLERY_SIZE + extra)


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An item store of the world's gallery."""
    out = tmp_path_factory.mktemp("items") / "store"
    write_item_store(out, store_rows(), Modality.text, "test")
    return out


def settings_for(world: World, items: Path | None, segment: Path | None = None, **cascade: Any) -> Settings:
    """The world's gallery and profile, with an item store, a segment and cascade settings."""
    return Settings(
        index=IndexSettings(
            gallery_dir=world.gallery_dir, nprobe=64, item_store=items, segment_dir=segment, segment_refresh_s=0.1
        ),
        compat=CompatSettings(profile_dir=world.profile_dir),
        cascade=CascadeSettings(**cascade),
    )


def queries() -> list[dict[str, str]]:
    return [{"text": CAPTION.format(i)} for i in QUERY_ITEMS]


async def search(service: Running, mode: str, k: int = 10) -> list[dict[str, Any]]:
    response = await service.search(queries=queries(), k=k, mode=mode)
    assert response.status_code == 200, response.text
    return list(response.json()["results"])


def reranked(candidates: list[int], query: str, new: SyntheticNewEncoder) -> list[int]:
    """The candidates ordered by the new query against the new model's rows of their items (stable on ties)."""
    rows = new.encode([format_item(i) for i in candidates], "text")
    q = new.encode([query], "text")[0]
    cosines = (rows / np.linalg.norm(rows, axis=1, keepdims=True)) @ (q / np.linalg.norm(q))
    return [candidates[j] for j in np.argsort(-cosines, kind="stable")]


def count(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_with_every_candidate_encoded_the_cascade_is_stage_one_reranked_in_the_new_space(
    world: World, items: Path, new: SyntheticNewEncoder
) -> None:
    async with serving(settings_for(world, items, candidates=20, encode_budget=20)) as service:
        info = (await service.client.get("/v1/info")).json()
        assert "cascade" in info["modes"] and info["default_mode"] == "slerp"  # no segment: hybrid is not served
        assert info["cascade"]["encode_budget"] == 20 and info["cascade"]["writes_segment"] is False
        stage1 = await search(service, "slerp", k=20)
        cascade = await search(service, "cascade", k=10)
        debug = await service.search(queries=queries()[:1], k=10, mode="cascade", debug=True)
        assert debug.json()["results"][0]["timings_ms"]["cascade"] > 0
    for i, (one, two) in enumerate(zip(stage1, cascade, strict=True)):
        assert two["mode"] == "cascade" and two["reranked"] == 10
        assert two["ids"] == reranked(one["ids"], CAPTION.format(QUERY_ITEMS[i]), new)[:10]
        assert two["scores"] == sorted(two["scores"], reverse=True)
    # The new model finds the captioned item more often than the compatible query does.
    hits1 = sum(r["ids"][0] == i for r, i in zip(stage1, QUERY_ITEMS, strict=True))
    hits2 = sum(r["ids"][0] == i for r, i in zip(cascade, QUERY_ITEMS, strict=True))
    assert hits2 >= hits1


async def test_the_budget_bounds_the_encoding_and_the_rest_keep_their_stage_one_order(
    world: World, items: Path, new: SyntheticNewEncoder
) -> None:
    async with serving(settings_for(world, items, candidates=20, encode_budget=3)) as service:
        for item in QUERY_ITEMS:  # one query per request: within a request, a row encoded for one query serves all
            query = CAPTION.format(item)
            await service.search(queries=[{"text": query}], k=20, mode="slerp")  # both then read the cached old row
            one = (await service.search(queries=[{"text": query}], k=20, mode="slerp")).json()["results"][0]
            encoded_before = count("nobackfill_cascade_candidates_total", source="encoded")
            two = (await service.search(queries=[{"text": query}], k=10, mode="cascade")).json()["results"][0]
            assert count("nobackfill_cascade_candidates_total", source="encoded") - encoded_before == 3
            assert two["reranked"] == 3
            assert two["ids"][:3] == reranked(one["ids"][:3], query, new)
            assert two["ids"][3:] == one["ids"][3:10]
            assert two["scores"][3:] == one["scores"][3:10]  # stage 1's own scores


async def test_budget_zero_with_no_segment_answers_stage_one(world: World, items: Path) -> None:
    async with serving(settings_for(world, items, candidates=20, encode_budget=0)) as service:
        stage1, cascade = await search(service, "slerp"), await search(service, "cascade")
    assert [r["ids"] for r in cascade] == [r["ids"] for r in stage1]
    assert all(r["reranked"] == 0 for r in cascade)


async def test_encoded_candidates_fill_the_segment_and_the_next_query_reads_them_there(
    world: World, items: Path, tmp_path: Path
) -> None:
    segment = tmp_path / "segment"  # missing: the service creates it at its first publish
    async with serving(settings_for(world, items, segment, candidates=20, encode_budget=20, flush_s=0.05)) as service:
        assert (await service.client.get("/v1/info")).json()["default_mode"] == "hybrid"
        first = await search(service, "hybrid")
        assert all(r["reranked"] == 10 for r in first)
        writer = service.pipeline.cascade.writer
        for _ in range(100):
            if writer.pending == 0 and service.pipeline.segment.segment.snapshot.count:
                break
            await asyncio.sleep(0.05)
        snapshot = service.pipeline.segment.segment.snapshot
        moved = snapshot.count
        assert 0 < moved <= 20 * len(QUERY_ITEMS)
        assert snapshot.contains(np.array([x for r in first for x in r["ids"]])).all()  # every re-ranked hit moved
        from_segment = count("nobackfill_cascade_candidates_total", source="segment")
        second = await search(service, "hybrid")
        # The same queries now read rows from the segment instead of encoding them again.  Hybrid's stage 1
        # also brings unmoved candidates the first one ranked lower (encoded in turn); the best stays first.
        assert count("nobackfill_cascade_candidates_total", source="segment") > from_segment
        assert all(r["segment_hits"] > 0 and r["reranked"] == 10 for r in second)
        assert [r["ids"][0] for r in second] == [r["ids"][0] for r in first]
        await asyncio.to_thread(writer.flush)
        moved = service.pipeline.segment.segment.snapshot.count
    on_disk = Segment.open(segment).snapshot
    assert on_disk.count == moved
    status = cli("backfill", "status", segment, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["moved"] == moved and report["moved_by_writer"] == {"service-cascade": moved}
    assert "moved by: service-cascade" in cli("backfill", "status", segment).stdout


async def test_a_missing_item_or_a_failed_or_zero_encoding_keeps_its_stage_one_place(
    world: World, tmp_path: Path, new: SyntheticNewEncoder
) -> None:
    settings = settings_for(world, None, candidates=20, encode_budget=20)
    async with serving(settings) as service:
        stage1 = (await search(service, "slerp", k=20))[0]["ids"]  # the first query's candidates
    missing, failing, zero = stage1[0], stage1[1], stage1[2]
    store = tmp_path / "items"
    special = {missing: None, failing: format_item(failing) + " !raise-new", zero: format_item(zero) + " !zero-new"}
    write_item_store(store, store_rows(special), Modality.text, "test")
    settings = settings_for(world, store, candidates=20, encode_budget=20)
    settings.new = EncoderSettings(backend="faulty-new")
    before = {r: count("nobackfill_cascade_encode_failures_total", reason=r) for r in metrics.CASCADE_FAILURE_REASONS}
    async with serving(settings) as service:
        response = await service.search(queries=[{"text": CAPTION.format(QUERY_ITEMS[0])}], k=20, mode="cascade")
    assert response.status_code == 200, response.text
    result = response.json()["results"][0]
    assert result["reranked"] == 17
    # The three without a row follow the re-ranked ones, in their stage-1 order.
    assert result["ids"][17:] == [missing, failing, zero]
    assert result["ids"][:17] == reranked(stage1[3:], CAPTION.format(QUERY_ITEMS[0]), new)
    for reason in ("missing_item", "encoder_failed", "zero_row"):
        assert count("nobackfill_cascade_encode_failures_total", reason=reason) == before[reason] + 1


async def test_with_the_new_encoder_down_the_cascade_is_skipped_and_old_answers(world: World, items: Path) -> None:
    settings = settings_for(world, items, candidates=20, encode_budget=20)
    settings.old, settings.new = EncoderSettings(backend="faulty-old"), EncoderSettings(backend="faulty-new")
    skipped = count("nobackfill_cascade_skipped_total", reason="new_encoder")
    async with serving(settings) as service:
        old = await search(service, "old")
        body = {"queries": [{"text": CAPTION.format(i) + " !raise-new"} for i in QUERY_ITEMS], "k": 10}
        response = await service.client.post("/v1/search", json={**body, "mode": "cascade"})
        refused = await service.client.post("/v1/search", json={**body, "mode": "slerp"})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["ids"] for r in results] == [r["ids"] for r in old]
    assert all(r["fallback"] == "old" and "reranked" not in r for r in results)
    assert count("nobackfill_cascade_skipped_total", reason="new_encoder") == skipped + len(QUERY_ITEMS)
    assert refused.status_code == 500  # other modes still report the failure: only the cascade degrades


async def test_cascade_with_neither_item_store_nor_segment_is_refused_with_the_settings_named(world: World) -> None:
    async with serving(settings_for(world, None)) as service:
        response = await service.search(queries=queries(), k=5, mode="cascade")
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "NOBACKFILL_INDEX__ITEM_STORE" in message and "NOBACKFILL_INDEX__SEGMENT_DIR" in message
