"""Adapter and PSP profiles in process: the adapter's bit-exact round trip through save/load, and the PSP checks.

The heads fitted and evaluated through the CLI: tests/integration/test_compat_heads.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.compat import psp
from service.compat.adapter import AdapterConfig, train_adapter
from service.compat.heads import transform
from service.compat.interpolation import slerp
from service.compat.io import load_split
from service.compat.procrustes import normalize_rows
from service.compat.profile import TENSORS, CompatProfile, load_profile, save_profile
from service.errors import ArtifactError, InputError, UnsupportedMode
from tests.support.upgrade_standin import make_world, write_split

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def profile_of(head: str, old_dim: int, new_dim: int, tensors: dict[str, Any], **fields: Any) -> CompatProfile:
    """A profile of `head` from model o to model n holding `tensors`; unless `fields` say otherwise, one fitted on
    nothing (no alphas, no parameters, no folds, an empty report), as the checks on tensors need no more."""
    unfitted: dict[str, Any] = {"alphas": {}, "params": {}, "fit_on": "none", "folds": 0, "fit_report": {}}
    return CompatProfile(head, "o", "n", old_dim, new_dim, tensors=tensors, **(unfitted | fields))


def test_trained_adapter_round_trips_bit_exactly(tmp_path: Path) -> None:
    split = load_split(write_split(tmp_path / "s", 300, make_world(8, 12, 6), seed=3))
    adapter = train_adapter(
        split.new_query, split.old_query, AdapterConfig(epochs=2, batch_size=64, m=16, precision="fp32"), progress=False
    )
    profile = profile_of(
        "adapter+slerp",
        8,
        12,
        {k: v.numpy() for k, v in adapter.state_dict_tensors().items()},
        alphas={"text": 0.3},
        params={"text": {"adapter+slerp": {"alpha": 0.3}}},
        fit_on="query",
        folds=2,
        adapter=adapter.meta(),
    )
    save_profile(profile, tmp_path / "p")
    loaded = load_profile(tmp_path / "p")
    for rows in (5, 40):  # below and above the numpy / torch switch in apply()
        x = split.new_query[:rows]
        np.testing.assert_array_equal(loaded.adapter_model.apply(x), adapter.apply(x))
    old, new = split.old_query[:20], split.new_query[:20]
    v = adapter.apply(new)
    out = transform(loaded, "adapter", None, new, "text")
    np.testing.assert_array_equal(out.queries, v)
    blended = transform(loaded, "adapter+slerp", old, new, "text")
    np.testing.assert_allclose(blended.queries, normalize_rows(slerp(normalize_rows(old), v, 0.3)), atol=1e-6)
    assert blended.alpha == 0.3 and np.all(blended.theta > 0)
    explicit = transform(loaded, "adapter+slerp", old, new, "image", alpha=0.0)
    np.testing.assert_allclose(explicit.queries, normalize_rows(old), atol=1e-6)
    np.testing.assert_allclose(transform(loaded, "old", old, None, "text").queries, normalize_rows(old), atol=1e-7)
    with pytest.raises(UnsupportedMode, match="slerp"):
        transform(loaded, "slerp", old, new, "text")
    with pytest.raises(InputError, match="needs the old"):
        transform(loaded, "adapter+slerp", None, new, "text")
    with pytest.raises(InputError, match="explicit alpha"):
        transform(loaded, "adapter", None, new, "text", alpha=0.5)

    # A tensor that does not fit the described net is refused at load time, not at the first query.
    broken = dict(profile.tensors)
    broken["adapter.fc2.bias"] = np.zeros(3, np.float32)
    with pytest.raises(ArtifactError, match="adapter"):
        save_profile(replace(profile, tensors=broken), tmp_path / "q")
    with pytest.raises(ArtifactError, match="adapter maps"):
        save_profile(replace(profile, old_dim=9), tmp_path / "q")


def test_psp_profile_validation(tmp_path: Path) -> None:
    good = profile_of(
        "psp",
        3,
        4,
        {"P_tk": psp.correction_matrix(3, 4).astype(np.float32)},
        classes={"old_classes": 3, "new_classes": 4, "top_k": None, "class_map": None},
    )
    save_profile(good, tmp_path / "ok")
    assert load_profile(tmp_path / "ok").old_classes == 3
    cases = [
        (replace(good, tensors={"P_tk": np.eye(3, 4, dtype=np.float32)}), "P_tk"),
        (replace(good, tensors={}), "P_tk is missing"),
        (replace(good, classes={"old_classes": 2, "new_classes": 4}), "differ from the dims"),
        (replace(good, classes=None), "class counts"),
        (replace(good, classes={**(good.classes or {}), "class_map": [0, 0, 1]}), "class_map"),
    ]
    for bad, message in cases:
        with pytest.raises(ArtifactError, match=message):
            save_profile(bad, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    assert (tmp_path / "ok" / TENSORS).is_file()
