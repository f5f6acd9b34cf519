"""The milvus gallery backend against a real milvus-lite server process (no mocks of Milvus).

One `milvus-lite server` process serves the module (started once: ~1 s); the outage tests start their
own, since they stop, freeze and kill it.  The collection holds the same 20,000 synthetic old-model
vectors as the session world's FAISS gallery, loaded through `nobackfill gallery build --backend milvus`.

How the answers are compared: the collection has a FLAT index, so Milvus searches exactly; the test
computes the exact top-k itself (the same transform the pipeline applies, then a brute-force inner
product over all 20,000 rows) and requires the same ids and scores from the HTTP answer, in every mode.
The world's FAISS gallery is IVF-PQ (lossy codes), so at nprobe = nlist it differs from exact search only
by PQ's quantization error: its top-10 must overlap Milvus's by most of the list, never exactly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import stores
from tests.support.app import Running, serving
from tests.support.cli import cli
from tests.support.milvus import MilvusServer, milvus_server
from tests.support.servers import free_port
from tests.support.world import World

pymilvus = pytest.importorskip("pymilvus", reason="pymilvus is not installed: pip install -e '.[milvus-lite]'")
pytest.importorskip("milvus_lite", reason="milvus-lite is not installed: pip install -e '.[milvus-lite]'")

from service import metrics  # noqa: E402
from service.compat.heads import transform  # noqa: E402
from service.errors import ArtifactError, GalleryUnavailable  # noqa: E402
from service.index.milvus import PROBE_INTERVAL_S  # noqa: E402
from service.index.sources import SyntheticSource  # noqa: E402
from service.pipeline import Pipeline  # noqa: E402
from service.settings import CompatSettings, IndexSettings, Settings  # noqa: E402
from service.vocabulary import Mode  # noqa: E402

WORLD_ITEMS = 20_000  # conftest.WORLD_GALLERY_SIZE: the same items as the FAISS gallery
WORLD_NLIST = 64  # the world gallery's nlist (conftest builds it with --nlist 64)
EXACT_RANK_BOUND = 200  # 1% of the gallery; PQ64's worst seen here: 139
CAPTIONS = [f"item-{i:010d} caption-1" for i in (3, 77, 512, 1999, 4242, 9001, 15000, 19998)]


@dataclass(frozen=True)
class Loaded:
    """The module's server and what it holds."""

    server: MilvusServer
    vectors: np.ndarray[Any, np.dtype[np.float32]]  # row i = item i's old-model vector
    npy: Path


@pytest.fixture(scope="module")
def milvus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
    """One milvus-lite server with collection `world` (FLAT, IP) built by the CLI from the world's vectors."""
    root = tmp_path_factory.mktemp("milvus")
    server = milvus_server(root / "data")
    server.start()
    source = SyntheticSource(WORLD_ITEMS)
    vectors = source.rows(np.arange(WORLD_ITEMS, dtype=np.int64))
    npy = root / "old.npy"
    np.save(npy, vectors)
    done = cli(
        "gallery", "build", "--backend", "milvus", "--uri", server.uri, "--collection", "world",
        "--from-npy", npy, "--index", "FLAT", "--model-id", source.model_id,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    yield Loaded(server, vectors, npy)
    server.stop()


def milvus_settings(world: World, uri: str, collection: str = "world", **index: Any) -> Settings:
    """The world's profile in front of a Milvus collection."""
    return Settings(
        index=IndexSettings(backend="milvus", milvus_uri=uri, milvus_collection=collection, **index),
        compat=CompatSettings(profile_dir=world.profile_dir),
    )


def faiss_settings(world: World) -> Settings:
    """The world's profile in front of its FAISS gallery."""
    return Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=WORLD_NLIST),
        compat=CompatSettings(profile_dir=world.profile_dir),
    )


