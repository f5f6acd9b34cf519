"""The hubness sidecar served: the head's answers re-ranked as compat/hubness.py says, other modes untouched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.compat.hubness import Corrected, load_hubness
from service.errors import ArtifactError
from service.index.gallery import Gallery
from service.settings import CompatSettings, IndexSettings, Settings
from tests.support.app import serving
from tests.support.cli import cli
from tests.support.world import World

CAPTION = "item-{:010d} caption-1"
ITEMS = [3, 77, 512, 1_999, 4_242, 9_001, 12_345, 19_998]


@pytest.fixture(scope="module")
def sidecar(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hubness") / "sidecar"
    done = cli("gallery", "hubness", world.gallery_dir, world.profile_dir, "--queries", world.support_dir, "--out", out)
    assert done.returncode == 0, done.stderr
    assert "wrote hubness sidecar" in done.stdout
    return out


def settings_for(world: World, sidecar: Path | None) -> Settings:
    return Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=64),
        compat=CompatSettings(profile_dir=world.profile_dir, hubness_dir=sidecar, hubness_candidates=50),
    )


async def test_the_heads_answers_are_the_corrected_gallery_search_and_old_is_untouched(
    world: World, sidecar: Path
) -> None:
    body = {"queries": [{"text": CAPTION.format(i)} for i in ITEMS], "k": 10, "debug": False}
    async with serving(settings_for(world, None)) as plain:
        before = {m: (await plain.client.post("/v1/search", json={**body, "mode": m})).json() for m in ("slerp", "old")}
    async with serving(settings_for(world, sidecar)) as served:
        pipeline = served.pipeline
        info = (await served.client.get("/v1/info")).json()
        assert info["hubness"]["profile_id"] == pipeline.profile.profile_id and info["hubness"]["candidates"] == 50
        after = {m: (await served.client.post("/v1/search", json={**body, "mode": m})).json() for m in ("slerp", "old")}
        # The same queries through the gallery and the correction by hand: what the service must have answered.
        job_rows = pipeline.old.encoder.encode([CAPTION.format(i) for i in ITEMS], "text")
        new_rows = pipeline.new.encoder.encode([CAPTION.format(i) for i in ITEMS], "text")
    from service.compat.heads import transform

    queries = transform(pipeline.profile, "slerp", job_rows, new_rows, "text").queries
    gallery = Gallery.load(world.gallery_dir)
    corrected = Corrected(load_hubness(sidecar, gallery.fingerprint, pipeline.profile.profile_id), 50)
    _, expected = corrected.search(gallery, queries, 10, 64, np.ones(len(ITEMS), dtype=bool))
    assert [r["ids"] for r in after["slerp"]["results"]] == expected.tolist()
    assert [r["ids"] for r in after["slerp"]["results"]] != [r["ids"] for r in before["slerp"]["results"]]
    assert [r["ids"] for r in after["old"]["results"]] == [r["ids"] for r in before["old"]["results"]]


async def test_the_ids_served_over_http_are_evals_served_ranking_id_for_id(
    world: World, sidecar: Path, tmp_path: Path
) -> None:
    """What `eval --gallery --hubness` scores is what the service answers: the same ids, in the same order."""
    test = tmp_path / "test"
    assert cli("synth", "test", "--n", 48, "--gallery-size", 20_000, "--seed", 3, "--out", test).returncode == 0
    rankings = tmp_path / "rankings.json"
    done = cli(
        "eval", world.profile_dir, test, "--gallery", world.gallery_dir, "--hubness", sidecar, "--nprobe", 64,
        "--hubness-candidates", 50, "--rankings-out", rankings, "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {row["method"]: row for row in json.loads(done.stdout)}
    scored = json.loads(rankings.read_text())
    query_ids = scored["query_ids"]
    body = {"queries": [{"text": CAPTION.format(i)} for i in query_ids], "k": 10}
    async with serving(settings_for(world, sidecar)) as served:
        answered = {
            m: (await served.client.post("/v1/search", json={**body, "mode": m})).json() for m in ("slerp", "old")
        }
    assert [r["ids"] for r in answered["slerp"]["results"]] == scored["rankings"]["slerp+csls"]
    assert [r["ids"] for r in answered["old"]["results"]] == scored["rankings"]["old"]
    # And eval's figures are those of the served ids: R@1 and R@10 recomputed from the HTTP answers.
    for method, mode in (("slerp+csls", "slerp"), ("old", "old")):
        ids = [r["ids"] for r in answered[mode]["results"]]
        assert rows[method]["recall@1"] == np.mean([found[0] == q for found, q in zip(ids, query_ids, strict=True)])
        assert rows[method]["recall@10"] == np.mean([q in found for found, q in zip(ids, query_ids, strict=True)])
    alone = cli("eval", world.profile_dir, test, "--hubness", sidecar)
    assert alone.returncode == 2 and "give --gallery GALLERY_DIR too" in alone.stderr
    gained = rows["slerp+csls"]["recall@10"] - rows["slerp"]["recall@10"]
    assert rows["slerp+csls"]["vs_uncorrected"]["recall@10"]["diff"] == pytest.approx(gained)


async def test_a_sidecar_of_another_profile_is_refused_at_start(world: World, sidecar: Path, tmp_path: Path) -> None:
    other = tmp_path / "profile"
    assert cli("fit", world.support_dir, "--out", other, "--folds", 3, "--head", "aligned").returncode == 0
    settings = settings_for(world, sidecar)
    settings.compat.profile_dir = other
    with pytest.raises(ArtifactError, match="was computed for profile"):
        async with serving(settings):
            pass


async def test_an_adopted_index_gets_the_same_sidecar_and_answers_as_its_built_gallery(
    world: World, sidecar: Path, tmp_path: Path
) -> None:
    """The world's own IVF-PQ file adopted: its sidecar, computed from the rows given with --from-npy, is the built
    gallery's, and served with it the adopted index answers as the built gallery does."""
    from service.encoders.synthetic import SyntheticOldEncoder

    built = json.loads((world.gallery_dir / "gallery.json").read_text())
    adopted = tmp_path / "adopted"
    done = cli("gallery", "adopt", world.gallery_dir / "index.faiss", "--out", adopted,
               "--model-id", built["old_model"]["model_id"], "--backend", built["old_model"]["backend"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    ask = ["gallery", "hubness", adopted, world.profile_dir, "--queries", world.support_dir]
    refused = cli(*ask, "--out", tmp_path / "never")
    assert refused.returncode == 2 and "keeps codes, not rows; pass --from-npy" in refused.stderr
    # The rows the world's items were indexed from, in the order of the index's own ids (its item ids).
    np.save(tmp_path / "rows.npy", SyntheticOldEncoder().encode_items(np.arange(built["ntotal"])))
    done = cli(*ask, "--out", tmp_path / "adopted-sidecar", "--from-npy", tmp_path / "rows.npy")
    assert done.returncode == 0, done.stderr
    ours, theirs = (np.load(folder / "ids.npy") for folder in (tmp_path / "adopted-sidecar", sidecar))
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_allclose(
        np.load(tmp_path / "adopted-sidecar" / "bias.npy"), np.load(sidecar / "bias.npy"), atol=1e-6
    )
    body = {"queries": [{"text": CAPTION.format(i)} for i in ITEMS], "k": 10, "mode": "slerp"}
    answers = []
    for folder, hubness in ((world.gallery_dir, sidecar), (adopted, tmp_path / "adopted-sidecar")):
        settings = Settings(
            index=IndexSettings(gallery_dir=folder, nprobe=64),
            compat=CompatSettings(profile_dir=world.profile_dir, hubness_dir=hubness, hubness_candidates=50),
        )
        async with serving(settings) as served:
            response = await served.client.post("/v1/search", json=body)
            assert response.status_code == 200, response.text
            answers.append([r["ids"] for r in response.json()["results"]])
    assert answers[0] == answers[1]
