"""`nobackfill gallery build/info/eval` and `Gallery` end to end: real FAISS, real synthetic encoder, real files.

One small synthetic gallery is built once per module by a `nobackfill` subprocess and copied for the
tests that damage it.  The other commands run in-process through `service.cli.main` (the same
argument parsing, error rendering and exit codes, without paying a Python + torch start per call);
the `.npy` tests use tiny 64-d galleries so they build in a second or two.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt
import pytest

from service.encoders.synthetic import SyntheticNewEncoder
from service.errors import ArtifactError, InputError
from service.index.gallery import Gallery
from tests.support.cli import Done, cli, run_cli

NOBACKFILL = [sys.executable, "-m", "service.cli"]
SIZE = 8_000
NLIST = 32
PQ_M = 16
NPY_ROWS = 3_000
NPY_DIM = 64


def ok(*args: str | int | Path) -> Done:
    """Run `nobackfill ARGS` in-process and fail the test with its stderr unless it exits 0."""
    done = cli(*args)
    if done.returncode != 0:
        pytest.fail(f"nobackfill {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


def assert_refused(done: Done | subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit 2 with one `error: ...` line (the last on stderr, after any progress output) naming `words`."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), done.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1, done.stderr
    message = lines[-1]
    for word in words:
        assert word.lower() in message.lower(), message
    return message


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def no_leftovers(parent: Path) -> None:
    """A finished or failed build leaves no hidden temporary folders beside its target."""
    hidden = [p.name for p in parent.iterdir() if p.name.startswith(".")]
    assert hidden == [], hidden


def old_embeddings(ids: npt.NDArray[np.int64], view: int) -> npt.NDArray[np.float32]:
    """Old-encoder embeddings of these items in one view (the gallery holds the image view)."""
    from service.encoders.synthetic import SyntheticOldEncoder

    return SyntheticOldEncoder().encode_items(ids, view)


def clustered(rows: int, dim: int, seed: int) -> npt.NDArray[np.float32]:
    """Clustered, NOT normalised float32 rows (the builder must normalise them)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((40, dim))
    x = centres[rng.integers(0, 40, rows)] + 0.5 * rng.standard_normal((rows, dim))
    return (x * rng.uniform(0.5, 3.0, (rows, 1))).astype(np.float32)


def unit(x: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Rows scaled to unit length, as float32."""
    rows = np.asarray(x, dtype=np.float32)
    out: npt.NDArray[np.float32] = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return out


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8,000-item synthetic gallery (nlist 32, PQ16x8) built through the CLI."""
    out = tmp_path_factory.mktemp("synthetic") / "gallery"
    options = ["--size", SIZE, "--out", out, "--nlist", NLIST, "--pq-m", PQ_M, "--train-size", 4096]
    run_cli("gallery", "build", *map(str, options))
    return out


@pytest.fixture(scope="module")
def gallery(built: Path) -> Gallery:
    """The synthetic gallery, loaded once."""
    return Gallery.load(built)


@pytest.fixture
def damaged(built: Path, tmp_path: Path) -> Path:
    """A private copy of the synthetic gallery that a test may break."""
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    return copy


@pytest.fixture(scope="module")
def npy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 clustered, un-normalised 64-d float32 rows in one .npy file."""
    path = tmp_path_factory.mktemp("npy") / "emb.npy"
    np.save(path, clustered(NPY_ROWS, NPY_DIM, seed=1))
    return path


def npy_build(src: Path, out: Path, *extra: str | int) -> Done:
    """`gallery build --from-npy` with options sized for the tiny 64-d galleries."""
    return cli("gallery", "build", "--from-npy", src, "--out", out, "--nlist", 8, "--pq-m", 8, *extra)


@pytest.fixture(scope="module")
def npy_gallery(npy_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gallery of npy_file (nlist 8, PQ8x8), built once; tests that change it take a copy."""
    out = tmp_path_factory.mktemp("npy-gallery") / "gallery"
    ok("gallery", "build", "--from-npy", npy_file, "--out", out, "--nlist", 8, "--pq-m", 8)
    return out


# --------------------------------------------------------------------------- build and load


def test_build_writes_a_complete_fingerprinted_gallery(built: Path) -> None:
    assert sorted(p.name for p in built.iterdir()) == ["gallery.json", "index.faiss", "manifest.json"]
    no_leftovers(built.parent)
    meta = json.loads((built / "gallery.json").read_text())
    index = built / "index.faiss"
    assert meta["sha256"] == sha256(index)
    assert meta["index_bytes"] == index.stat().st_size
    expected = {"d": 512, "ntotal": SIZE, "nlist": NLIST, "M": PQ_M, "nbits": 8, "opq": False}
    assert {key: meta[key] for key in expected} == expected
    assert meta["metric"] == "inner_product"
    assert meta["old_model_id"] == "synthetic-old"
    assert meta["source"]["kind"] == "synthetic"
    assert meta["created_at"] and meta["build"]["total_s"] >= 0


def test_load_maps_the_index_read_only(gallery: Gallery, built: Path) -> None:
    meta = json.loads((built / "gallery.json").read_text())
    assert (gallery.dim, gallery.ntotal, gallery.nlist) == (512, SIZE, NLIST)
    assert gallery.fingerprint == meta["sha256"] == sha256(built / "index.faiss")
    assert gallery.meta["ntotal"] == SIZE
    if sys.platform.startswith("linux"):
        # The inverted lists are a read-only shared mapping of index.faiss, not a private copy.
        target = str((built / "index.faiss").resolve())
        maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(target)]
        assert maps, "index.faiss is not memory-mapped"
        assert all("w" not in fields[1] for fields in maps), maps