def exact_scores(pipeline: Pipeline, vectors: np.ndarray[Any, Any], mode: str) -> np.ndarray[Any, Any]:
    """Inner products of the pipeline's query vectors for CAPTIONS in `mode` with every row: [queries, items]."""
    old = pipeline.old.encoder.encode(CAPTIONS, "text")
    new = pipeline.new.encoder.encode(CAPTIONS, "text")
    queries = transform(
        pipeline.profile,
        mode,
        old if Mode(mode).reads_old else None,
        new if Mode(mode).reads_new else None,
        "text",
    ).queries
    return np.asarray(queries @ vectors.T)


async def test_every_mode_answers_exactly_and_agrees_with_the_faiss_gallery(world: World, milvus: Loaded) -> None:
    """Milvus (FLAT) == brute force, id for id; FAISS IVF-PQ at nprobe = nlist stays among the exact neighbours.

    PQ64 codes on 512-d rows move items by small score errors, so the FAISS top-10 is not the exact
    one (about 6 in 10 shared here) but every item it returns is among the exact top EXACT_RANK_BOUND
    of 20,000, and on average half its list is Milvus's list; a wrong id mapping or metric in either
    backend fails both.
    """
    k = 10
    async with serving(milvus_settings(world, milvus.server.uri)) as served:
        async with serving(faiss_settings(world)) as local:
            modes = served.pipeline.profile.modes()
            assert {"old", "slerp"} <= set(modes)
            overlaps = []
            for mode in modes:
                body = {"queries": [{"text": text} for text in CAPTIONS], "k": k, "mode": mode}
                from_milvus = await served.search(**body)
                from_faiss = await local.search(**body, nprobe=WORLD_NLIST)
                assert from_milvus.status_code == 200, from_milvus.text
                assert from_faiss.status_code == 200, from_faiss.text
                exact = exact_scores(served.pipeline, milvus.vectors, mode)
                for row, (got, faiss_row) in enumerate(
                    zip(from_milvus.json()["results"], from_faiss.json()["results"], strict=True)
                ):
                    order = np.argsort(-exact[row], kind="stable")
                    assert got["mode"] == mode
                    assert got["ids"] == order[:k].tolist(), f"{mode}: not the exact top-{k}"
                    np.testing.assert_allclose(got["scores"], exact[row][order[:k]], rtol=1e-4, atol=1e-5)
                    worst = max(int((exact[row] > exact[row][i]).sum()) for i in faiss_row["ids"])
                    assert worst < EXACT_RANK_BOUND, f"{mode}: FAISS returned an item ranked {worst} by exact search"
                    overlaps.append(len(set(got["ids"]) & set(faiss_row["ids"])) / k)
            assert np.mean(overlaps) >= 0.5, overlaps


async def test_info_and_readiness_report_the_collection(world: World, milvus: Loaded) -> None:
    async with serving(milvus_settings(world, milvus.server.uri)) as served:
        gallery = (await served.client.get("/v1/info")).json()["gallery"]
        assert gallery["backend"] == "milvus" and gallery["collection"] == "world"
        assert gallery["ntotal"] == WORLD_ITEMS and gallery["dim"] == 512
        assert gallery["index_type"] == "FLAT" and gallery["metric"] == "IP"
        assert (await served.client.get("/readyz")).status_code == 200
        # A FLAT index has no nprobe: any positive value is accepted, and ignored.
        assert (await served.search(queries=[{"text": CAPTIONS[0]}], k=3, nprobe=5000)).status_code == 200


