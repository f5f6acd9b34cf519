"""The operator page's routes through the real stack: off by default, its headers, the key, the item texts,
the saved eval and compare results."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from PIL import Image

from service import metrics
from service.api.ui import thumbs
from service.encoders.synthetic import IMAGE_VIEW, format_item
from service.errors import ArtifactError
from service.items.store import write_item_store
from service.settings import IndexSettings
from service.vocabulary import Modality
from tests.support.app import Running, serving
from tests.support.browser import save_results
from tests.support.world import CAPTION, WORLD_GALLERY_SIZE, World, make_settings, write_world_items

KEY = "ui-key"


@pytest.fixture(scope="module")
def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The world's item store."""
    return write_world_items(tmp_path_factory.mktemp("ui-items") / "items", WORLD_GALLERY_SIZE, "test")


@pytest.fixture(scope="module")
def saved(world: World, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A saved eval of the world's profile and a saved comparison of it with itself."""
    return save_results(world, tmp_path_factory.mktemp("ui-saved"))


@pytest.fixture
async def page(world: World, items: Path, saved: tuple[Path, Path]) -> AsyncIterator[Running]:
    """The service with the page on, an API key, the item store and the saved results."""
    index = IndexSettings(gallery_dir=world.gallery_dir, nprobe=16, item_store=items)
    api = {"ui": True, "api_key": KEY, "ui_eval": saved[0], "ui_compare": saved[1]}
    async with serving(make_settings(world, api=api).model_copy(update={"index": index})) as s:
        yield s


async def test_no_page_unless_it_is_asked_for(world: World) -> None:
    async with serving(make_settings(world)) as running:
        for path in ("/ui/", "/ui/app.js", "/ui/api/config", "/ui/api/health"):
            assert (await running.client.get(path)).status_code == 404, path


async def test_the_page_and_its_files_carry_a_strict_csp(page: Running) -> None:
    for path, kind in (("/ui/", "text/html"), ("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
        response = await page.client.get(path)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind), path
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self';" in csp and "unsafe" not in csp
        assert response.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in (await page.client.get("/ui/")).text  # nothing inline for the CSP to allow
    assert (await page.client.get("/ui/../pyproject.toml")).status_code == 404
    assert (await page.client.get("/ui/pages.py")).status_code == 404  # only the three page files are served
    assert (await page.client.get("/ui", follow_redirects=False)).headers["location"] == "/ui/"
    assert "/ui/api/items" not in (await page.client.get("/openapi.json")).text  # the page's own, not the API


async def test_item_texts_take_the_api_key(page: Running) -> None:
    body = {"ids": [42, 7, -1, 10**9]}
    assert (await page.client.post("/ui/api/items", json=body)).status_code == 401
    response = await page.client.post("/ui/api/items", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.json() == {
        "store": True,
        "modality": "text",
        "items": {"7": format_item(7, IMAGE_VIEW), "42": format_item(42, IMAGE_VIEW), str(10**9): None},
    }
    assert (await page.client.get("/ui/api/config")).json() == {"api_key_required": True}


async def test_without_an_item_store_the_page_gets_ids_only(world: World) -> None:
    async with serving(make_settings(world, api={"ui": True})) as running:
        response = await running.client.post("/ui/api/items", json={"ids": [1, 2]})
        assert response.json() == {"store": False, "modality": None, "items": {}}
        assert (await running.client.get("/ui/api/config")).json() == {"api_key_required": False}


async def test_health_counts_the_searches_since_the_last_look(page: Running) -> None:
    first = (await page.client.get("/ui/api/health")).json()
    assert first["status"] == "ready" and first["problems"] == []
    auth = {"Authorization": f"Bearer {KEY}"}
    for i in range(3):
        body = {"queries": [{"text": CAPTION.format(i)}], "k": 5}
        assert (await page.client.post("/v1/search", json=body, headers=auth)).status_code == 200
    health = (await page.client.get("/ui/api/health")).json()
    assert health["recent"]["requests"] == 3
    assert 0 < health["recent"]["p50_ms"] <= health["recent"]["p99_ms"]
    assert health["recent"]["cache_hit_ratio"] == 0.0  # three new queries: three misses
    assert set(health["encoders"]) == {"old", "new"}
    # The process's own counter (other tests in this process may have restarted a child before).
    restarts = metrics.REGISTRY.get_sample_value("nobackfill_encoder_process_restarts_total", {"encoder": "old"})
    assert health["encoders"]["old"]["process_restarts"] == restarts


async def test_profile_carries_the_fit_report_without_tensors(page: Running) -> None:
    data = (await page.client.get("/ui/api/profile")).json()
    assert data["profile"]["id"] == page.pipeline.profile.profile_id
    assert data["profile"]["fit_report"]["support_recall"]
    assert "tensors" not in data["profile"]
    assert data["gallery"]["fingerprint"] == page.pipeline.gallery.fingerprint


async def test_profile_carries_the_saved_eval_and_compare_of_the_served_profile(
    page: Running, saved: tuple[Path, Path]
) -> None:
    data = (await page.client.get("/ui/api/profile")).json()
    served = page.pipeline.profile.profile_id
    assert data["eval"] == json.loads(saved[0].read_text()) and data["eval"]["profile_id"] == served
    methods = [row["method"] for row in data["eval"]["rows"]]
    assert methods[:2] == ["old", "new"] and "slerp" in methods
    assert data["compare"]["profile_id"] == data["compare"]["candidate_profile_id"] == served
    assert data["compare"]["outcome"] == "pass" and data["compare"]["difference"]["broken"] == 0  # itself
    assert data["notes"] == []


async def test_a_saved_eval_of_another_profile_is_refused_at_start(
    world: World, saved: tuple[Path, Path], tmp_path: Path
) -> None:
    mine = json.loads(saved[0].read_text())
    (tmp_path / "other.json").write_text(json.dumps(mine | {"profile_id": "0123456789ab"}))
    with pytest.raises(ArtifactError) as refused:
        async with serving(make_settings(world, api={"ui": True, "ui_eval": tmp_path / "other.json"})):
            pass
    assert refused.value.message == (
        f"api.ui_eval={tmp_path / 'other.json'}: scores profile '0123456789ab', "
        f"but this service serves {mine['profile_id']!r}"
    )


@pytest.fixture(scope="module")
def image_items(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An image item store over the world's ids: a 300x200 picture, a text file, a missing file, an oversized
    file and a relative path, the rest the picture again."""
    folder = tmp_path_factory.mktemp("ui-images")
    Image.new("RGB", (300, 200), (200, 40, 40)).save(folder / "wide.png")
    (folder / "notes.png").write_text("not an image")
    with (folder / "big.jpg").open("wb") as f:
        f.truncate(thumbs.MAX_BYTES + 1)  # sparse: costs no disk
    special = {1: folder / "notes.png", 2: folder / "gone.png", 3: folder / "big.jpg", 4: Path("wide.png")}
    rows = ((i, str(special.get(i, folder / "wide.png"))) for i in range(WORLD_GALLERY_SIZE))
    write_item_store(folder / "items", rows, Modality.image, "test images")
    return folder / "items"


async def test_thumbnails_come_from_the_item_store_only_for_image_files(world: World, image_items: Path) -> None:
    index = IndexSettings(gallery_dir=world.gallery_dir, nprobe=16, item_store=image_items)
    settings = make_settings(world, api={"ui": True, "api_key": KEY}).model_copy(update={"index": index})
    auth = {"Authorization": f"Bearer {KEY}"}
    async with serving(settings) as running:
        assert (await running.client.get("/ui/api/thumb/0")).status_code == 401  # the gallery's content: the key
        response = await running.client.get("/ui/api/thumb/0", headers=auth)
        assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
        with Image.open(io.BytesIO(response.content)) as shown:
            assert (shown.format, shown.size) == ("JPEG", (thumbs.SIDE, thumbs.SIDE * 2 // 3))
        for item, why in (
            (1, "not an image Pillow can read"),
            (2, "no image file"),
            (3, f"more than {thumbs.MAX_BYTES:,}"),
            (4, "not absolute"),
            (10**9, "not in the item store"),
        ):
            refused = await running.client.get(f"/ui/api/thumb/{item}", headers=auth)
            assert refused.status_code == 404 and why in refused.json()["error"]["message"], item
        for not_an_id in ("etc-passwd", "..%2F..%2Fetc%2Fpasswd"):  # an id or nothing: no path reaches the route
            assert (await running.client.get(f"/ui/api/thumb/{not_an_id}", headers=auth)).status_code in (404, 422)


async def test_no_thumbnails_from_a_text_item_store(page: Running) -> None:
    refused = await page.client.get("/ui/api/thumb/7", headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 404 and "holds no images" in refused.json()["error"]["message"]
