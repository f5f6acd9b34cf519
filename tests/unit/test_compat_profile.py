"""Profile artifact (round trip, checksum, dims, atomic writes), heads.transform, support-set io and selection."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from service.compat import criteria, crossfit, curves, selection
from service.compat.fit_options import FitOptions
from service.compat.heads import transform
from service.compat.interpolation import nlerp, slerp
from service.compat.io import Split, load_split
from service.compat.metrics import ranks, recall_at_k, relevance
from service.compat.procrustes import align, normalize_rows, pad
from service.compat.profile import FORMAT_VERSION, TENSORS, CompatProfile, load_profile, save_profile
from service.errors import ArtifactError, InputError, UnsupportedMode
from service.manifest import MANIFEST_NAME, write_manifest
from service.vocabulary import FitOn
from tests.support.upgrade_standin import make_world, write_split


@pytest.fixture(scope="module")
def support(tmp_path_factory: pytest.TempPathFactory) -> Split:
    return load_split(write_split(tmp_path_factory.mktemp("support"), 600, make_world(8, 12, 6), seed=1))


@pytest.fixture(scope="module")
def fitted(support: Split) -> selection.FitResult:
    return selection.fit(support, FitOptions(folds=3))


def _profile(support: Split, fitted: selection.FitResult, head: str = "slerp") -> CompatProfile:
    return CompatProfile(
        head=head,
        old_model_id="old-m",
        new_model_id="new-m",
        old_dim=support.old_dim,
        new_dim=support.new_dim,
        alphas={"text": fitted.params["slerp"]["alpha"]},
        params={"text": fitted.params},
        fit_on="both",
        folds=3,
        fit_report=fitted.report,
        tensors={"R": fitted.rotation},
    )


def test_fit_report_contents(fitted: selection.FitResult, support: Split) -> None:
    rep = fitted.report
    assert rep["selection"] == "cross-fit" and rep["fit_blocks"] == ["query", "target"]
    assert [r["alpha"] for r in rep["support_recall"]["slerp"]] == list(curves.ALPHA_GRID)
    assert rep["eval_queries"] == len(support.old_query)
    assert set(rep["residual_angle_deg"]) == {"mean", "median", "p5", "p95"}
    assert (
        0 < rep["residual_angle_deg"]["p5"] <= rep["residual_angle_deg"]["median"] <= rep["residual_angle_deg"]["p95"]
    )
    assert rep["chosen"]["slerp"] == criteria.choose(rep["support_recall"]["slerp"], rep["criterion"])
    assert fitted.rotation.shape == (12, 12)


def test_same_set_and_fit_on_options(support: Split) -> None:
    same = selection.fit(support, FitOptions(same_set=True, fit_on=FitOn.query))
    assert same.report["selection"] == "same-set" and same.report["fit_blocks"] == ["query"]
    assert "residual_angle_deg_out_of_fold" not in same.report
    with pytest.raises(InputError, match="folds"):
        selection.fit(support, FitOptions(folds=1))


def test_the_same_set_report_carries_new_to_new_on_the_scored_rows(support: Split) -> None:
    same = selection.fit(support, FitOptions(same_set=True, fit_on=FitOn.query))
    rank = ranks(normalize_rows(support.new_query), normalize_rows(support.new_target), relevance(
        support.query_ids, support.target_ids))  # fmt: skip
    assert same.report["new_to_new"]["recall@1"] == pytest.approx(recall_at_k(rank)[1])
    assert same.report["new_to_new"]["recall@10"] == pytest.approx(recall_at_k(rank)[10])


def test_extra_files_made_from_the_saved_profile_name_its_final_id(
    tmp_path: Path, support: Split, fitted: selection.FitResult
) -> None:
    seen: list[str] = []

    def files(saved: CompatProfile) -> dict[str, bytes]:
        seen.append(saved.profile_id)
        return {"id.txt": saved.profile_id.encode()}

    unsaved = _profile(support, fitted)
    saved = save_profile(unsaved, tmp_path / "p", extra_files=files)
    assert seen == [saved.profile_id] and saved.profile_id != unsaved.profile_id  # the tensors' sha256 is in it
    assert (tmp_path / "p" / "id.txt").read_text() == load_profile(tmp_path / "p").profile_id


def test_profile_round_trip(tmp_path: Path, support: Split, fitted: selection.FitResult) -> None:
    saved = save_profile(_profile(support, fitted), tmp_path / "p", extra_files={"note.txt": b"hi"})
    loaded = load_profile(tmp_path / "p")
    assert loaded.profile_id == saved.profile_id and len(loaded.profile_id) == 12
    assert loaded.metadata() == saved.metadata()
    np.testing.assert_array_equal(loaded.rotation, fitted.rotation)
    assert loaded.modes() == ["old", "aligned", "slerp", "nlerp", "adaptive"]
    assert (tmp_path / "p" / "note.txt").read_bytes() == b"hi"
    meta = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION and meta["tensors_sha256"] == saved.tensors_sha256
    manifest = json.loads((tmp_path / "p" / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == ["note.txt", "profile.json", "tensors.safetensors"]
    assert manifest["files"]["tensors.safetensors"]["sha256"] == saved.tensors_sha256
    assert not list(tmp_path.glob(".p.*")), "no temporary folder left behind"


def test_checksum_mismatch_refused(tmp_path: Path, support: Split, fitted: selection.FitResult) -> None:
    save_profile(_profile(support, fitted), tmp_path / "p")
    save_file({"R": np.eye(12, dtype=np.float32)}, str(tmp_path / "p" / TENSORS))
    with pytest.raises(ArtifactError, match=r"tensors\.safetensors: .*manifest\.json"):
        load_profile(tmp_path / "p")
    write_manifest(tmp_path / "p")  # re-signed: profile.json's tensors_sha256 still disagrees
    with pytest.raises(ArtifactError, match=r"tensors\.safetensors: sha256 .*profile\.json"):
        load_profile(tmp_path / "p")


def test_dims_and_shape_checks(tmp_path: Path, support: Split, fitted: selection.FitResult) -> None:
    save_profile(_profile(support, fitted), tmp_path / "p")
    load_profile(tmp_path / "p", old_dim=8, new_dim=12)
    with pytest.raises(ArtifactError, match="old_dim 8"):
        load_profile(tmp_path / "p", old_dim=16)
    with pytest.raises(ArtifactError, match="new_dim 12"):
        load_profile(tmp_path / "p", new_dim=10)
    bad = _profile(support, fitted)
    bad.tensors["R"] = np.eye(10, dtype=np.float32)
    with pytest.raises(ArtifactError, match="shape"):
        save_profile(bad, tmp_path / "q")
    assert not (tmp_path / "q").exists()
    with pytest.raises(InputError, match="old_query.npy: dimension 8"):
        load_split(support.path, old_dim=9)


def test_missing_and_bad_format(tmp_path: Path, support: Split, fitted: selection.FitResult) -> None:
    with pytest.raises(ArtifactError, match="does not exist"):
        load_profile(tmp_path / "nope")
    save_profile(_profile(support, fitted), tmp_path / "p")
    meta = json.loads((tmp_path / "p" / "profile.json").read_text())
    meta["format_version"] = 99
    (tmp_path / "p" / "profile.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=r"profile\.json: .*manifest\.json"):
        load_profile(tmp_path / "p")
    write_manifest(tmp_path / "p")
    with pytest.raises(ArtifactError, match="format_version"):
        load_profile(tmp_path / "p")


def test_atomic_save_never_half_writes(tmp_path: Path, support: Split, fitted: selection.FitResult) -> None:
    first = save_profile(_profile(support, fitted), tmp_path / "p")
    with pytest.raises(ArtifactError, match="not empty"):
        save_profile(_profile(support, fitted, head="nlerp"), tmp_path / "p")
    with pytest.raises(OSError):
        save_profile(_profile(support, fitted, head="nlerp"), tmp_path / "p", overwrite=True, extra_files={"a/b": b""})
    assert load_profile(tmp_path / "p").profile_id == first.profile_id  # the old profile is intact
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p"]
    second = save_profile(_profile(support, fitted, head="nlerp"), tmp_path / "p", overwrite=True)
    assert load_profile(tmp_path / "p").head == "nlerp" and second.profile_id != first.profile_id


# -- heads.transform -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profile(support: Split, fitted: selection.FitResult) -> CompatProfile:
    return _profile(support, fitted)


def test_transform_modes(profile: CompatProfile, support: Split) -> None:
    old, new = support.old_query[:20], support.new_query[:20]
    u = pad(normalize_rows(old), profile.dim)
    v = align(new, profile.rotation, profile.old_dim)
    a = profile.params["text"]["slerp"]["alpha"]
    cases = {
        "old": (u, 0.0),
        "aligned": (v, 1.0),
        "slerp": (slerp(u, v, a), a),
        "nlerp": (nlerp(u, v, profile.params["text"]["nlerp"]["alpha"]), profile.params["text"]["nlerp"]["alpha"]),
    }
    for mode, (expected, alpha) in cases.items():
        out = transform(profile, mode, old, new, "text")
        assert out.queries.shape == (20, 8) and out.queries.dtype == np.float32
        np.testing.assert_allclose(out.queries, normalize_rows(expected[:, :8]), atol=1e-5)
        assert out.alpha == pytest.approx(alpha)
        np.testing.assert_allclose(np.linalg.norm(out.queries, axis=1), 1.0, atol=1e-5)
    theta = transform(profile, "slerp", old, new, "text").theta
    np.testing.assert_allclose(theta, np.arccos(np.clip(np.sum(u * v, axis=1), -1, 1)), atol=1e-3)
    adaptive = transform(profile, "adaptive", old, new, "text")
    assert adaptive.row_alpha.shape == (20,) and np.all((adaptive.row_alpha >= 0) & (adaptive.row_alpha <= 1))
    explicit = transform(profile, "slerp", old, new, "image", alpha=0.25)  # explicit alpha needs no fit
    np.testing.assert_allclose(explicit.queries, normalize_rows(slerp(u, v, 0.25)[:, :8]), atol=1e-5)
    assert transform(profile, "aligned", None, new, "text").queries.shape == (20, 8)


@pytest.mark.parametrize("swap", [False, True])
def test_padded_scores_equal_old_coordinate_scores(swap: bool) -> None:
    # Both padding directions: d_new > d_old and d_new < d_old.
    rng = np.random.default_rng(11)
    d_old, d_new = (12, 8) if swap else (8, 12)
    old, new = rng.standard_normal((30, d_old)), rng.standard_normal((30, d_new))
    r = np.linalg.qr(rng.standard_normal((12, 12)))[0].astype(np.float32)
    prof = CompatProfile(
        "slerp", "o", "n", d_old, d_new, {"text": 0.5}, {"text": {"slerp": {"alpha": 0.5}}}, "both", 2, {}, {"R": r}
    )
    gallery = normalize_rows(rng.standard_normal((40, d_old)))
    out = transform(prof, "slerp", old, new, "text")
    q_pad = slerp(pad(normalize_rows(old), 12), align(new, r, d_old), 0.5)
    padded = q_pad @ pad(gallery, 12).T
    np.testing.assert_allclose(
        out.queries @ gallery.T * np.linalg.norm(q_pad[:, :d_old], axis=1, keepdims=True), padded, atol=1e-5
    )
    np.testing.assert_array_equal(
        np.argsort(-(out.queries @ gallery.T), axis=1)[:, :5], np.argsort(-padded, axis=1)[:, :5]
    )


@pytest.mark.parametrize("mode", ["slerp", "nlerp", "adaptive"])
def test_served_blend_equals_padded_blend(mode: str) -> None:
    # transform blends from R's [d_new, d_old] block (procrustes_blend.py); the padded reference
    # computes every coordinate of v. Rows 0-9 are generic pairs; rows 10-19 have v ~ u and take the
    # folded fallback, whose padding norm carries R's float32 error (a looser tolerance, as documented).
    rng = np.random.default_rng(5)
    d_old, d = 8, 12
    r = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
    old = rng.standard_normal((20, d_old)).astype(np.float32)
    new = rng.standard_normal((20, d)).astype(np.float32)
    new[10:] = pad(normalize_rows(old[10:]), d) @ r.T + 1e-4 * rng.standard_normal((10, d))
    params = {"slerp": {"alpha": 0.4}, "nlerp": {"alpha": 0.4}, "adaptive": {"a": 0.4, "b": 0.5, "c_ref": 0.2}}
    prof = CompatProfile("slerp", "o", "n", d_old, d, {"text": 0.4}, {"text": params}, "both", 2, {}, {"R": r})
    u, v = pad(normalize_rows(old), d), align(new, r, d_old)
    cos = np.sum(u * v, axis=1)
    row_alpha = np.clip(0.4 + 0.5 * (cos - 0.2), 0, 1)
    expected = {"slerp": slerp(u, v, 0.4), "nlerp": nlerp(u, v, 0.4), "adaptive": nlerp(u, v, row_alpha)}[mode]
    out = transform(prof, mode, old, new, "text")
    expected_q = normalize_rows(expected[:, :d_old])
    np.testing.assert_allclose(out.queries[:10], expected_q[:10], atol=1e-5)
    np.testing.assert_allclose(out.queries[10:], expected_q[10:], atol=1e-3)
    theta = np.arctan2(np.linalg.norm(v - cos[:, None] * u, axis=1), cos)
    np.testing.assert_allclose(out.theta[:10], theta[:10], atol=1e-5)
    np.testing.assert_allclose(out.theta[10:], theta[10:], atol=1e-3)


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7])
def test_degenerate_pairs_follow_interpolation_rules(alpha: float) -> None:
    # With R = I and equal dims, rows 0-2 have v == u (theta 0) and rows 3-5 have v == -u (theta pi):
    # the serving transform must give exactly what interpolation.py's documented rules give.
    rng = np.random.default_rng(3)
    old = rng.standard_normal((6, 8)).astype(np.float32)
    new = np.concatenate([old[:3], -old[3:]])
    params = {"slerp": {"alpha": alpha}, "nlerp": {"alpha": alpha}}
    r = np.eye(8, dtype=np.float32)
    prof = CompatProfile("slerp", "o", "n", 8, 8, {"text": alpha}, {"text": params}, "both", 2, {}, {"R": r})
    u, v = normalize_rows(old), normalize_rows(new)
    for mode, reference in (("slerp", slerp), ("nlerp", nlerp)):
        out = transform(prof, mode, old, new, "text")
        np.testing.assert_allclose(out.queries, normalize_rows(reference(u, v, alpha)), atol=1e-6)
    np.testing.assert_allclose(
        transform(prof, "slerp", old, new, "text").theta, [0, 0, 0, np.pi, np.pi, np.pi], atol=1e-6
    )


# What transform refuses: (mode, the old rows it is given, modality, alpha), the error and the words of its line.
# The old rows: the support's old queries, none, its new queries (another width), or the old with a zero row.
TRANSFORM_REFUSALS = [
    ("psp", "old", "text", None, UnsupportedMode, "unknown mode"),
    ("slerp", "old", "image", None, UnsupportedMode, "image"),
    ("old", "old", "text", 0.3, InputError, "alpha"),
    ("slerp", "old", "text", 1.5, InputError, "alpha"),
    ("slerp", "none", "text", None, InputError, "needs the old"),
    ("slerp", "new", "text", None, InputError, "shape"),
    ("slerp", "zero row", "text", None, InputError, "all-zero"),
]


@pytest.mark.parametrize(("mode", "old_rows", "modality", "alpha", "error", "match"), TRANSFORM_REFUSALS)
def test_transform_errors(
    profile: CompatProfile,
    support: Split,
    mode: str,
    old_rows: str,
    modality: str,
    alpha: float | None,
    error: type[Exception],
    match: str,
) -> None:
    old, new = support.old_query[:3], support.new_query[:3]
    zero_row = old.copy()
    zero_row[1] = 0
    given = {"old": old, "none": None, "new": new, "zero row": zero_row}[old_rows]
    with pytest.raises(error, match=match):
        transform(profile, mode, given, new, modality, alpha)


def test_cross_fit_with_ids_and_distractors(crossfit_split: Split) -> None:
    # Two captions per item: queries 2i and 2i+1 both belong to item i; targets 100.. are distractors.
    split = crossfit_split
    result = selection.fit(split, FitOptions(folds=4))
    assert result.report["eval_queries"] == 200
    assert all(0 <= r["recall@1"] <= 1 for r in result.report["support_recall"]["slerp"])
    q_fold, t_fold = crossfit.assign_joint([split], 4, np.random.default_rng(1))[0]
    assert set(q_fold) == {0, 1, 2, 3}
    for item in range(100):
        assert q_fold[2 * item] == q_fold[2 * item + 1] == t_fold[item]