def test_search_finds_each_items_own_image_embedding(gallery: Gallery) -> None:
    ids = np.arange(0, SIZE, 37, dtype=np.int64)
    scores, found = gallery.search(old_embeddings(ids, -1), 10, 8)
    assert scores.shape == found.shape == (ids.size, 10)
    assert scores.dtype == np.float32 and found.dtype == np.int64
    assert np.all(np.diff(scores, axis=1) <= 1e-6), "scores are not sorted best first"
    assert (found == ids[:, None]).any(axis=1).mean() >= 0.95
    assert (found[:, 0] == ids).mean() >= 0.8


def test_graph_coarse_quantizer_picks_the_same_lists(built: Path, gallery: Gallery) -> None:
    # With efSearch >= nlist the graph over the centroids finds the exact nprobe best lists, so the
    # answers equal the flat quantizer's; the index file and its fingerprint are untouched.
    graph = Gallery.load(built, coarse="hnsw", graph_ef=NLIST)
    assert graph.coarse == "hnsw" and gallery.coarse == "flat"
    quantizer = faiss.downcast_index(faiss.extract_index_ivf(graph.faiss_index).quantizer)
    assert isinstance(quantizer, faiss.IndexHNSWFlat) and quantizer.ntotal == NLIST
    assert Gallery.load(built, coarse="auto").coarse == "flat"  # 32 lists: the flat scan is cheap
    assert graph.fingerprint == gallery.fingerprint
    queries = old_embeddings(np.arange(0, SIZE, 53, dtype=np.int64), 2)
    for nprobe in (1, 4, 8):
        expected_scores, expected_ids = gallery.search(queries, 10, nprobe)
        scores, ids = graph.search(queries, 10, nprobe)
        np.testing.assert_array_equal(ids, expected_ids)
        np.testing.assert_allclose(scores, expected_scores, rtol=1e-6)
    with pytest.raises(InputError, match="coarse"):
        Gallery.load(built, coarse="tree")  # type: ignore[arg-type]


