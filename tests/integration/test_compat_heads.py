"""The adapter, adapter+slerp, psp and lsp heads through the profile, heads.transform and the CLI.

CLI runs go through `run_cli` (a subprocess, as a user would); the other checks run in-process on one
torch thread.  The adapter profile's round trip and the PSP profile's checks: tests/unit/test_heads_profiles.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.compat import psp
from service.compat.heads import transform
from service.compat.io import load_split
from service.compat.metrics import ranks, recall_at_k, relevance
from service.compat.profile import PROFILE_JSON, load_profile
from service.errors import UnsupportedMode
from tests.support.cli import run_cli
from tests.support.digits_models import OLD_CLASSES, encode, train_pair
from tests.support.upgrade_standin import make_world, write_split

EVAL_KEYS = {
    "method", "alpha", "recall@1", "recall@5", "recall@10", "mrr@10", "ndcg@10", "vs_old", "compatible",
    "compatible@1", "judged_on", "retention", "pfr", "nfr",
}  # fmt: skip
ADAPTER_FAST = ("--epochs", "2", "--threads", "1", "--batch-size", "128")


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def eval_rows(profile: Path, test: Path) -> dict[str, dict[str, Any]]:
    """`nobackfill eval --json` as a dict keyed by method, checking the row keys."""
    rows = json.loads(run_cli("eval", profile, test, "--json").stdout)
    assert all(set(r) == EVAL_KEYS for r in rows)
    assert len({r["method"] for r in rows}) == len(rows)
    return {r["method"]: r for r in rows}


# -- the adapter heads on the synthetic stand-in -----------------------------------------------------


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small stand-in upgrade (48 -> 32) and an adapter and an adapter+slerp profile fitted on it."""
    root = tmp_path_factory.mktemp("heads")
    w = make_world(32, 48, 24)
    paths = {
        "root": root,
        "support": write_split(root / "support", 1200, w, seed=1),
        "test": write_split(root / "test", 500, w, seed=2),
    }
    run_cli("fit", paths["support"], "--out", root / "adapter", "--head", "adapter", *ADAPTER_FAST)
    run_cli(
        "fit",
        paths["support"],
        "--out",
        root / "adapter-slerp",
        "--head",
        "adapter+slerp",
        "--folds",
        "2",
        *ADAPTER_FAST,
    )
    return {**paths, "adapter": root / "adapter", "adapter+slerp": root / "adapter-slerp"}


def test_adapter_profile_contents_and_eval(standin: dict[str, Path]) -> None:
    meta = json.loads((standin["adapter"] / PROFILE_JSON).read_text())
    assert meta["head"] == "adapter" and meta["format_version"] == 3 and meta["classes"] is None
    assert meta["adapter"]["format"] == "mkp-adapter/1" and meta["adapter"]["config"]["epochs"] == 2
    assert meta["adapter"]["config"]["batch_size"] == 128 and meta["alphas"] == {"text": 1.0}
    profile = load_profile(standin["adapter"])
    assert profile.modes() == ["old", "adapter"]
    # The adapter's weights, and the hybrid calibration's reference rows (the support has both targets).
    assert {k.split(".")[0] for k in profile.tensors} == {"adapter", "calibration"}
    rows = eval_rows(standin["adapter"], standin["test"])
    assert list(rows) == ["old", "new", "adapter"]
    assert rows["adapter"]["alpha"] == 1.0 and rows["old"]["compatible"] is None
    assert rows["new"]["recall@1"] > rows["old"]["recall@1"]
    for r in rows.values():
        assert r["recall@1"] <= r["recall@5"] <= r["recall@10"]
        assert r["recall@1"] - rows["old"]["recall@1"] == pytest.approx(r["pfr"] - r["nfr"])


