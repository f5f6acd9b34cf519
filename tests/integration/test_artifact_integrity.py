"""Tampered, truncated and mismatched artifacts are refused at load, at startup and at reload, in one line.

A tiny real gallery (FAISS IVF-PQ, 32-d) and a Procrustes profile (32 <- 48) are built once; each test
damages a copy.  Startup and reload go through a real Pipeline (`external` encoders, so no model
loads): startup must refuse, reload must refuse and keep serving the profile it had.  A profile whose
manifest was re-signed after the edit still meets the field and range checks of profile.py.
NOBACKFILL_TAMPER_FLIPS=N sets how many random single-byte flips per file the sweep tries (default 8).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from service.compat.profile import MANIFEST_NAME, PROFILE_JSON, TENSORS, CompatProfile, load_profile, save_profile
from service.compat.psp import correction_matrix
from service.errors import ArtifactError
from service.index.build import build_gallery
from service.index.gallery import Gallery
from service.index.params import resolve
from service.index.sources import NpySource
from service.manifest import sha256_of, write_manifest
from service.pipeline import Pipeline, Query
from service.settings import CacheSettings, CompatSettings, EncoderSettings, IndexSettings, Settings

D_OLD, D_NEW = 32, 48
FLIPS = int(os.environ.get("NOBACKFILL_TAMPER_FLIPS", "8"))


def _flip(path: Path, at: float = 0.5) -> None:
    """Invert one byte of a file, at a fraction of its length."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _refused(call: Callable[[], Any], *needles: str) -> str:
    """The one-line ArtifactError message of call(), which must name every needle."""
    with pytest.raises(ArtifactError) as info:
        call()
    message = info.value.message
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    rng = np.random.default_rng(0)
    np.save(root / "rows.npy", rng.standard_normal((2000, D_OLD)).astype(np.float32))
    params = resolve(2000, D_OLD, nlist=8, pq_m=8, train_size=1000, chunk_size=1000)
    build_gallery(NpySource(root / "rows.npy"), root / "gallery", params, progress=False, log=lambda _: None)
    save_profile(_procrustes(rng), root / "profile")
    return {"root": root, "gallery": root / "gallery", "profile": root / "profile"}


def _procrustes(rng: np.random.Generator, **changes: Any) -> CompatProfile:
    q, r = np.linalg.qr(rng.standard_normal((D_NEW, D_NEW)))
    params = {"slerp": {"alpha": 0.4}, "nlerp": {"alpha": 0.5}, "adaptive": {"a": 0.5, "b": 1.0, "c_ref": 0.3}}
    fields: dict[str, Any] = {
        "head": "slerp",
        "old_model_id": "old-m",
        "new_model_id": "new-m",
        "old_dim": D_OLD,
        "new_dim": D_NEW,
        "alphas": {"text": 0.4},
        "params": {"text": params},
        "fit_on": "both",
        "folds": 2,
        "fit_report": {},
        "tensors": {"R": (q * np.sign(np.diag(r))).astype(np.float32)},
    }
    return CompatProfile(**{**fields, **changes})


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _settings(gallery: Path, profile: Path, old_dim: int = D_OLD) -> Settings:
    return Settings(
        old=EncoderSettings(backend="external", dim=old_dim, model_id="old-m"),
        new=EncoderSettings(backend="external", dim=D_NEW, model_id="new-m"),
        index=IndexSettings(gallery_dir=gallery, coarse="flat"),
        compat=CompatSettings(profile_dir=profile),
        cache=CacheSettings(redis_url=None, lru_size=100),
    )


# -- the profile: what the manifest catches ------------------------------------------------------------

PROFILE_DAMAGE: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "byte in the tensors": (lambda p: _flip(p / TENSORS), (TENSORS, "sha256", MANIFEST_NAME)),
    "byte in profile.json": (lambda p: _flip(p / PROFILE_JSON, 0.3), (PROFILE_JSON, "sha256", MANIFEST_NAME)),
    "truncated tensors": (lambda p: _truncate(p / TENSORS), (TENSORS, "truncated")),
    "truncated profile.json": (lambda p: _truncate(p / PROFILE_JSON), (PROFILE_JSON, "truncated")),
    "manifest deleted": (lambda p: (p / MANIFEST_NAME).unlink(), (MANIFEST_NAME, "missing")),
    "manifest garbled": (lambda p: (p / MANIFEST_NAME).write_text("{"), (MANIFEST_NAME, "unreadable")),
    "file added": (lambda p: (p / "extra.bin").write_bytes(b"x"), ("extra.bin", "not in manifest.json")),
    "file removed": (lambda p: (p / TENSORS).unlink(), (TENSORS, "missing")),
}


