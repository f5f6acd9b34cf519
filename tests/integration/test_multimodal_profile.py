"""One profile, two query modalities: `fit --support text=DIR --support image=DIR`, served over HTTP.

The image support set is the synthetic world's (image view -> caption) with its new-model rows
shuffled: an image model the upgrade does not help, so its weight comes out 0 while text's does
not, and every served query must carry its own modality's weight.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from service.compat.profile import CompatProfile, load_profile
from service.settings import CompatSettings, IndexSettings, Settings
from tests.support.app import serving
from tests.support.cli import cli, run_cli
from tests.support.world import World

CAPTION = "item-{:010d} caption-1"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multimodal")
    run_cli("synth", "support", "--n", "2000", "--out", root / "text")
    run_cli("synth", "support", "--n", "1000", "--out", root / "image", "--modality", "image")
    rng = np.random.default_rng(0)
    for name in ("new_query.npy", "new_target.npy"):
        rows = np.load(root / "image" / name)
        np.save(root / "image" / name, rows[rng.permutation(len(rows))])
    support = ("--support", f"text={root / 'text'}", "--support", f"image={root / 'image'}")
    run_cli("fit", *support, "--out", root / "profile", "--folds", "3")
    return {"root": root, "text": root / "text", "image": root / "image", "profile": root / "profile"}


@pytest.fixture(scope="module")
def profile(folders: dict[str, Path]) -> CompatProfile:
    return load_profile(folders["profile"])


def test_fit_records_one_weight_and_parameter_set_per_modality(profile: CompatProfile) -> None:
    assert set(profile.alphas) == set(profile.params) == {"text", "image"}
    assert profile.alphas["image"] == 0.0 < profile.alphas["text"]
    for modality in ("text", "image"):
        assert profile.params[modality]["slerp"]["alpha"] == profile.alphas[modality]
        assert set(profile.params[modality]) == {"slerp", "nlerp", "adaptive"}
    rep = profile.fit_report
    assert rep["query_modalities"] == ["text", "image"] and set(rep["modalities"]) == {"text", "image"}
    assert rep["fit_rows"] == 2 * 2000 + 2 * 1000  # one R over both folders' query and target pairs
    assert rep["modalities"]["image"]["support_queries"] == 1000


def test_show_and_eval_read_a_two_modality_profile(folders: dict[str, Path]) -> None:
    shown = cli("profile", "show", folders["profile"])
    assert shown.returncode == 0, shown.stderr
    assert "image queries: chosen slerp" in shown.stdout and "text queries: chosen slerp" in shown.stdout
    refused = cli("eval", folders["profile"], folders["text"])
    assert refused.returncode == 2 and "--query-modality" in refused.stderr
    done = cli("eval", folders["profile"], folders["text"], "--query-modality", "text", "--json")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--support", "text"), "MODALITY=DIR"),
        (("--support", "audio=x"), "modality must be one of"),
        (("--support", "text=a", "--support", "text=b"), "already come from"),
        (("--support", "text=a", "--support", "image=b", "--head", "adapter"), "one query modality"),
        ((), "no support set"),
    ],
)
def test_fit_refuses_bad_support_options(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    done = cli("fit", *args, "--out", tmp_path / "p")
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "p").exists()


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 200, 10)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


async def test_each_query_is_served_with_its_own_modalitys_weight(
    world: World, folders: dict[str, Path], profile: CompatProfile
) -> None:
    settings = Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=16),
        compat=CompatSettings(profile_dir=folders["profile"]),
    )
    async with serving(settings) as running:
        info = (await running.client.get("/v1/info")).json()
        assert info["profile"]["alphas"] == profile.alphas
        mixed = [{"text": CAPTION.format(7)}, {"image_b64": _png()}, {"text": CAPTION.format(8)}]
        response = await running.search(queries=mixed, k=5)
        assert response.status_code == 200, response.text
        served = [r["alpha"] for r in response.json()["results"]]
        assert served == pytest.approx([profile.alphas["text"], profile.alphas["image"], profile.alphas["text"]])
        assert served[0] != served[1]
        # Precomputed embeddings pick their weight by the modality they declare.
        vectors = [
            {"old_embedding": [0.1] * profile.old_dim, "new_embedding": [0.2] * profile.new_dim, "modality": m}
            for m in ("image", "text")
        ]
        response = await running.search(queries=vectors, k=3, mode="nlerp")
        assert response.status_code == 200, response.text
        served = [r["alpha"] for r in response.json()["results"]]
        assert served == pytest.approx([profile.params[m]["nlerp"]["alpha"] for m in ("image", "text")])