def _exact_top10(queries: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
    """Exact inner-product top-10 over the gallery's true (un-quantised) embeddings."""
    base = old_embeddings(np.arange(SIZE, dtype=np.int64), -1)
    return np.argsort(-(queries @ base.T), axis=1)[:, :10].astype(np.int64)


def _recall10(found: npt.NDArray[np.int64], exact: npt.NDArray[np.int64]) -> float:
    """Mean share of the exact top-10 that the approximate top-10 recovers."""
    return float(np.mean([np.intersect1d(a, b).size / 10 for a, b in zip(found, exact, strict=True)]))


def test_nprobe_is_per_call_and_more_probes_recall_more(gallery: Gallery) -> None:
    items = np.arange(3, SIZE, 41, dtype=np.int64)
    queries = old_embeddings(items, 0)  # caption-0: a real query, not the stored vector
    exact = _exact_top10(queries)
    found = {p: gallery.search(queries, 10, p)[1] for p in (1, 4, NLIST)}
    recall = {p: _recall10(ids, exact) for p, ids in found.items()}
    # PQ16 (32 bytes for 512 dims) caps recall@10 vs exact near 0.35 here; what matters is that
    # nprobe takes effect per call and more lists never recall less.
    assert recall[1] <= recall[4] + 0.02 and recall[4] <= recall[NLIST] + 0.02, recall
    assert recall[NLIST] >= recall[1] + 0.05, recall
    # A caption finds its own item more often with every list probed than with one.
    own = {p: float((ids == items[:, None]).any(axis=1).mean()) for p, ids in found.items()}
    assert own[NLIST] >= own[1] + 0.05, own


def test_concurrent_searches_with_different_nprobe_do_not_interfere(gallery: Gallery) -> None:
    queries = old_embeddings(np.arange(5, SIZE, 97, dtype=np.int64), 1)
    expected = {p: gallery.search(queries, 10, p)[1] for p in (1, 2, 8, NLIST)}
    errors: list[str] = []

    def worker(p: int) -> None:
        for _ in range(20):
            if not np.array_equal(gallery.search(queries, 10, p)[1], expected[p]):
                errors.append(f"nprobe {p} changed under concurrency")
                return

    threads = [threading.Thread(target=worker, args=(p,)) for p in expected for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_searching_never_writes_the_gallery(built: Path) -> None:
    index = built / "index.faiss"
    before = (sha256(index), index.stat().st_mtime_ns, (built / "gallery.json").read_bytes())
    g = Gallery.load(built)
    queries = old_embeddings(np.arange(0, SIZE, 13, dtype=np.int64), 2)
    for p in (1, 7, NLIST):
        g.search(queries, 25, p)
    del g
    assert (sha256(index), index.stat().st_mtime_ns, (built / "gallery.json").read_bytes()) == before


def test_search_rejects_bad_arguments(gallery: Gallery) -> None:
    good = old_embeddings(np.arange(2, dtype=np.int64), -1)
    with pytest.raises(InputError):
        gallery.search(good[:, :100], 10, 4)
    with pytest.raises(InputError):
        gallery.search(good[0], 10, 4)
    for nprobe in (0, NLIST + 1):
        with pytest.raises(InputError):
            gallery.search(good, 10, nprobe)
    with pytest.raises(InputError):
        gallery.search(good, 0, 4)
    scores, ids = gallery.search(good[:0], 5, 4)
    assert scores.shape == ids.shape == (0, 5)


# --------------------------------------------------------------------------- damaged galleries


def test_flipped_bytes_are_refused(damaged: Path) -> None:
    index = damaged / "index.faiss"
    data = bytearray(index.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    index.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="fingerprint|sha256"):
        Gallery.load(damaged)


def test_truncated_index_is_refused(damaged: Path) -> None:
    index = damaged / "index.faiss"
    with index.open("r+b") as fh:
        fh.truncate(index.stat().st_size - 1000)
    with pytest.raises(ArtifactError, match="bytes|truncat"):
        Gallery.load(damaged)


def test_wrong_fingerprint_in_gallery_json_is_refused(damaged: Path) -> None:
    path = damaged / "gallery.json"
    meta = json.loads(path.read_text())
    meta["sha256"] = "0" * 64
    path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="fingerprint|sha256"):
        Gallery.load(damaged)


@pytest.mark.parametrize("missing", ["index.faiss", "gallery.json"])
def test_missing_files_are_refused(damaged: Path, missing: str) -> None:
    (damaged / missing).unlink()
    with pytest.raises(ArtifactError):
        Gallery.load(damaged)


def test_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError):
        Gallery.load(tmp_path / "nowhere")


