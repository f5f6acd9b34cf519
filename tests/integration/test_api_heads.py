"""adapter, adapter+slerp and psp served through the real HTTP stack (httpx ASGI transport + the app's lifespan).

Adapter: a profile fitted (`nobackfill fit --head adapter+slerp`) on the session world's support set,
served with the synthetic encoders over the session gallery.  PSP: a real 5 -> 10 class upgrade on
sklearn's digits; the gallery holds the OLD model's PSP features (`psp.gallery_features`), the
service runs the `external` encoder backend (no model: clients send logits), and queries carry only
the NEW model's raw logits as new_embedding.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from service.compat import psp
from service.compat.heads import transform
from service.settings import CompatSettings, EncoderSettings, IndexSettings, Settings
from tests.support.app import Running, serving
from tests.support.cli import cli_checked
from tests.support.digits_models import OLD_CLASSES, Pair, encode, train_pair
from tests.support.world import World

CAPTION = "item-{:010d} caption-1"


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def assert_error(response: httpx.Response, status: int, code: str, *needles: str) -> None:
    """The one error shape with the expected status, code and message fragments."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    for needle in needles:
        assert needle in error["message"], error["message"]


# -- adapter heads over the session world ----------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_profile(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter+slerp profile (serves old, adapter, adapter+slerp) fitted on the world's support set."""
    out = tmp_path_factory.mktemp("api-heads") / "adapter-slerp"
    fast = ("--epochs", "2", "--threads", "1", "--folds", "2", "--eval-queries", "1000")
    cli_checked("fit", world.support_dir, "--out", out, "--head", "adapter+slerp", *fast)
    return out


@pytest.fixture
async def adapter_service(world: World, adapter_profile: Path) -> AsyncIterator[Running]:
    """The service on the world's gallery with the adapter profile, default mode adapter."""
    settings = Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=16),
        compat=CompatSettings(profile_dir=adapter_profile, default_mode="adapter"),
    )
    async with serving(settings) as running:
        yield running


async def test_adapter_modes_answer_like_the_offline_path(adapter_service: Running) -> None:
    pipeline = adapter_service.pipeline
    assert pipeline.profile.modes() == ["old", "adapter", "adapter+slerp"]
    texts = [CAPTION.format(i) for i in (3, 30, 300)]
    old = pipeline.old.encoder.encode(texts, "text")
    new = pipeline.new.encoder.encode(texts, "text")
    for mode in ("adapter", "adapter+slerp", "old"):
        response = await adapter_service.search(queries=[{"text": t} for t in texts], k=10, mode=mode, nprobe=16)
        assert response.status_code == 200, response.text
        expected = transform(pipeline.profile, mode, old, new, "text")
        _, ids = pipeline.gallery.search(expected.queries, 10, 16)
        for row, result in enumerate(response.json()["results"]):
            assert result["mode"] == mode and result["ids"] == ids[row].tolist()
            assert result["alpha"] == pytest.approx(expected.alpha)


async def test_adapter_takes_a_new_embedding_alone(adapter_service: Running) -> None:
    pipeline = adapter_service.pipeline
    text = CAPTION.format(42)
    new = pipeline.new.encoder.encode([text], "text")[0]
    by_text = (await adapter_service.search(queries=[{"text": text}], k=5)).json()["results"][0]
    alone = await adapter_service.search(queries=[{"new_embedding": new.tolist()}], k=5, mode="adapter")
    assert alone.status_code == 200, alone.text
    assert alone.json()["results"][0]["ids"] == by_text["ids"] and by_text["mode"] == "adapter"
    # adapter+slerp blends with the old query: without it the request is refused, and says why.
    refused = await adapter_service.search(queries=[{"new_embedding": new.tolist()}], mode="adapter+slerp")
    assert_error(refused, 400, "invalid_input", "no old_embedding", "adapter+slerp")


async def test_adapter_profile_refuses_modes_it_lacks(adapter_service: Running) -> None:
    for mode in ("slerp", "aligned", "psp"):
        response = await adapter_service.search(queries=[{"text": CAPTION.format(1)}], mode=mode)
        assert_error(response, 400, "unsupported_mode", mode, "adapter+slerp")
    explicit = await adapter_service.search(queries=[{"text": CAPTION.format(1)}], mode="adapter+slerp", alpha=0.0)
    old = await adapter_service.search(queries=[{"text": CAPTION.format(1)}], mode="old")
    assert explicit.json()["results"][0]["ids"] == old.json()["results"][0]["ids"]
    info = (await adapter_service.client.get("/v1/info")).json()
    assert info["profile"]["head"] == "adapter+slerp" and info["profile"]["modes"] == [
        "old",
        "adapter",
        "adapter+slerp",
    ]