@pytest.mark.parametrize("damage", list(PROFILE_DAMAGE))
def test_damaged_profile_is_refused_at_load(artifacts: dict[str, Path], tmp_path: Path, damage: str) -> None:
    edit, needles = PROFILE_DAMAGE[damage]
    folder = _copy(artifacts["profile"], tmp_path / "p")
    edit(folder)
    _refused(lambda: load_profile(folder), *needles)


@pytest.mark.parametrize("damage", ["byte in the tensors", "byte in profile.json", "truncated tensors"])
async def test_damaged_profile_is_refused_at_startup_and_reload(
    artifacts: dict[str, Path], tmp_path: Path, damage: str
) -> None:
    edit, needles = PROFILE_DAMAGE[damage]
    folder = _copy(artifacts["profile"], tmp_path / "p")
    edit(folder)
    settings = _settings(artifacts["gallery"], folder)
    with pytest.raises(ArtifactError) as info:
        await Pipeline.build(settings)
    assert all(n in info.value.message for n in needles) and "\n" not in info.value.message

    pipeline = await Pipeline.build(_settings(artifacts["gallery"], artifacts["profile"]))
    try:
        serving = pipeline.profile
        query = Query("text", old_embedding=np.ones(D_OLD, np.float32), new_embedding=np.full(D_NEW, 0.5, np.float32))
        before = (await pipeline.search([query], k=5)).results[0].ids
        with pytest.raises(ArtifactError) as info:
            await pipeline.reload_profile(folder)
        assert all(n in info.value.message for n in needles)
        assert pipeline.profile is serving  # the failed reload kept the current profile
        assert (await pipeline.search([query], k=5)).results[0].ids == before
    finally:
        await pipeline.aclose()


# -- the profile: what the field checks catch once the manifest is re-signed ---------------------------


