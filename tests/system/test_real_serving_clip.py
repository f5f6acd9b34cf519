"""A CLIP-style upgrade served over HTTP: two tiny random CLIP models, text and image queries, CLI only.

The models are randomly initialised (their rankings mean nothing); what is real is every step a
user takes: `support build` from a pairs file of captions and image files, `fit`, `encode` of an
image folder, `gallery build --from-npy`, `nobackfill serve` with backend clip on both sides.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.support.cli import cli_checked
from tests.support.servers import serve_process
from tests.support.tiny_models import CLIP_DIM, tiny_clip
from tests.support.world import World

IMAGES = 300
SUPPORT_PAIRS = 200


def write_images(folder: Path) -> list[Path]:
    """Small random-pattern PNG files, named in order."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(IMAGES):
        pixels = rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)
        path = folder / f"img-{i:04d}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def clip_upgrade(tmp_path_factory: pytest.TempPathFactory) -> World:
    """Models, support set, profile and image gallery of a tiny CLIP -> CLIP upgrade, built with the CLI."""
    root = tmp_path_factory.mktemp("clip-upgrade")
    old, new = tiny_clip(root / "clip-old", seed=0), tiny_clip(root / "clip-new", seed=1)
    images = write_images(root / "images")
    pairs = root / "pairs.jsonl"
    with pairs.open("w") as f:
        for i, path in enumerate(images[:SUPPORT_PAIRS]):
            f.write(json.dumps({"query": f"picture number {i}", "target": str(path.relative_to(root))}) + "\n")
    support = root / "support"
    cli_checked(
        "support", "build", "--pairs", pairs, "--out", support, "--old-backend", "clip", "--old-path", old,
        "--new-backend", "clip", "--new-path", new, "--modality", "text", "--target-modality", "image",
    )  # fmt: skip
    cli_checked("fit", support, "--out", root / "profile", "--folds", "3")
    cli_checked(
        "encode", "--backend", "clip", "--path", old, "--input", root / "images", "--modality", "image",
        "--out", root / "gallery.npy",
    )  # fmt: skip
    cli_checked(
        "gallery", "build", "--from-npy", root / "gallery.npy", "--out", root / "gallery", "--nlist", "4", "--pq-m", "4"
    )
    return World(root / "gallery", support, root / "profile")


@pytest.fixture(scope="module")
def clip_service(clip_upgrade: World) -> Iterator[str]:
    """`nobackfill serve` with backend clip for both encoders."""
    root = clip_upgrade.gallery_dir.parent
    env = {
        "NOBACKFILL_OLD__BACKEND": "clip",
        "NOBACKFILL_OLD__PATH": str(root / "clip-old"),
        "NOBACKFILL_NEW__BACKEND": "clip",
        "NOBACKFILL_NEW__PATH": str(root / "clip-new"),
    }
    with serve_process(clip_upgrade, env=env) as base:
        yield base


def test_artifacts_carry_the_clip_identities(clip_upgrade: World) -> None:
    models = json.loads((clip_upgrade.support_dir / "models.json").read_text())
    profile = json.loads((clip_upgrade.profile_dir / "profile.json").read_text())
    gallery = json.loads((clip_upgrade.gallery_dir / "gallery.json").read_text())
    assert (models["old"]["model_id"], models["new"]["model_id"]) == ("clip-old", "clip-new")
    assert models["old"]["fingerprint"] != models["new"]["fingerprint"]
    assert (profile["old_model_id"], profile["new_model_id"]) == ("clip-old", "clip-new")
    assert profile["models"]["old"] == models["old"] == gallery["old_model"]
    assert gallery["ntotal"] == IMAGES and gallery["d"] == CLIP_DIM


def test_text_queries_are_served_and_cached(clip_service: str) -> None:
    body = {"queries": [{"text": "picture number 7"}], "k": 5}
    first = httpx.post(f"{clip_service}/v1/search", json=body, timeout=30)
    again = httpx.post(f"{clip_service}/v1/search", json=body, timeout=30)
    assert first.status_code == 200, first.text
    result = first.json()["results"][0]
    assert len(result["ids"]) == 5 and all(0 <= i < IMAGES for i in result["ids"])
    assert (result["mode"], result["cache"]) == ("slerp", "miss")
    assert again.json()["results"][0]["cache"] == "hit"
    assert again.json()["results"][0]["ids"] == result["ids"]


def test_image_queries_are_served(clip_service: str, clip_upgrade: World) -> None:
    image = clip_upgrade.gallery_dir.parent / "images" / "img-0250.png"
    payload = base64.b64encode(image.read_bytes()).decode()
    # The profile was fitted for text queries: image queries name their weight, or a mode without one.
    for extra in ({"alpha": 0.5}, {"mode": "aligned"}, {"mode": "old"}):
        response = httpx.post(
            f"{clip_service}/v1/search", json={"queries": [{"image_b64": payload}], "k": 3, **extra}, timeout=30
        )
        assert response.status_code == 200, response.text
        assert len(response.json()["results"][0]["ids"]) == 3
    # Mode old searches the old model's own embedding of a gallery image: it finds that image.
    old = httpx.post(
        f"{clip_service}/v1/search", json={"queries": [{"image_b64": payload}], "k": 3, "mode": "old"}, timeout=30
    )
    assert old.json()["results"][0]["ids"][0] == 250
    unfitted = httpx.post(f"{clip_service}/v1/search", json={"queries": [{"image_b64": payload}]}, timeout=30)
    assert unfitted.status_code == 400 and "image" in unfitted.json()["error"]["message"]


def test_info_reports_both_clip_models(clip_service: str) -> None:
    info = httpx.get(f"{clip_service}/v1/info", timeout=10).json()
    for role, name in (("old_model", "clip-old"), ("new_model", "clip-new")):
        model = info[role]
        assert (model["id"], model["backend"], model["dim"]) == (name, "clip", CLIP_DIM)
        assert model["modalities"] == ["text", "image"] and model["fingerprint"]
        assert "truncated" in model["truncation"]
