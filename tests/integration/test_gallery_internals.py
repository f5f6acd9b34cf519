"""Gallery internals the end-to-end tests do not reach: two-level coarse training / assignment (the
path large galleries take), OPQ, default parameters, and the sub-gallery evaluation.

Everything here runs on small 32-64-d data, in-process, in a few seconds.  faiss and torch are only
imported through `service` (whose __init__ sets OMP_WAIT_POLICY=PASSIVE before they load): spinning
OpenMP threads made these tests 5-10x slower on a shared 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.errors import InputError
from service.index.build import build_gallery
from service.index.coarse import assign_two_level, train_two_level
from service.index.gallery import Gallery
from service.index.params import MAX_NLIST, TWO_LEVEL_MIN_NLIST, default_nlist, default_train_size, resolve
from service.index.sources import NpySource
from service.scoring.gallery_eval import evaluate_gallery, format_report, source_of


def unit_rows(n: int, d: int, seed: int, clusters: int = 50) -> npt.NDArray[np.float32]:
    """Clustered unit rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((clusters, d))[rng.integers(0, clusters, n)] + 0.6 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def npy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4,000 clustered 64-d rows (not normalised) in one file."""
    path = tmp_path_factory.mktemp("src") / "rows.npy"
    np.save(path, unit_rows(4000, 64, seed=3) * 2.5)
    return path


def test_two_level_training_yields_nlist_grouped_centroids() -> None:
    x = unit_rows(6000, 32, seed=1)
    tl = train_two_level(x, nlist=150, seed=0)
    assert tl.centroids.shape == (150, 32)
    assert tl.bounds[0] == 0 and tl.bounds[-1] == 150 and np.all(np.diff(tl.bounds) >= 1)
    assert tl.groups.shape == (tl.bounds.size - 1, 32)
    np.testing.assert_allclose(np.linalg.norm(tl.centroids, axis=1), 1.0, atol=1e-5)


def test_two_level_assignment_is_exact_when_every_group_is_probed() -> None:
    x = unit_rows(6000, 32, seed=2)
    tl = train_two_level(x, nlist=150, seed=0)
    exact = (x @ tl.centroids.T).argmax(axis=1)
    everything = assign_two_level(x, tl, probe=tl.groups.shape[0])
    assert np.mean(everything == exact) > 0.999  # float ties aside
    approx = assign_two_level(x, tl, probe=3)
    assert np.mean(approx == exact) > 0.85
    # A wrong list is still a near one: its centroid scores close to the best.
    scores = x @ tl.centroids.T
    loss = scores[np.arange(x.shape[0]), exact] - scores[np.arange(x.shape[0]), approx]
    assert np.all(loss >= -1e-6) and np.median(loss) < 1e-6


def test_default_parameters_scale_and_stay_in_bounds() -> None:
    assert default_nlist(10_000_000) == 12649
    assert default_nlist(20_000) == 512  # 4 sqrt(N) = 566, capped at N / 39
    assert default_nlist(10) == 1 and default_nlist(10**12) == MAX_NLIST
    assert default_train_size(10_000_000, 12649, 512) == (1 << 30) // (4 * 512)
    assert default_train_size(20_000, 512, 512) == 20_000
    big = resolve(10_000_000, 512)
    assert big.two_level and big.nlist >= TWO_LEVEL_MIN_NLIST and big.factory() == "IVF12649,PQ64x8np"
    assert not resolve(20_000, 512).two_level
    assert resolve(5000, 64, nlist=8, pq_m=8, opq=True).factory() == "OPQ8,IVF8,PQ8x8np"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0, "d": 64}, "positive"),
        ({"n": 100, "d": 64}, "training minimum"),
        ({"n": 5000, "d": 64, "pq_m": 7}, "divide"),
        ({"n": 5000, "d": 64, "train_size": 6000}, "below the training sample"),
        ({"n": 5000, "d": 64, "nlist": 0}, "nlist"),
        ({"n": 5000, "d": 64, "nbits": 17}, "nbits"),
    ],
)
def test_resolve_refuses_what_faiss_would_reject(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(InputError, match=match):
        resolve(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("opq", [False, True], ids=["pq", "opq+pq"])
def test_two_level_build_searches_like_a_flat_one(npy: Path, tmp_path: Path, opq: bool) -> None:
    source = NpySource(npy)
    params = resolve(source.ntotal, source.dim, nlist=40, pq_m=16, opq=opq, two_level=True, chunk_size=1500)
    meta = build_gallery(source, tmp_path / "g", params, progress=False, log=lambda _: None)
    assert meta["build"]["coarse"].startswith("two-level") and meta["build"]["assign_agreement"] > 0.8
    assert meta["factory"].startswith("OPQ16," if opq else "IVF40")
    g = Gallery.load(tmp_path / "g")
    rows = source.rows(np.arange(0, 4000, 13, dtype=np.int64))
    _, found = g.search(rows, 10, 40)
    assert (found == np.arange(0, 4000, 13)[:, None]).any(axis=1).mean() >= 0.95
    _, few = g.search(rows, 10, 2)
    assert (few == np.arange(0, 4000, 13)[:, None]).any(axis=1).mean() >= 0.5


def test_coarse_lists_hold_every_vector_once(npy: Path, tmp_path: Path) -> None:
    import faiss  # after service (imported above): its OpenMP runtime starts with OMP_WAIT_POLICY set

    source = NpySource(npy)
    params = resolve(source.ntotal, source.dim, nlist=40, pq_m=16, two_level=True, chunk_size=999)
    build_gallery(source, tmp_path / "g", params, progress=False, log=lambda _: None)
    index = faiss.read_index(str(tmp_path / "g" / "index.faiss"))
    invlists = faiss.extract_index_ivf(index).invlists
    ids = np.concatenate(
        [faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy() for i in range(invlists.nlist)]
    )
    assert np.array_equal(np.sort(ids), np.arange(source.ntotal))


def test_eval_on_a_sub_gallery_reports_recall_per_nprobe(npy: Path, tmp_path: Path) -> None:
    source = NpySource(npy)
    build_gallery(source, tmp_path / "g", resolve(4000, 64, nlist=16, pq_m=16), progress=False, log=lambda _: None)
    g = Gallery.load(tmp_path / "g")
    report = evaluate_gallery(g, source_of(g), queries=60, nprobes=(1, 4, 16, 99), sample=1000, batch=32)
    assert [p.nprobe for p in report.probes] == [1, 4, 16]  # nprobe above nlist is skipped
    assert report.sub_gallery == 1000 and report.queries == 60
    recall = [p.recall_at_10 for p in report.probes]
    assert recall[0] <= recall[1] <= recall[2] and recall[2] >= 0.8, recall
    assert all(p.single_p50_ms > 0 and p.batch_ms_per_query > 0 for p in report.probes)
    assert "p50" in format_report(report)


def test_cheap_verification_checks_size_and_both_ends(npy: Path, tmp_path: Path) -> None:
    from service.errors import ArtifactError

    source = NpySource(npy)
    out = tmp_path / "g"
    build_gallery(source, out, resolve(4000, 64, nlist=8, pq_m=8), progress=False, log=lambda _: None)
    index = out / "index.faiss"
    data = bytearray(index.read_bytes())
    data[100] ^= 0xFF  # inside the first MiB (here the whole file is smaller than 2 MiB)
    index.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="fingerprint"):
        Gallery.load(out, verify="size")
    with pytest.raises(ArtifactError, match="fingerprint"):
        Gallery.load(out)
    data[100] ^= 0xFF
    index.write_bytes(bytes(data))
    assert Gallery.load(out, verify="size").ntotal == Gallery.load(out).ntotal == 4000