def test_build_resumes_skips_present_ids_and_info_describes(milvus: Loaded, tmp_path: Path) -> None:
    """An interrupted load (the first 1,000 rows) resumed with all 3,000: 2,000 inserted, no duplicates."""
    first, full = tmp_path / "first.npy", tmp_path / "full.npy"
    np.save(first, milvus.vectors[:1000])
    np.save(full, milvus.vectors[:3000])
    base = ["gallery", "build", "--backend", "milvus", "--uri", milvus.server.uri, "--collection", "resumed"]
    index = ["--index", "IVF_FLAT", "--nlist", "16", "--model-id", "synthetic-old"]
    done = cli(*base, "--from-npy", first, *index)
    assert done.returncode == 0, done.stderr
    client = pymilvus.MilvusClient(uri=milvus.server.uri)
    client.release_collection("resumed")  # as after a restart: the resumed build must load it to look
    client.close()
    done = cli(*base, "--from-npy", full, *index)
    assert done.returncode == 0, done.stderr
    assert "3,000 rows (2,000 inserted, 1,000 already there)" in done.stdout
    shown = cli("gallery", "info", "--backend", "milvus", "--uri", milvus.server.uri, "--collection", "resumed")
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["row_count"] == 3000 and info["dim"] == 512 and info["load_state"] == "Loaded"
    assert info["index"]["index_type"] == "IVF_FLAT"
    assert info["nobackfill.gallery"]["old_model_id"] == "synthetic-old"
    assert info["nobackfill.gallery"]["index"]["params"] == {"nlist": 16}


def test_build_from_the_synthetic_world_holds_the_world_rows(milvus: Loaded) -> None:
    """`--size N` loads items 0..N-1 of the synthetic world, the rows `gallery build --size N` indexes locally."""
    base = ["gallery", "build", "--backend", "milvus", "--uri", milvus.server.uri, "--collection", "synthetic"]
    done = cli(*base, "--size", "300", "--index", "FLAT")
    assert done.returncode == 0, done.stderr
    client = pymilvus.MilvusClient(uri=milvus.server.uri)
    try:
        got = client.get("synthetic", ids=[0, 7, 299], output_fields=["vector"])
        info = json.loads(
            cli(
                "gallery", "info", "--backend", "milvus", "--uri", milvus.server.uri, "--collection", "synthetic"
            ).stdout
        )
    finally:
        client.close()
    vectors = {row["id"]: np.asarray(row["vector"], dtype=np.float32) for row in got}
    assert sorted(vectors) == [0, 7, 299]
    for item, vector in vectors.items():  # the module's world vectors are the same synthetic old model's
        np.testing.assert_allclose(vector, milvus.vectors[item], atol=1e-6)
    assert info["row_count"] == 300 and info["nobackfill.gallery"]["old_model"]["backend"] == "synthetic-old"
    neither = cli(*base, "--index", "FLAT")
    assert neither.returncode == 2 and "--from-npy FILE_OR_DIR, or --size N" in neither.stderr