# --------------------------------------------------------------------------- refusals at build time


def test_existing_gallery_is_refused_without_force(built: Path) -> None:
    before = sha256(built / "index.faiss")
    done = cli("gallery", "build", "--size", 2000, "--out", built, "--nlist", 8, "--pq-m", 8)
    assert_refused(done, "--force")
    assert sha256(built / "index.faiss") == before


def test_force_replaces_a_gallery(npy_file: Path, npy_gallery: Path, tmp_path: Path) -> None:
    out = tmp_path / "g"
    shutil.copytree(npy_gallery, out)
    first = Gallery.load(out).fingerprint
    ok("gallery", "build", "--from-npy", npy_file, "--out", out, "--nlist", 4, "--pq-m", 8, "--force")
    replaced = Gallery.load(out)
    assert replaced.nlist == 4 and replaced.fingerprint != first
    no_leftovers(tmp_path)


def test_force_never_wipes_a_folder_that_is_not_a_gallery(npy_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert_refused(npy_build(npy_file, out, "--force"))
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--size", 0], ["size"]),
        (["--size", -5], ["size"]),
        (["--size", 100, "--nlist", 64], []),
        (["--size", 1000, "--train-size", 5000], ["train"]),
        (["--size", 2000, "--pq-m", 7], ["pq-m"]),
        (["--size", 2000, "--synthetic-model", "newest"], ["old or new"]),
        ([], []),
    ],
)
def test_bad_sizes_are_refused(tmp_path: Path, args: list[str | int], words: list[str]) -> None:
    out = tmp_path / "g"
    assert_refused(cli("gallery", "build", "--out", out, *args), *words)
    assert not out.exists()
    no_leftovers(tmp_path)


def test_synthetic_new_model_builds_the_reindexed_baseline(tmp_path: Path) -> None:
    # What a full backfill would give: the same items through the NEW model (768-d), for benchmarks.
    out = tmp_path / "new"
    ok("gallery", "build", "--size", 2000, "--synthetic-model", "new", "--out", out, "--nlist", 8, "--pq-m", 8)
    gallery = Gallery.load(out)
    assert gallery.dim == SyntheticNewEncoder().dim == 768 and gallery.ntotal == 2000
    item = SyntheticNewEncoder().encode_items([7])
    _, ids = gallery.search(item, 5, 8)
    assert 7 in ids[0].tolist()


