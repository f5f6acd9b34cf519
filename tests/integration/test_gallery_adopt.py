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
    assert info["gallery"]["nprobe_default"] == 32  # an IVF index: the nprobe a request without one gets


# --------------------------------------------------------------------------- gallery eval, the width setting


def _their_others(index: faiss.Index, labels: str, rows: np.ndarray, own: np.ndarray) -> np.ndarray:
    """The user's own index's top 10 gallery ids for each of its rows, the row itself left out (their faiss call)."""
    _, found = index.search(rows, 11)
    found = GALLERY_IDS[found] if labels == "positions" else found
    return np.stack([row[row != mine][:10] for row, mine in zip(found, own, strict=True)])


def _exact_others(rows: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Brute force: each row's 10 nearest other rows by inner product, as gallery ids."""
    scores = rows @ ROWS.T
    scores[GALLERY_IDS[None, :] == own[:, None]] = -np.inf
    return GALLERY_IDS[np.argsort(-scores, axis=1, kind="stable")[:, :10]]


def _overlap(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([np.intersect1d(a, b).size / 10 for a, b in zip(found, truth, strict=True)]))


@pytest.mark.parametrize(("spec", "labels"), [("HNSW16", "positions"), ("IVF32,Flat", "ids"), ("Flat", "positions")])
def test_eval_measures_an_adopted_index_against_brute_force_at_each_width(
    tmp_path: Path, spec: str, labels: str
) -> None:
    from service.index.adopted_rows import AdoptedRows
    from service.index.sources import sample_positions
    from service.scoring.adopted_eval import evaluate_adopted

    index, gallery = _adopted(tmp_path, spec, labels)
    family = spec.split(",")[0][:4]
    widths = (12, 16, 200) if family == "HNSW" else (1, 4, 32)  # efSearch at least the 11 rows asked; nlist 32
    report = evaluate_adopted(gallery, AdoptedRows(gallery), widths, queries=60, batch=8)
    # The same rows as queries (the report's seeded sample of positions, in the index's order: an IVF index that
    # holds its own ids lists them ascending), measured here without any of its code.
    order = np.argsort(GALLERY_IDS) if labels == "ids" else np.arange(N)
    picked = order[sample_positions(N, 60, 0)]
    rows, own = ROWS[picked], GALLERY_IDS[picked]
    truth = _exact_others(rows, own)
    assert [w.width for w in report.widths] == ([None] if family == "Flat" else list(widths))
    for result in report.widths:
        inner = faiss.downcast_index(index)
        if family == "HNSW":
            inner.hnsw.efSearch = result.width
        elif family == "IVF3":
            inner.nprobe = result.width
        assert result.ten_recall_at_10 == pytest.approx(_overlap(_their_others(index, labels, rows, own), truth))
    if family == "Flat":
        assert report.widths[0].ten_recall_at_10 == 1.0 and report.parameter is None
    else:  # a width of 1 misses what 64 finds, so the sweep tells widths apart
        assert report.widths[0].ten_recall_at_10 < report.widths[-1].ten_recall_at_10
        best = max(w.ten_recall_at_10 for w in report.widths)
        narrowest = min(w.width for w in report.widths if w.ten_recall_at_10 >= best - 0.01)
        assert report.recommended().width == narrowest


def test_gallery_eval_on_an_adopted_index_from_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _adopted(tmp_path, "HNSW16", "positions")
    done = cli("gallery", "eval", tmp_path / "gallery", "--queries", 40, "--ef-search", "2,64", "--batch", 8)
    assert done.returncode == 0, done.stderr
    assert "adopted IndexHNSWFlat of 3,000 rows" in done.stdout
    assert "recommended: NOBACKFILL_INDEX__ADOPTED_EF_SEARCH=" in done.stdout
    report = json.loads(
        cli("gallery", "eval", tmp_path / "gallery", "--queries", 40, "--ef-search", "2,64", "--json").stdout
    )
    # The file's own efSearch (faiss's default, 16) is swept too: it is what the service searches at.  A width
    # below the 11 rows each query asks for is measured at 11.
    assert [w["width"] for w in report["widths"]] == [11, 16, 64] and report["served_width"] == 16
    assert report["rows_from"] == "the index's own rows" and report["queries"] == 40
    # What the service would search at, read from its settings as `serve` reads them.
    monkeypatch.setenv("NOBACKFILL_INDEX__ADOPTED_EF_SEARCH", "48")
    report = json.loads(
        cli("gallery", "eval", tmp_path / "gallery", "--queries", 20, "--ef-search", "64", "--json").stdout
    )
    assert [w["width"] for w in report["widths"]] == [48, 64] and report["served_width"] == 48
    assert "* what the service searches at now" in cli("gallery", "eval", tmp_path / "gallery", "--queries", 20).stdout
    refused = cli("gallery", "eval", tmp_path / "gallery", "--ef-search", "wide")
    assert refused.returncode == 2 and "--ef-search must be comma-separated integers" in refused.stderr


def test_gallery_eval_of_a_pq_index_reads_the_rows_from_npy_or_says_so(tmp_path: Path) -> None:
    _adopted(tmp_path, "IVF32,PQ8np", "ids")
    refused = cli("gallery", "eval", tmp_path / "gallery", "--queries", 20)
    assert refused.returncode == 2 and "keeps codes, not rows; pass --from-npy" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    np.save(tmp_path / "short.npy", ROWS[:-1])
    short = cli("gallery", "eval", tmp_path / "gallery", "--queries", 20, "--from-npy", tmp_path / "short.npy")
    assert short.returncode == 2 and f"holds {N:,} rows of {DIM} floats" in short.stderr
    # The index holds its own ids (add_with_ids): its rows' order is their ids' ascending order.
    np.save(tmp_path / "rows.npy", ROWS[np.argsort(GALLERY_IDS)])
    done = cli("gallery", "eval", tmp_path / "gallery", "--queries", 20, "--nprobe", "1,32",
               "--from-npy", tmp_path / "rows.npy", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["parameter"] == "nprobe" and [w["width"] for w in report["widths"]] == [1, 16, 32]
    assert report["rows_from"] == str(tmp_path / "rows.npy")


@pytest.mark.parametrize(("spec", "labels"), [("IVF32,Flat", "ids"), ("IDMap,HNSW16", "ids"), ("HNSW16", "positions")])
def test_rows_from_npy_and_from_the_index_itself_give_the_same_eval(tmp_path: Path, spec: str, labels: str) -> None:
    from service.index.adopted_rows import AdoptedRows
    from service.scoring.adopted_eval import evaluate_adopted

    _, gallery = _adopted(tmp_path, spec, labels)
    # The order the index added them: its inner labels' (an IVF index with its own ids: those ids ascending).
    np.save(tmp_path / "rows.npy", ROWS[np.argsort(GALLERY_IDS)] if spec.startswith("IVF") else ROWS)
    read = AdoptedRows(gallery)
    given = AdoptedRows(gallery, tmp_path / "rows.npy")
    np.testing.assert_array_equal(read.ids(0, N), given.ids(0, N))
    np.testing.assert_array_equal(read.rows(np.arange(N)), given.rows(np.arange(N)))
    assert sorted(read.ids(0, N)) == sorted(GALLERY_IDS)  # every row once, under its gallery id
    recalls = [[w.ten_recall_at_10 for w in evaluate_adopted(gallery, rows, (16,), queries=40, batch=4).widths]
               for rows in (read, given)]  # fmt: skip
    assert recalls[0] == recalls[1]


def test_the_adopted_ef_search_setting_widens_an_hnsw_index_without_touching_it(tmp_path: Path) -> None:
    index, narrow = _adopted(tmp_path, "HNSW16", "positions")
    digest = (tmp_path / "theirs.faiss").read_bytes()
    wide = AdoptedGallery.load(tmp_path / "gallery", ef_search=256)
    assert (narrow.ef_search, wide.ef_search) == (16, 256)  # the file's own, and the setting's
    assert wide.describe()["ef_search"] == 256
    truth = _exact_others(QUERIES, np.full(len(QUERIES), -1))
    recall = {g.ef_search: _overlap(g.search(QUERIES, 10, nprobe=1)[1], truth) for g in (narrow, wide)}
    assert recall[256] > recall[16] and recall[256] >= 0.99
    assert (tmp_path / "theirs.faiss").read_bytes() == digest
    # At least k: 50 rows asked of the width-16 index walk as wide as 50 (faiss widens only its own setting).
    _, at_k = narrow.search(QUERIES, 50, nprobe=1)
    _, at_50 = AdoptedGallery.load(tmp_path / "gallery", ef_search=50).search(QUERIES, 50, nprobe=1)
    np.testing.assert_array_equal(at_k, at_50)
    settings = Settings(index=IndexSettings(gallery_dir=tmp_path / "gallery", adopted_ef_search=256))
    from service.index.factory import create_gallery

    assert create_gallery(settings.index).ef_search == 256  # type: ignore[attr-defined]


def test_adopt_says_when_positions_are_taken_as_ids_and_what_serving_needs(tmp_path: Path) -> None:
    faiss.write_index(_user_index("HNSW16", "positions"), str(tmp_path / "plain.faiss"))
    faiss.write_index(_user_index("IDMap,HNSW16", "ids"), str(tmp_path / "mapped.faiss"))
    plain = cli("gallery", "adopt", tmp_path / "plain.faiss", "--out", tmp_path / "a", "--model-id", "m",
                "--backend", "sentence-transformers")  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert f"labels are positions 0..{N - 1:,} (no id map), taken as the gallery ids: pass --ids" in plain.stdout
    assert "NOBACKFILL_COMPAT__PROFILE_DIR=PROFILE_DIR NOBACKFILL_OLD__BACKEND=sentence-transformers" in plain.stdout
    mapped = cli("gallery", "adopt", tmp_path / "mapped.faiss", "--out", tmp_path / "b", "--model-id", "synthetic-old",
                 "--backend", "synthetic-old")  # fmt: skip
    assert "with its id map" in mapped.stdout and "labels are gallery ids;" in mapped.stdout
    assert "NOBACKFILL_OLD__BACKEND" not in mapped.stdout  # the synthetic encoders are the default


async def test_a_requests_ef_search_is_an_adopted_hnsw_gallerys_width_for_that_request(
    world: World, tmp_path: Path
) -> None:
    """Served over a poorly built HNSW index of the world's old rows (8 links): a narrow request finds less of the
    exact ranking than a wide one, and neither changes what a request without a width gets (the file's 16)."""
    from service.encoders.synthetic import SyntheticOldEncoder

    rows = SyntheticOldEncoder().encode_items(np.arange(5000))
    index = faiss.IndexHNSWFlat(rows.shape[1], 8, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 16
    index.add(rows)
    faiss.write_index(index, str(tmp_path / "theirs.faiss"))
    built = json.loads((world.gallery_dir / "gallery.json").read_text())
    adopt(
        tmp_path / "theirs.faiss", tmp_path / "gallery", built["old_model"]["model_id"], built["old_model"]["backend"]
    )
    settings = Settings(index=IndexSettings(gallery_dir=tmp_path / "gallery"), compat=CompatSettings(
        profile_dir=world.profile_dir))  # fmt: skip
    texts = [f"item-{i:010d} caption-1" for i in range(0, 5000, 250)]
    queries = SyntheticOldEncoder().encode(texts)
    exact = np.argsort(-(queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ rows.T, axis=1)[:, :10]
    async with serving(settings) as service:

        async def recall(**width: int) -> float:
            response = await service.search(queries=[{"text": t} for t in texts], k=10, mode="old", **width)
            assert response.status_code == 200, response.text
            got = [r["ids"] for r in response.json()["results"]]
            return float(np.mean([len(set(w) & set(g)) / 10 for w, g in zip(exact.tolist(), got, strict=True)]))

        default, narrow, wide = await recall(), await recall(ef_search=10), await recall(ef_search=1000)
        assert narrow < wide and wide >= 0.99
        assert await recall(ef_search=16) == default == await recall()  # the file's width; the wide one did not stick
        gallery = (await service.client.get("/v1/info")).json()["gallery"]
        assert gallery["ef_search"] == 16 and gallery["nprobe_default"] is None  # no IVF lists: no nprobe to show