async def test_ivf_collection_bounds_nprobe_by_its_nlist(world: World, milvus: Loaded, tmp_path: Path) -> None:
    npy = tmp_path / "ivf.npy"
    np.save(npy, milvus.vectors[:2000])
    done = cli(
        "gallery", "build", "--backend", "milvus", "--uri", milvus.server.uri, "--collection", "ivf",
        "--from-npy", npy, "--index", "IVF_FLAT", "--nlist", "8", "--model-id", "synthetic-old",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    async with serving(milvus_settings(world, milvus.server.uri, "ivf")) as served:
        assert served.pipeline.gallery.max_nprobe == 8
        assert (await served.client.get("/v1/info")).json()["gallery"]["nprobe_default"] == 8
        ok = await served.search(queries=[{"text": text} for text in CAPTIONS], k=5, mode="slerp", nprobe=8)
        assert ok.status_code == 200, ok.text
        exact = exact_scores(served.pipeline, milvus.vectors[:2000], "slerp")
        for row, result in enumerate(ok.json()["results"]):  # every list probed: IVF_FLAT searches exactly
            assert result["ids"] == np.argsort(-exact[row], kind="stable")[:5].tolist()
        too_many = await served.search(queries=[{"text": CAPTIONS[0]}], k=5, nprobe=9)
        assert too_many.status_code == 400
        assert "nprobe must be in 1..8" in too_many.json()["error"]["message"]


def test_build_refuses_what_the_server_or_the_collection_cannot_take(milvus: Loaded, tmp_path: Path) -> None:
    npy = tmp_path / "few.npy"
    np.save(npy, milvus.vectors[:50])
    base = ["gallery", "build", "--backend", "milvus", "--uri", milvus.server.uri, "--from-npy", npy]
    other_model = cli(*base, "--collection", "world", "--model-id", "someone-else")
    assert other_model.returncode == 2
    assert "holds model 'synthetic-old'" in other_model.stderr and "someone-else" in other_model.stderr
    bad_pq = cli(*base, "--collection", "pq", "--index", "IVF_PQ", "--pq-m", "7")
    assert bad_pq.returncode == 2 and "--pq-m 7 must divide the dimension 512" in bad_pq.stderr
    pq = cli(*base, "--collection", "pq", "--index", "IVF_PQ", "--pq-m", "8", "--nlist", "4")
    if milvus.server.has_pq_indexes:  # a real Milvus builds it
        assert pq.returncode == 0 and "50 rows (50 inserted, 0 already there)" in pq.stdout, pq.stderr
        built = {"type": "IVF_PQ", "params": {"nlist": 4, "m": 8, "nbits": 8}}
    else:  # milvus-lite has none: refused after the load, in one line; the re-run with one it has resumes
        assert pq.returncode == 2 and "IVF_PQ" in pq.stderr and "Traceback" not in pq.stderr
        flat = cli(*base, "--collection", "pq", "--index", "FLAT")
        assert flat.returncode == 0 and "50 rows (0 inserted, 50 already there)" in flat.stdout, flat.stderr
        built = {"type": "FLAT", "params": {}}
    shown = json.loads(
        cli("gallery", "info", "--backend", "milvus", "--uri", milvus.server.uri, "--collection", "pq").stdout
    )
    assert shown["nobackfill.gallery"]["index"] == built, shown
    no_uri = cli("gallery", "build", "--backend", "milvus", "--collection", "x", "--from-npy", npy)
    assert no_uri.returncode == 2 and "--uri URI and --collection NAME" in no_uri.stderr


def _small_collection(uri: str, name: str, dim: int, metric: str, load: bool = True, model: str = "") -> None:
    """A collection made by hand through pymilvus, as a user's own might be."""
    client = pymilvus.MilvusClient(uri=uri)
    schema = pymilvus.MilvusClient.create_schema(auto_id=False)
    schema.add_field("pk", pymilvus.DataType.INT64, is_primary=True)
    schema.add_field("emb", pymilvus.DataType.FLOAT_VECTOR, dim=dim)
    properties = {"nobackfill.gallery": json.dumps({"d": dim, "old_model_id": model})} if model else {}
    client.create_collection(name, schema=schema, properties=properties)
    rows = np.random.default_rng(0).standard_normal((20, dim)).astype(np.float32)
    client.insert(name, [{"pk": i, "emb": row / np.linalg.norm(row)} for i, row in enumerate(rows)])
    client.flush(name)
    spec = client.prepare_index_params()
    spec.add_index(field_name="emb", index_type="FLAT", metric_type=metric)
    client.create_index(name, spec)
    client.load_collection(name)
    if not load:
        client.release_collection(name)  # (milvus-lite reports a never-loaded collection as Loaded)
    client.close()


@pytest.mark.parametrize(
    ("name", "dim", "metric", "load", "model", "expected"),
    [
        ("by_l2", 512, "L2", True, "", "ranks 'emb' by L2; nobackfill needs IP or COSINE"),
        ("narrow", 16, "IP", True, "", "512-d rows where it holds 16-d"),
        ("foreign", 512, "COSINE", True, "bert-old", "model 'synthetic-old' where it was made by 'bert-old'"),
        ("released", 512, "IP", False, "", "is not loaded"),
        ("absent", 0, "", False, "", "no collection 'absent'"),
    ],
)
async def test_startup_refuses_a_collection_that_does_not_fit(
    world: World, milvus: Loaded, name: str, dim: int, metric: str, load: bool, model: str, expected: str
) -> None:
    if dim:
        _small_collection(milvus.server.uri, name, dim, metric, load, model)
    with pytest.raises(ArtifactError) as refused:
        await Pipeline.build(milvus_settings(world, milvus.server.uri, name))
    message = refused.value.message
    assert expected in message and "\n" not in message
    assert f"NOBACKFILL_INDEX__MILVUS_COLLECTION={name}" in message  # names the setting to fix


async def test_unreachable_at_startup_is_one_line(world: World) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(GalleryUnavailable) as refused:
        await Pipeline.build(milvus_settings(world, dead, milvus_timeout_s=0.5))
    assert dead in refused.value.message and "\n" not in refused.value.message


@pytest.fixture
def private_milvus(tmp_path: Path, milvus: Loaded) -> Iterator[MilvusServer]:
    """A milvus-lite server of this test's own holding 2,000 world rows (FLAT), killed afterwards."""
    server = milvus_server(tmp_path / "data")
    server.start()
    npy = tmp_path / "part.npy"
    np.save(npy, milvus.vectors[:2000])
    done = cli(
        "gallery", "build", "--backend", "milvus", "--uri", server.uri, "--collection", "world",
        "--from-npy", npy, "--index", "FLAT", "--model-id", "synthetic-old",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    yield server
    server.stop()


async def _answers(served: Running) -> int:
    """Status of one search (the client's own timeout would fail the test if the service hung)."""
    return (await served.search(queries=[{"text": CAPTIONS[0]}], k=5)).status_code


async def _ready_again(served: Running) -> None:
    """/readyz turns 200 once Milvus answers again (its probe runs at most once a second)."""
    for _ in range(100):
        if (await served.client.get("/readyz")).status_code == 200:
            return
        await asyncio.sleep(0.1)
    pytest.fail("/readyz did not recover after Milvus came back")


def _failures(call: str) -> float:
    """nobackfill_gallery_failures_total{call} so far."""
    return metrics.REGISTRY.get_sample_value("nobackfill_gallery_failures_total", {"call": call}) or 0.0


async def _ready_after_probe_interval(served: Running) -> Any:
    """/readyz once the last probe's answer has expired (so this one asks Milvus again)."""
    await asyncio.sleep(PROBE_INTERVAL_S + 0.1)
    return await served.client.get("/readyz")


def _wait_loaded(uri: str, collection: str) -> None:
    """Until the restarted server reports `collection` loaded (its query node reads the segments back first)."""
    client = pymilvus.MilvusClient(uri=uri)
    try:
        stores.wait_until(lambda: "Loaded" in str(client.get_load_state(collection)["state"]), f"{collection} loaded")
    finally:
        client.close()


async def test_outages_answer_503_and_readiness_follows(
    world: World, private_milvus: MilvusServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Frozen, then killed, then restarted: 503 gallery_unavailable within the deadline, /readyz tracks it.

    Each 503 is logged in one line, never with a traceback: an outage is a state, not a bug.
    """
    settings = milvus_settings(world, private_milvus.uri, milvus_timeout_s=0.5)
    caplog.set_level(logging.WARNING, logger="nobackfill")
    async with serving(settings) as served:
        assert await _answers(served) == 200
        for outage, recover in (
            (private_milvus.pause, private_milvus.resume),
            (private_milvus.stop, private_milvus.start),
        ):
            outage()
            failed_before = _failures("search")
            response = await served.search(queries=[{"text": CAPTIONS[1]}], k=5)
            assert response.status_code == 503
            assert _failures("search") == failed_before + 1
            again = await served.search(queries=[{"text": CAPTIONS[2]}], k=5)  # just failed: answered at once,
            assert again.status_code == 503 and again.json()["error"]["code"] == "gallery_unavailable"
            assert _failures("search") == failed_before + 1  # without another call to Milvus
            assert response.json()["error"]["code"] == "gallery_unavailable"
            assert "did not answer within 0.5 s" in response.json()["error"]["message"]
            for refused in (response, again):
                request_id = refused.json()["error"]["request_id"]
                lines = [r for r in caplog.records if request_id in r.getMessage()]
                assert len(lines) == 1 and lines[0].exc_info is None, [r.getMessage() for r in lines]
                assert "refused: gallery_unavailable" in lines[0].getMessage()
            ready = await served.client.get("/readyz")
            assert ready.status_code == 503
            assert any("gallery: Milvus collection 'world'" in p for p in ready.json()["problems"])
            recover()
            if outage == private_milvus.stop and private_milvus.reloads_after_restart:
                _wait_loaded(private_milvus.uri, "world")  # a real Milvus loads again what was loaded
            elif outage == private_milvus.stop:
                # A restarted milvus-lite holds the collection released: not ready until the operator loads it.
                ready = await _ready_after_probe_interval(served)
                assert ready.status_code == 503 and "not loaded" in str(ready.json()["problems"])
                client = pymilvus.MilvusClient(uri=private_milvus.uri)
                client.load_collection("world")
                client.close()
            await _ready_again(served)
            assert await _answers(served) == 200


async def test_an_embedded_db_file_is_served_in_process(world: World, milvus: Loaded, tmp_path: Path) -> None:
    """NOBACKFILL_INDEX__MILVUS_URI=./x.db: milvus-lite inside the service's process (a developer's try-out)."""
    npy, db = tmp_path / "few.npy", tmp_path / "gallery.db"
    np.save(npy, milvus.vectors[:300])
    done = cli(
        "gallery", "build", "--backend", "milvus", "--uri", db, "--collection", "world",
        "--from-npy", npy, "--index", "FLAT", "--model-id", "synthetic-old",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    async with serving(milvus_settings(world, str(db))) as served:
        response = await served.search(queries=[{"old_embedding": milvus.vectors[42].tolist()}], k=3, mode="old")
        assert response.status_code == 200, response.text
        assert response.json()["results"][0]["ids"][0] == 42  # a stored vector finds itself


def test_an_embedded_db_builds_an_index_it_has_and_refuses_one_it_lacks_before_inserting(
    milvus: Loaded, tmp_path: Path
) -> None:
    npy, db = tmp_path / "few.npy", tmp_path / "lite.db"
    np.save(npy, milvus.vectors[:60])
    base = ["gallery", "build", "--backend", "milvus", "--uri", db, "--from-npy", npy, "--model-id", "synthetic-old"]
    info = ["gallery", "info", "--backend", "milvus", "--uri", db, "--collection"]
    no_pq = cli(*base, "--collection", "pq", "--index", "IVF_PQ")
    assert no_pq.returncode == 2 and no_pq.stderr.count("\n") == 1, no_pq.stderr
    assert f"--index IVF_PQ: milvus-lite ({db}) does not build it" in no_pq.stderr and "IVF_FLAT" in no_pq.stderr
    absent = cli(*info, "pq")  # refused before a row was inserted: no collection at all
    assert absent.returncode == 2 and "no collection 'pq'" in absent.stderr, absent.stderr
    default = cli(*base, "--collection", "plain")  # no --index: one milvus-lite builds
    assert default.returncode == 0 and "60 rows" in default.stdout and "IVF_FLAT" in default.stdout, default.stderr
    brute = cli(*base, "--collection", "brute", "--index", "brute_force")  # the target's own name, any case
    assert brute.returncode == 0, brute.stderr
    assert json.loads(cli(*info, "brute").stdout)["index"]["index_type"] == "BRUTE_FORCE"


def test_info_says_plainly_that_a_collection_without_an_index_cannot_be_served(tmp_path: Path) -> None:
    db = tmp_path / "bare.db"
    client = pymilvus.MilvusClient(uri=str(db))
    schema = pymilvus.MilvusClient.create_schema(auto_id=False)
    schema.add_field("pk", pymilvus.DataType.INT64, is_primary=True)
    schema.add_field("emb", pymilvus.DataType.FLOAT_VECTOR, dim=8)
    client.create_collection("bare", schema=schema)
    client.insert("bare", [{"pk": i, "emb": [1.0] * 8} for i in range(5)])
    client.flush("bare")
    client.close()
    done = cli("gallery", "info", "--backend", "milvus", "--uri", db, "--collection", "bare")
    assert done.returncode == 2 and json.loads(done.stdout)["index"] is None
    assert "error: collection bare has no vector index: serving it would fail" in done.stderr, done.stderr