# -- psp over a digits gallery with the external backend ------------------------------------------


@dataclass(frozen=True)
class DigitsDeployment:
    """A psp profile and an old-model PSP gallery of one digits model pair."""

    pair: Pair
    gallery_dir: Path
    profile_dir: Path
    query_rows: np.ndarray


@pytest.fixture(scope="module")
def digits_deployment(tmp_path_factory: pytest.TempPathFactory) -> DigitsDeployment:
    """Train the pair, fit `--head psp` on support logits, build the gallery from old-model PSP features."""
    root = tmp_path_factory.mktemp("psp-service")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pair = train_pair(0, old_only_eval=False)
    finally:
        torch.set_num_threads(before)
    s = pair.splits
    support = root / "support"
    support.mkdir()
    rows = s.support[s.y[s.support] < OLD_CLASSES]
    np.save(support / "old_query.npy", encode(pair.old, s.x[rows[::2]])[1])
    np.save(support / "new_query.npy", encode(pair.new, s.x[rows[::2]])[1])
    np.save(support / "old_target.npy", encode(pair.old, s.x[rows[1::2]])[1])
    cli_checked(
        "fit", support, "--out", root / "profile", "--head", "psp", "--old-model-id", "digits-old",
        "--new-model-id", "digits-new",
    )  # fmt: skip
    # The gallery: the old model's PSP features of every image outside training and queries
    # (~720, above the 256 points an 8-bit PQ codebook needs).
    gallery_rows = np.sort(np.concatenate([s.support, s.gallery]))
    features = psp.gallery_features(encode(pair.old, s.x[gallery_rows])[1], "psp")
    np.save(root / "gallery_psp.npy", features)
    cli_checked(
        "gallery", "build", "--from-npy", root / "gallery_psp.npy", "--out", root / "gallery",
        "--nlist", "4", "--pq-m", "5",
    )  # fmt: skip
    query_rows = s.query[s.y[s.query] < OLD_CLASSES][:12]
    return DigitsDeployment(pair, root / "gallery", root / "profile", query_rows)


@pytest.fixture
async def psp_service(digits_deployment: DigitsDeployment) -> AsyncIterator[Running]:
    """The service with `external` encoders (5 old classes, 10 new ones), default mode psp."""
    settings = Settings(
        old=EncoderSettings(backend="external", dim=5, model_id="digits-old"),
        new=EncoderSettings(backend="external", dim=10, model_id="digits-new"),
        index=IndexSettings(gallery_dir=digits_deployment.gallery_dir, nprobe=4),
        compat=CompatSettings(profile_dir=digits_deployment.profile_dir, default_mode="psp"),
    )
    async with serving(settings) as running:
        yield running


async def test_psp_answers_from_new_logits_like_the_offline_path(
    psp_service: Running, digits_deployment: DigitsDeployment
) -> None:
    d = digits_deployment
    logits = encode(d.pair.new, d.pair.splits.x[d.query_rows])[1]
    response = await psp_service.search(queries=[{"new_embedding": z.tolist()} for z in logits], k=10, mode="psp")
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    pipeline = psp_service.pipeline
    offline = transform(pipeline.profile, "psp", None, logits, "text").queries
    np.testing.assert_array_equal(offline, psp.query_features(logits, OLD_CLASSES, "psp"))
    _, ids = pipeline.gallery.search(offline, 10, 4)
    for row, result in enumerate(results):
        assert result["mode"] == "psp" and result["ids"] == ids[row].tolist()
    assert pipeline.profile.modes() == ["psp"]


async def test_psp_deployment_refusals(psp_service: Running, digits_deployment: DigitsDeployment) -> None:
    d = digits_deployment
    z = encode(d.pair.new, d.pair.splits.x[d.query_rows[:1]])[1][0].tolist()
    for mode in ("adapter", "slerp", "old", "compare"):
        response = await psp_service.search(queries=[{"new_embedding": z}], mode=mode)
        assert_error(response, 400, "unsupported_mode", "psp")
    text = await psp_service.search(queries=[{"text": "a digit"}])
    assert_error(text, 400, "invalid_input", "precomputed embeddings", "new_embedding")
    wrong_width = await psp_service.search(queries=[{"new_embedding": z[:5]}])
    assert_error(wrong_width, 400, "invalid_input", "new_embedding has 5 values; expected 10")
    alpha = await psp_service.search(queries=[{"new_embedding": z}], alpha=0.5)
    assert_error(alpha, 400, "invalid_input", "alpha")
    ok = await psp_service.search(queries=[{"new_embedding": z}], k=3)
    assert ok.status_code == 200 and len(ok.json()["results"][0]["ids"]) == 3
