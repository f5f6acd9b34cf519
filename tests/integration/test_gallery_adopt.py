"""`gallery adopt`: a FAISS index file the user built, served untouched as the frozen gallery (real FAISS).

Each kind (IVF-Flat, IVF-PQ, HNSW, Flat, with and without an id map) is served as the user's own
index answers, labels mapped to gallery ids, moved ids left out by a selector; L2 scores come back
as cosines; the refusals are one line.  The synthetic world's own IVF-PQ file, adopted, is served
as its built gallery is.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import faiss
import numpy as np
import pytest

from service.errors import ArtifactError, InputError
from service.index.adopted import AdoptedGallery, adopt, served_ids
from service.index.base import Exclusion
from service.settings import CompatSettings, IndexSettings, Settings
from tests.support.app import serving
from tests.support.cli import cli
from tests.support.world import World

DIM = 32
N = 3000


def _rows(seed: int, n: int = N) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((30, DIM)).astype(np.float32)
    rows = centres[rng.integers(0, 30, n)] + 0.4 * rng.standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


ROWS, QUERIES = _rows(0), _rows(1, 40)
GALLERY_IDS = 10**9 + np.random.default_rng(2).permutation(N).astype(np.int64)  # sparse, not positions

# (factory string, labels: "ids" the index stores the gallery ids, "positions" --ids maps them).  "np": no
# polysemous training, which index_factory's plain "PQ8" runs (30 s on 3,000 rows here, for codes the same
# search reads alike); gallery build's IVF-PQ is "np" too.
KINDS = [
    ("IVF32,Flat", "ids"),
    ("IVF32,PQ8np", "ids"),
    ("IVF32,Flat", "positions"),
    ("HNSW16", "positions"),
    ("Flat", "positions"),
    ("IDMap2,Flat", "ids"),
    ("IDMap,HNSW16", "ids"),
]


def _user_index(spec: str, labels: str, metric: int = faiss.METRIC_INNER_PRODUCT) -> faiss.Index:
    index = faiss.index_factory(DIM, spec, metric)
    if not index.is_trained:
        index.train(ROWS)
    if labels == "ids":
        index.add_with_ids(ROWS, GALLERY_IDS)
    else:
        index.add(ROWS)
    return index


def _adopted(tmp_path: Path, spec: str, labels: str, **extra: object) -> tuple[faiss.Index, AdoptedGallery]:
    index = _user_index(spec, labels, **extra)  # type: ignore[arg-type]
    path = tmp_path / "theirs.faiss"
    faiss.write_index(index, str(path))
    path.chmod(0o640)  # a user's file, as their pipeline left it
    ids = None
    if labels == "positions":
        ids = tmp_path / "ids.npy"
        np.save(ids, GALLERY_IDS)
    adopt(path, tmp_path / "gallery", "their-old-model", "sentence-transformers", ids)
    return index, AdoptedGallery.load(tmp_path / "gallery")


def _their_answer(index: faiss.Index, labels: str, k: int, nprobe: int) -> np.ndarray:
    inner = faiss.downcast_index(index)
    if hasattr(inner, "nprobe"):
        inner.nprobe = nprobe
    _, found = index.search(QUERIES, k)
    return GALLERY_IDS[found] if labels == "positions" else found


@pytest.mark.parametrize(("spec", "labels"), KINDS, ids=[f"{s}-{lab}" for s, lab in KINDS])
def test_an_adopted_index_answers_as_the_users_own_and_skips_moved_ids(tmp_path: Path, spec: str, labels: str) -> None:
    index, gallery = _adopted(tmp_path, spec, labels)
    # Every id it can answer with, read from the file as --items checks them against the item store.
    given = GALLERY_IDS if labels == "positions" else None
    assert sorted(served_ids(faiss.read_index(str(tmp_path / "theirs.faiss")), given)) == sorted(GALLERY_IDS)
    scores, ids = gallery.search(QUERIES, 10, nprobe=8 if gallery.max_nprobe else 1)
    np.testing.assert_array_equal(ids, _their_answer(index, labels, 10, 8))
    assert set(ids.ravel().tolist()) <= set(GALLERY_IDS.tolist())
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
    # Hybrid's moved items: the top hits and a random 500 leave every answer.
    rng = np.random.default_rng(3)
    moved = np.unique(np.concatenate([ids[:, :3].ravel(), rng.choice(GALLERY_IDS, 500, replace=False)]))
    _, kept = gallery.search(QUERIES, 10, nprobe=8 if gallery.max_nprobe else 1, exclude=Exclusion(moved))
    assert not np.isin(kept, moved).any() and (kept >= 0).mean() > 0.99
    if spec == "Flat":  # exact: the brute-force ranking over what did not move
        scores_all = QUERIES @ ROWS.T
        scores_all[:, np.isin(GALLERY_IDS, moved)] = -np.inf
        np.testing.assert_array_equal(kept, GALLERY_IDS[np.argsort(-scores_all, axis=1, kind="stable")[:, :10]])


def test_the_index_is_linked_not_rewritten_and_checked_at_every_load(tmp_path: Path) -> None:
    _adopted(tmp_path, "IVF32,Flat", "ids")
    theirs, ours = tmp_path / "theirs.faiss", tmp_path / "gallery" / "index.faiss"
    assert theirs.stat().st_ino == ours.stat().st_ino  # a hard link: no byte copied
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o640  # its mode is the user's, untouched
    assert stat.S_IMODE((tmp_path / "gallery" / "gallery.json").stat().st_mode) & 0o044 == 0o044  # ours: readable
    meta = json.loads((tmp_path / "gallery" / "gallery.json").read_text())
    assert meta["kind"] == "adopted" and meta["source"]["how"] == "hard link"
    assert meta["index"] == {"family": "ivf", "type": "IndexIVFFlat", "id_map": False, "nlist": 32, "metric": "ip"}
    assert meta["old_model"] == {"backend": "sentence-transformers", "model_id": "their-old-model",
                                 "fingerprint": None, "dim": DIM}  # fmt: skip
    data = bytearray(ours.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ours.write_bytes(bytes(data))  # (the user's file is the same inode: they edited the adopted bytes)
    with pytest.raises(ArtifactError, match="fingerprint mismatch"):
        AdoptedGallery.load(tmp_path / "gallery")


def test_an_l2_index_of_unit_rows_answers_in_cosines(tmp_path: Path) -> None:
    _, gallery = _adopted(tmp_path, "Flat", "positions", metric=faiss.METRIC_L2)
    scores, ids = gallery.search(QUERIES, 5, nprobe=1)
    exact = QUERIES @ ROWS.T
    order = np.argsort(-exact, axis=1)[:, :5]
    np.testing.assert_array_equal(ids, GALLERY_IDS[order])
    np.testing.assert_allclose(scores, np.take_along_axis(exact, order, axis=1), atol=1e-5)


def test_what_cannot_be_served_is_refused_in_one_line(tmp_path: Path) -> None:
    def refused(index: faiss.Index, **options: object) -> str:
        path = tmp_path / "theirs.faiss"
        faiss.write_index(index, str(path))
        with pytest.raises(InputError) as caught:
            adopt(path, tmp_path / "never", "m", None, **options)  # type: ignore[arg-type]
        assert "\n" not in caught.value.message and not (tmp_path / "never").exists()
        return caught.value.message

    lsh = faiss.IndexLSH(DIM, 64)
    lsh.add(ROWS)
    assert "nobackfill serves IVF, HNSW and Flat" in refused(lsh)
    assert "ranks by ip, not by l2" in refused(_user_index("Flat", "positions"), metric="l2")
    unnormalised = faiss.IndexFlatL2(DIM)
    unnormalised.add(3 * ROWS)
    assert "an L2 index of rows of norm 3" in refused(unnormalised)
    np.save(tmp_path / "short.npy", GALLERY_IDS[:-1])
    assert f"expected {N:,} integer ids" in refused(_user_index("Flat", "positions"), ids_file=tmp_path / "short.npy")
    np.save(tmp_path / "twice.npy", np.concatenate([GALLERY_IDS[:-1], GALLERY_IDS[:1]]))
    assert "an id appears twice" in refused(_user_index("Flat", "positions"), ids_file=tmp_path / "twice.npy")


async def test_the_worlds_own_index_adopted_is_served_as_its_built_gallery(world: World, tmp_path: Path) -> None:
    built = json.loads((world.gallery_dir / "gallery.json").read_text())
    assert cli("synth", "items", "--size", 20_000, "--out", tmp_path / "items").returncode == 0
    assert cli("synth", "items", "--size", 100, "--out", tmp_path / "few").returncode == 0
    adopt_args = ["gallery", "adopt", world.gallery_dir / "index.faiss", "--model-id", built["old_model"]["model_id"],
                  "--backend", built["old_model"]["backend"]]  # fmt: skip
    wrong = cli(*adopt_args, "--out", tmp_path / "refused", "--items", tmp_path / "few")
    assert wrong.returncode == 2 and "19,900 of the index's ids are not in it (the smallest: id 100)" in wrong.stderr
    done = cli(*adopt_args, "--out", tmp_path / "adopted", "--items", tmp_path / "items")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "adopted" / "gallery.json").read_text())["items"]["count"] == 20_000
    assert "IndexIVFPQ" in done.stdout and "hard link" in done.stdout
    queries = [{"text": f"item-{i:010d} caption-1"} for i in (3, 77, 512, 4_242, 12_345)]
    answers = []
    for folder in (world.gallery_dir, tmp_path / "adopted"):
        settings = Settings(
            index=IndexSettings(gallery_dir=folder, nprobe=32), compat=CompatSettings(profile_dir=world.profile_dir)
        )
        async with serving(settings) as service:
            response = await service.search(queries=queries, k=10, mode="slerp")
            assert response.status_code == 200, response.text
            answers.append([(r["ids"], r["scores"]) for r in response.json()["results"]])
            info = (await service.client.get("/v1/info")).json()
    assert answers[0] == answers[1]
    assert info["gallery"]["kind"] == "adopted" and info["gallery"]["index"]["type"] == "IndexIVFPQ"