def test_unwritable_output_is_refused(tmp_path: Path, npy_file: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    assert_refused(npy_build(npy_file, blocker / "g"))
    if os.geteuid() != 0:  # root writes anywhere; the read-only folder case only bites other users
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert_refused(npy_build(npy_file, locked / "g"))


# --------------------------------------------------------------------------- the user's own .npy embeddings


def _own_rows_found(out: Path, rows: npt.NDArray[np.float32], sample: npt.NDArray[np.int64]) -> float:
    """Share of sampled rows whose own id comes back in the top 10."""
    g = Gallery.load(out)
    _, found = g.search(unit(rows[sample]), 10, g.nlist)
    return float((found == sample[:, None]).any(axis=1).mean())


def test_from_npy_file_builds_normalised_gallery(npy_file: Path, npy_gallery: Path) -> None:
    g = Gallery.load(npy_gallery)
    assert (g.dim, g.ntotal, g.nlist) == (NPY_DIM, NPY_ROWS, 8)
    assert g.meta["source"]["kind"] == "npy"
    rows = np.load(npy_file)
    sample = np.arange(0, NPY_ROWS, 17, dtype=np.int64)
    assert _own_rows_found(npy_gallery, rows, sample) >= 0.95
    # Rows were L2-normalised before encoding: a row's score against itself is close to 1, not |x|^2.
    scores, _ = g.search(unit(rows[sample]), 1, 8)
    assert np.all(scores[:, 0] < 1.2) and np.median(scores[:, 0]) > 0.8


def test_from_npy_shard_folder_numbers_rows_globally_and_takes_float16(tmp_path: Path) -> None:
    rows = clustered(NPY_ROWS, NPY_DIM, seed=3)
    shards = tmp_path / "shards"
    shards.mkdir()
    np.save(shards / "part-000.npy", rows[:1000])
    np.save(shards / "part-001.npy", rows[1000:2500].astype(np.float16))  # float16 is accepted too
    np.save(shards / "part-002.npy", rows[2500:])
    out = tmp_path / "g"
    ok("gallery", "build", "--from-npy", shards, "--out", out, "--nlist", 8, "--pq-m", 8)
    assert Gallery.load(out).ntotal == NPY_ROWS
    # Ids are global row numbers in file-name order, across shard boundaries.
    assert _own_rows_found(out, rows, np.array([0, 999, 1000, 1700, 2499, 2500, 2999], dtype=np.int64)) == 1.0


def _write(path: Path, array: npt.NDArray[Any]) -> Path:
    np.save(path, array)
    return path


def test_from_npy_refuses_nan_rows_with_exit_2_and_one_line(tmp_path: Path) -> None:
    rows = clustered(2000, NPY_DIM, seed=4)
    rows[1234, 5] = np.nan
    src = _write(tmp_path / "nan.npy", rows)
    out = tmp_path / "g"
    # A real process, to check the user-facing rendering: exit 2 and one `error:` line, no traceback.
    done = run_cli("gallery", "build", "--from-npy", src, "--out", out, "--nlist", "8", "--pq-m", "8", check=False)
    assert_refused(done, "nan", "1234")
    assert not out.exists()
    no_leftovers(tmp_path)


def test_from_npy_refuses_int_dtype(tmp_path: Path) -> None:
    src = _write(tmp_path / "int.npy", np.ones((2000, NPY_DIM), dtype=np.int32))
    assert_refused(npy_build(src, tmp_path / "g"), "dtype")
    assert not (tmp_path / "g").exists()


def test_from_npy_refuses_wrong_shapes(tmp_path: Path) -> None:
    flat = _write(tmp_path / "flat.npy", clustered(2000, NPY_DIM, seed=5).reshape(-1))
    assert_refused(npy_build(flat, tmp_path / "g1"), "shape")
    shards = tmp_path / "mixed"
    shards.mkdir()
    _write(shards / "a.npy", clustered(1000, NPY_DIM, seed=6))
    _write(shards / "b.npy", clustered(1000, NPY_DIM + 8, seed=7))
    assert_refused(npy_build(shards, tmp_path / "g2"), "dimension")
    assert not (tmp_path / "g1").exists() and not (tmp_path / "g2").exists()


@pytest.mark.parametrize("kind", ["empty folder", "missing file", "not npy"])
def test_from_npy_refuses_unreadable_sources(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "src"
    if kind == "empty folder":
        src.mkdir()
    elif kind == "not npy":
        src = tmp_path / "junk.npy"
        src.write_bytes(b"not an npy file at all")
    assert_refused(npy_build(src, tmp_path / "g"))
    assert not (tmp_path / "g").exists()


# --------------------------------------------------------------------------- interrupted builds


class _FailingSource:
    """Wraps a source; reading the gallery rows (not the training sample) fails after the first chunk."""

    def __init__(self, inner: Any, chunk: int, error: BaseException) -> None:
        self.inner, self.chunk, self.error = inner, chunk, error
        self.ntotal, self.dim, self.model_id = inner.ntotal, inner.dim, inner.model_id

    def describe(self) -> dict[str, Any]:
        return dict(self.inner.describe())

    def ids(self, start: int, stop: int) -> npt.NDArray[np.int64]:
        return np.asarray(self.inner.ids(start, stop), dtype=np.int64)

    def rows(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        contiguous = positions.size > 1 and bool(np.all(np.diff(positions) == 1))
        if contiguous and int(positions[0]) >= self.chunk:
            raise self.error
        return np.asarray(self.inner.rows(positions), dtype=np.float32)


@pytest.mark.parametrize("error", [InputError("shard 2 is bad"), KeyboardInterrupt()], ids=["bad-shard", "ctrl-c"])
def test_interrupted_build_leaves_nothing_that_looks_valid(
    npy_file: Path, npy_gallery: Path, tmp_path: Path, error: BaseException
) -> None:
    from service.index.build import build_gallery
    from service.index.params import resolve
    from service.index.sources import NpySource

    inner = NpySource(npy_file)
    params = resolve(inner.ntotal, inner.dim, nlist=8, pq_m=8, train_size=1000, chunk_size=1000)
    failing = _FailingSource(inner, 1000, error)
    fresh = tmp_path / "fresh"
    with pytest.raises(type(error)):
        build_gallery(failing, fresh, params, progress=False, log=lambda _: None)
    assert not fresh.exists()
    no_leftovers(tmp_path)

    # A failed --force rebuild keeps the gallery that was there, byte for byte.
    kept = tmp_path / "kept"
    shutil.copytree(npy_gallery, kept)
    before = sha256(kept / "index.faiss")
    with pytest.raises(type(error)):
        build_gallery(failing, kept, params, force=True, progress=False, log=lambda _: None)
    assert sha256(kept / "index.faiss") == before == Gallery.load(kept).fingerprint
    no_leftovers(tmp_path)


# --------------------------------------------------------------------------- info and eval


def test_info_prints_the_gallery(built: Path) -> None:
    done = ok("gallery", "info", built)
    meta = json.loads((built / "gallery.json").read_text())
    for text in (str(NLIST), meta["sha256"][:12], "synthetic-old"):
        assert text in done.stdout, done.stdout


def test_info_refuses_a_non_gallery(tmp_path: Path) -> None:
    assert_refused(cli("gallery", "info", tmp_path))


def test_eval_reports_recall_and_latency_per_nprobe(built: Path) -> None:
    done = ok("gallery", "eval", built, "--queries", 50, "--nprobe", "1,8", "--sample", 2000)
    text = done.stdout.lower()
    assert "recall" in text and "p50" in text, done.stdout
    for nprobe in ("1", "8"):
        assert nprobe in done.stdout
    report = json.loads(
        ok("gallery", "eval", built, "--queries", 50, "--nprobe", "1,8", "--sample", 2000, "--json").stdout
    )
    by_nprobe = {p["nprobe"]: p["recall_at_10"] for p in report["probes"]}
    best = max(by_nprobe.values())
    wanted = min(n for n, recall in by_nprobe.items() if recall >= best - 0.01)
    assert report["recommended_nprobe"] == wanted
    assert f"recommended: NOBACKFILL_INDEX__NPROBE={wanted} " in done.stdout  # recall is seeded: the same twice


def test_eval_works_on_an_npy_gallery(npy_gallery: Path) -> None:
    done = ok("gallery", "eval", npy_gallery, "--queries", 30, "--nprobe", "2,8", "--sample", 1000)
    assert "recall" in done.stdout.lower(), done.stdout


def test_eval_refuses_bad_nprobe_lists(built: Path) -> None:
    assert_refused(cli("gallery", "eval", built, "--queries", 10, "--nprobe", "four"), "nprobe")


def test_quick_verify_still_catches_damage_at_the_ends(damaged: Path) -> None:
    index = damaged / "index.faiss"
    data = bytearray(index.read_bytes())
    data[-100:-92] = bytes(b ^ 0xFF for b in data[-100:-92])
    index.write_bytes(bytes(data))
    # verify="size" (fast restarts) hashes only the first and last MiB, so this must still be caught.
    with pytest.raises(ArtifactError, match="fingerprint"):
        Gallery.load(damaged, verify="size")


def test_too_few_training_vectors_for_the_lists_is_one_note_not_a_faiss_warning(tmp_path: Path) -> None:
    done = run_cli("gallery", "build", "--size", "3000", "--nlist", "256", "--out", tmp_path / "g")
    assert "WARNING clustering" not in done.stderr, done.stderr  # faiss's own, printed from C
    notes = [line for line in done.stderr.splitlines() if line.startswith("note: 3,000 training vectors for 256")]
    assert len(notes) == 1 and "faiss advises 9,984" in notes[0], done.stderr