def test_adapter_slerp_profile_and_eval(standin: dict[str, Path]) -> None:
    profile = load_profile(standin["adapter+slerp"])
    assert profile.modes() == ["old", "adapter", "adapter+slerp"]
    rep = profile.fit_report
    assert rep["selection"] == "cross-fit" and rep["folds"] == 2 and len(rep["fold_fit_seconds"]) == 2
    alpha = profile.params["text"]["adapter+slerp"]["alpha"]
    assert profile.alphas == {"text": alpha} and rep["chosen"]["adapter+slerp"]["alpha"] == alpha
    assert [r["alpha"] for r in rep["support_recall"]["adapter+slerp"]] == [round(0.1 * i, 1) for i in range(11)]
    assert (standin["adapter+slerp"] / "fit_recall.png").read_bytes()[:4] == b"\x89PNG"
    rows = eval_rows(standin["adapter+slerp"], standin["test"])
    assert list(rows) == ["old", "new", "adapter", "adapter+slerp"]
    assert rows["adapter+slerp"]["alpha"] == alpha
    # Two epochs leave the adapter weak: the cross-fitted blend must lean on the old query and beat it.
    assert rows["adapter+slerp"]["recall@1"] > rows["adapter"]["recall@1"]
    assert rows["adapter+slerp"]["recall@1"] >= rows["old"]["recall@1"] - 0.02


def test_profile_show_for_adapter_heads(standin: dict[str, Path]) -> None:
    shown = run_cli("profile", "show", standin["adapter+slerp"]).stdout
    for needle in ("head adapter+slerp", "MKP adapter 48 -> 48 -> 32", "epochs=2", "adapter training", "fold fits"):
        assert needle in shown
    assert "adapter+slerp R@1" in shown and "residual angle" in shown
    as_json = json.loads(run_cli("profile", "show", standin["adapter"], "--json").stdout)
    assert as_json["head"] == "adapter" and as_json["adapter"]["hidden"] == 48


def test_fit_refuses_options_of_another_head(standin: dict[str, Path]) -> None:
    out = standin["root"] / "refused"
    for args, message in (
        (("--head", "slerp", "--epochs", "3"), "--epochs only apply to --head adapter"),
        (("--head", "adapter", "--top-k", "2"), "--top-k only apply to --head psp"),
        (("--head", "adapter", "--dropout", "1.0"), "dropout must be in [0, 1)"),
    ):
        done = run_cli("fit", standin["support"], "--out", out, *args, check=False)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert not out.exists()


def test_format_1_profiles_still_load(tmp_path: Path) -> None:
    folder = write_split(tmp_path / "s", 200, make_world(8, 12, 6), seed=5)
    run_cli("fit", folder, "--out", tmp_path / "p", "--folds", "2")
    meta = json.loads((tmp_path / "p" / PROFILE_JSON).read_text())
    meta["format_version"] = 1
    del meta["adapter"], meta["classes"]
    (tmp_path / "p" / PROFILE_JSON).write_text(json.dumps(meta))
    (tmp_path / "p" / "manifest.json").unlink()  # format 1 predates manifests
    loaded = load_profile(tmp_path / "p")
    assert loaded.head == "slerp" and loaded.adapter is None and loaded.classes is None
    assert loaded.modes() == ["old", "aligned", "slerp", "nlerp", "adaptive"]