def _edit_json(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        meta = json.loads((folder / PROFILE_JSON).read_text())
        change(meta)
        (folder / PROFILE_JSON).write_text(json.dumps(meta))

    return edit


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(meta: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = meta
        for key in parents:
            node = node[key]
        node[last] = value

    return change


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def change(meta: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = meta
        for key in parents:
            node = node[key]
        del node[last]

    return change


RESIGNED: dict[str, tuple[Callable[[Path], None], str]] = {
    "alpha 1.5": (_edit_json(_set("alphas.text", 1.5)), "outside [0, 1]"),
    "slerp alpha -0.1": (_edit_json(_set("params.text.slerp.alpha", -0.1)), "slerp alpha"),
    "nlerp alpha missing": (_edit_json(_drop("params.text.nlerp.alpha")), "lack alpha"),
    "adaptive a 2": (_edit_json(_set("params.text.adaptive.a", 2.0)), "adaptive a"),
    "adaptive c_ref 1.5": (_edit_json(_set("params.text.adaptive.c_ref", 1.5)), "c_ref"),
    "adaptive b missing": (_edit_json(_drop("params.text.adaptive.b")), "lack b"),
    "adaptive b huge": (_edit_json(_set("params.text.adaptive.b", 1e309)), "not valid JSON"),
    "own head params missing": (_edit_json(_drop("params.text.slerp")), "no slerp parameters"),
    "NaN literal": (lambda p: _nan_alpha(p), "not valid JSON"),
    "alpha as a string": (_edit_json(_set("alphas.text", "0.4")), "must be a number"),
    "old_dim as a string": (_edit_json(_set("old_dim", "32")), "old_dim"),
    "old_dim 32.5": (_edit_json(_set("old_dim", 32.5)), "old_dim"),
    "old_dim true": (_edit_json(_set("old_dim", True)), "old_dim"),
    "new_dim 16": (_edit_json(_set("new_dim", 16)), "R has shape"),
    "unknown head": (_edit_json(_set("head", "bogus")), "unknown head"),
    "format 99": (_edit_json(_set("format_version", 99)), "format_version"),
    "not orthogonal": (lambda p: save_file({"R": np.eye(D_NEW, dtype=np.float32) * 2}, str(p / TENSORS)), "orthogonal"),
}


def _nan_alpha(folder: Path) -> None:
    text = (folder / PROFILE_JSON).read_text().replace('"alpha": 0.4', '"alpha": NaN', 1)
    (folder / PROFILE_JSON).write_text(text)


@pytest.mark.parametrize("case", list(RESIGNED))
def test_out_of_range_fields_are_refused_even_when_re_signed(
    artifacts: dict[str, Path], tmp_path: Path, case: str
) -> None:
    edit, needle = RESIGNED[case]
    folder = _copy(artifacts["profile"], tmp_path / "p")
    edit(folder)
    if case == "not orthogonal":  # profile.json must agree with the new tensors for the R check to be reached
        _edit_json(_set("tensors_sha256", sha256_of(folder / TENSORS)))(folder)
    write_manifest(folder)
    name = TENSORS if case in ("not orthogonal", "new_dim 16") else PROFILE_JSON
    _refused(lambda: load_profile(folder), name, needle)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (_set("classes.old_classes", 5.0), "old_classes"),
        (_set("classes.top_k", 0), "top_k"),
        (_set("classes.class_map", [0, 0, 1, 2, 3]), "distinct"),
        (_set("classes.class_map", [0, 1, 2, 3, "4"]), "class_map"),
    ],
)
def test_psp_class_blocks_are_checked(tmp_path: Path, change: Callable[[dict[str, Any]], None], needle: str) -> None:
    psp = CompatProfile(
        "psp",
        "o",
        "n",
        5,
        10,
        {},
        {},
        "both",
        0,
        {},
        {"P_tk": correction_matrix(5, 10).astype(np.float32)},
        classes={"old_classes": 5, "new_classes": 10, "top_k": None, "class_map": None},
    )
    save_profile(psp, tmp_path / "p")
    assert load_profile(tmp_path / "p").old_classes == 5
    _edit_json(change)(tmp_path / "p")
    write_manifest(tmp_path / "p")
    _refused(lambda: load_profile(tmp_path / "p"), PROFILE_JSON, needle)


def test_profiles_from_before_manifests_load_with_a_warning(
    artifacts: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _copy(artifacts["profile"], tmp_path / "p")
    (folder / MANIFEST_NAME).unlink()
    _refused(lambda: load_profile(folder), MANIFEST_NAME, "missing")  # format 3 must have one
    _edit_json(_set("format_version", 2))(folder)
    with caplog.at_level(logging.WARNING, logger="service.compat.profile"):
        assert load_profile(folder).head == "slerp"
    assert any("without manifest.json" in r.getMessage() for r in caplog.records)
    _flip(folder / TENSORS)  # their tensors are still covered by profile.json's tensors_sha256
    _refused(lambda: load_profile(folder), TENSORS, "sha256", PROFILE_JSON)


async def test_wrong_dims_are_refused_at_startup_and_reload(artifacts: dict[str, Path], tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    q = np.linalg.qr(rng.standard_normal((D_NEW, D_NEW)))[0].astype(np.float32)
    narrow = save_profile(_procrustes(rng, old_dim=24, tensors={"R": q}), tmp_path / "narrow")
    assert narrow.old_dim == 24
    message = _refused(lambda: load_profile(tmp_path / "narrow", old_dim=D_OLD), "old_dim 24", str(D_OLD))
    assert "profile" in message
    with pytest.raises(ArtifactError, match="profile"):
        await Pipeline.build(_settings(artifacts["gallery"], tmp_path / "narrow"))
    with pytest.raises(ArtifactError, match="gallery"):  # a 24-d old encoder against the 32-d gallery
        await Pipeline.build(_settings(artifacts["gallery"], artifacts["profile"], old_dim=24))
    pipeline = await Pipeline.build(_settings(artifacts["gallery"], artifacts["profile"]))
    try:
        serving = pipeline.profile
        with pytest.raises(ArtifactError, match="24"):
            await pipeline.reload_profile(tmp_path / "narrow")
        assert pipeline.profile is serving
    finally:
        await pipeline.aclose()


# -- the gallery -----------------------------------------------------------------------------------------

GALLERY_DAMAGE: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "byte in index.faiss": (lambda g: _flip(g / "index.faiss"), ("index.faiss", "fingerprint")),
    "byte in gallery.json": (lambda g: _flip(g / "gallery.json", 0.2), ("gallery.json", "sha256", MANIFEST_NAME)),
    "truncated index.faiss": (lambda g: _truncate(g / "index.faiss"), ("index.faiss", "truncated")),
    "truncated gallery.json": (lambda g: _truncate(g / "gallery.json"), ("gallery.json", "truncated")),
    "manifest deleted": (lambda g: (g / MANIFEST_NAME).unlink(), (MANIFEST_NAME, "missing")),
    "wrong dims": (lambda g: _resigned_gallery_edit(g, d=D_OLD + 1), ("gallery.json", "d 32 != 33")),
    "wrong ntotal": (lambda g: _resigned_gallery_edit(g, ntotal=1999), ("gallery.json", "ntotal 2000 != 1999")),
}


def _resigned_gallery_edit(folder: Path, **changes: Any) -> None:
    meta = json.loads((folder / "gallery.json").read_text())
    meta.update(changes)
    (folder / "gallery.json").write_text(json.dumps(meta))
    write_manifest(folder)


@pytest.mark.parametrize("damage", list(GALLERY_DAMAGE))
def test_damaged_gallery_is_refused_at_load(artifacts: dict[str, Path], tmp_path: Path, damage: str) -> None:
    edit, needles = GALLERY_DAMAGE[damage]
    folder = _copy(artifacts["gallery"], tmp_path / "g")
    edit(folder)
    _refused(lambda: Gallery.load(folder), *needles)


async def test_damaged_gallery_is_refused_at_startup(artifacts: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(artifacts["gallery"], tmp_path / "g")
    _flip(folder / "index.faiss", 0.9)
    with pytest.raises(ArtifactError, match="index.faiss"):
        await Pipeline.build(_settings(folder, artifacts["profile"]))


def test_galleries_from_before_manifests_load_with_a_warning(
    artifacts: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _copy(artifacts["gallery"], tmp_path / "g")
    (folder / MANIFEST_NAME).unlink()
    meta = json.loads((folder / "gallery.json").read_text())
    del meta["manifest"]
    (folder / "gallery.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="service.index.artifact"):
        assert Gallery.load(folder).ntotal == 2000
    assert any("without manifest.json" in r.getMessage() for r in caplog.records)
    _flip(folder / "index.faiss")  # the index is still checked against gallery.json's sha256
    _refused(lambda: Gallery.load(folder), "index.faiss", "fingerprint")


async def test_serving_and_reloading_never_change_a_gallery_file(artifacts: dict[str, Path]) -> None:
    files = sorted(p for p in artifacts["gallery"].iterdir())
    before = {p.name: sha256_of(p) for p in files}
    pipeline = await Pipeline.build(_settings(artifacts["gallery"], artifacts["profile"]))
    try:
        rng = np.random.default_rng(3)
        queries = [
            Query(
                "text",
                old_embedding=rng.standard_normal(D_OLD).astype(np.float32),
                new_embedding=rng.standard_normal(D_NEW).astype(np.float32),
            )
            for _ in range(32)
        ]
        for mode in ("old", "aligned", "slerp", "nlerp", "adaptive"):
            await pipeline.search(queries, k=10, mode=mode)
        await pipeline.reload_profile()
        await pipeline.reload_profile()
    finally:
        await pipeline.aclose()
    assert {p.name: sha256_of(p) for p in files} == before
    assert sorted(p.name for p in artifacts["gallery"].iterdir()) == sorted(before)


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("profile", PROFILE_JSON),
        ("profile", TENSORS),
        ("profile", MANIFEST_NAME),
        ("gallery", "gallery.json"),
        ("gallery", "index.faiss"),
        ("gallery", MANIFEST_NAME),
    ],
)
def test_any_flipped_byte_is_refused(artifacts: dict[str, Path], tmp_path: Path, kind: str, name: str) -> None:
    # A sweep over random positions: whichever byte of whichever file changes, the load refuses it.
    folder = _copy(artifacts[kind], tmp_path / "a")
    path = folder / name
    original = path.read_bytes()
    load = (lambda: load_profile(folder)) if kind == "profile" else (lambda: Gallery.load(folder))
    rng = np.random.default_rng(len(original))
    for at in rng.integers(0, len(original), size=FLIPS):
        damaged = bytearray(original)
        damaged[at] ^= 1 << int(rng.integers(0, 8))  # one bit: the smallest change there is
        path.write_bytes(bytes(damaged))
        _refused(load)
    path.write_bytes(original)
    load()