# -- psp / lsp on a real 5 -> 10 class upgrade (digits) ------------------------------------------------


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Logit splits from one (old, new) digits pair: support (old classes) and test (query / gallery)."""
    root = tmp_path_factory.mktemp("digits")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pair = train_pair(0)
    finally:
        torch.set_num_threads(before)
    s = pair.splits

    def write(folder: Path, q_rows: np.ndarray, g_rows: np.ndarray) -> Path:
        folder.mkdir()
        np.save(folder / "old_query.npy", encode(pair.old, s.x[q_rows])[1])
        np.save(folder / "new_query.npy", encode(pair.new, s.x[q_rows])[1])
        np.save(folder / "old_target.npy", encode(pair.old, s.x[g_rows])[1])
        np.save(folder / "query_ids.npy", s.y[q_rows])
        np.save(folder / "target_ids.npy", s.y[g_rows])
        return folder

    support = s.support[s.y[s.support] < OLD_CLASSES]
    return {
        "root": root,
        "pair": pair,
        "support": write(root / "support", support[::2], support[1::2]),
        "test": write(root / "test", s.query, s.gallery),
    }


DIGITS_IDS = ("--old-model-id", "digits-old", "--new-model-id", "digits-new")


def test_psp_fit_eval_show(digits: dict[str, Any]) -> None:
    out = digits["root"] / "psp"
    run_cli("fit", digits["support"], "--out", out, "--head", "psp", *DIGITS_IDS)
    profile = load_profile(out)
    assert profile.modes() == ["psp"] and (profile.old_dim, profile.new_dim) == (5, 10)
    assert profile.classes == {"old_classes": 5, "new_classes": 10, "top_k": None, "class_map": None}
    np.testing.assert_allclose(profile.tensors["P_tk"], psp.correction_matrix(5, 10), atol=1e-7)
    assert profile.fit_report["prototype_rotation_deg"] == pytest.approx(19.47, abs=0.01)
    assert [r["method"] for r in profile.fit_report["support_eval"]] == ["old", "psp", "old-logits", "new-logits"]

    rows = eval_rows(out, digits["test"])
    assert list(rows) == ["old", "psp", "old-logits", "new-logits"]
    # The directions that hold on this pair (and on average over five, docs/benchmarks.md):
    # PSP is backward compatible; comparing raw logits across the two models is not.
    assert rows["psp"]["recall@1"] > rows["old"]["recall@1"] and rows["psp"]["compatible@1"] != "not compatible"
    # Raw logits across models lose R@1; whether the loss is significant on these 300-odd queries depends on
    # the pair's training (scikit-learn 1.9.1 gives an interval that reaches zero): never "compatible".
    assert rows["new-logits"]["recall@1"] < rows["old-logits"]["recall@1"]
    assert rows["new-logits"]["compatible@1"] in ("not compatible", "not distinguishable")
    assert rows["psp"]["recall@1"] > rows["new-logits"]["recall@1"]

    # The eval row is the PSP definition itself: query_features of new logits vs the old PSP gallery.
    test = load_split(digits["test"])
    rel = relevance(test.query_ids, test.target_ids)
    expected = ranks(psp.query_features(test.new_query, 5, "psp"), psp.gallery_features(test.old_target), rel)
    assert rows["psp"]["recall@1"] == pytest.approx(recall_at_k(expected)[1])

    shown = run_cli("profile", "show", out).stdout
    for needle in ("head psp; modes psp", "5 old classes -> 10 new classes", "P_tk 5x10", "digits-new", "support"):
        assert needle in shown
    with pytest.raises(UnsupportedMode):
        transform(profile, "old", test.old_query, None, "text")


def test_lsp_with_top_k_and_class_map(digits: dict[str, Any]) -> None:
    out = digits["root"] / "lsp"
    lsp = ("--head", "lsp", "--top-k", "3", "--class-map", "0,1,2,3,4")
    run_cli("fit", digits["support"], "--out", out, *lsp, *DIGITS_IDS)
    profile = load_profile(out)
    assert profile.modes() == ["lsp"] and profile.top_k == 3 and profile.class_map == [0, 1, 2, 3, 4]
    rows = eval_rows(out, digits["test"])
    assert list(rows) == ["old", "lsp", "old-logits", "new-logits"]
    test = load_split(digits["test"])
    q = transform(profile, "lsp", None, test.new_query, "text").queries
    np.testing.assert_array_equal(q, psp.query_features(test.new_query, 5, "lsp", 3, [0, 1, 2, 3, 4]))
    assert np.count_nonzero(psp.gallery_features(test.old_target, "lsp", 3), axis=1).max() <= 3


def test_psp_fit_refusals(digits: dict[str, Any]) -> None:
    out = digits["root"] / "refused"
    for args, message in (
        (("--old-classes", "4"), "5 columns (old-model logits), but --old-classes is 4"),
        (("--class-map", "0,1,2"), "class_map"),
        (("--class-map", "a,b"), "comma-separated integers"),
    ):
        done = run_cli("fit", digits["support"], "--out", out, "--head", "psp", *args, *DIGITS_IDS, check=False)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert not out.exists()
