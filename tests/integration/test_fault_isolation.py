"""A bad input costs only its own request on the old encoder and for image queries too (issue 31, item 3).

Each test sends one bad request among clean ones sent at the same moment (coalesced into one batch by a
50 ms batching window) and asserts every request's status and error code: the bad one gets its own
error, every clean one 200.  The encoders are tests/support/faulty_encoder.py's `faulty-*` backends; an
image carries its fault in a PNG text chunk and is decoded in the encoder, as the `clip` backend does.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import time
import zlib
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from service import metrics
from service.settings import ApiSettings, CompatSettings, EncoderSettings, IndexSettings, Settings
from tests.support.app import Running, encoder_threads_left, serving
from tests.support.faulty_encoder import faulty_image, install
from tests.support.world import CAPTION, World

install()
HANG_S = 1.2  # past each encoder's 0.5 s timeout; short, so no hung thread outlives the test by much
CLEAN = 3  # clean requests sent beside each bad one
TIMED_OUT, FAILED = (504, "encoder_timeout"), (500, "encoder_failed")  # a hung call's answer, a raising one's


def isolating_settings(world: World, **api: Any) -> Settings:
    """Both encoders faulty, one replica each, a 0.5 s timeout and a 50 ms window that coalesces a burst."""
    encoder = {"timeout_s": 0.5, "max_wait_ms": 50.0, "max_batch_size": 32}
    return Settings(
        old=EncoderSettings(backend="faulty-old", **encoder),
        new=EncoderSettings(backend="faulty-new", **encoder),
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=8),
        compat=CompatSettings(profile_dir=world.profile_dir),
        api=ApiSettings(shed_lag_ms=0, **api),
    )


@pytest.fixture(autouse=True)
def short_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.support.faulty_encoder.HANG_S", HANG_S)


async def beside_clean(running: Running, bad: dict[str, Any], clean: list[dict[str, Any]], **body: Any) -> Any:
    """Send the bad query and each clean one as requests of their own, all at once: (bad answer, clean answers)."""
    answers = await asyncio.gather(*(running.search(queries=[query], **body) for query in [bad, *clean]))
    return answers[0], answers[1:]


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text


def assert_served(answers: list[httpx.Response], k: int = 10) -> None:
    for response in answers:
        assert response.status_code == 200, response.text
        assert len(response.json()["results"][0]["ids"]) == k


async def assert_only_the_bad_one_fails(
    running: Running,
    bad: dict[str, Any],
    clean: list[dict[str, Any]],
    error: tuple[int, str],
    split: tuple[str, str] | None,
    **body: Any,
) -> None:
    """The bad query sent beside clean ones: it alone gets `error` (status, code), each clean one is served, and
    where `split` (encoder, cause) is given, its batch was split: the bad call had batch-mates and cost them nothing."""
    split_before = splits(*split) if split else 0.0
    failed, served = await beside_clean(running, bad, clean, **body)
    assert_error(failed, *error)
    assert_served(served)
    if split:
        assert splits(*split) > split_before


def texts(start: int) -> list[dict[str, Any]]:
    return [{"text": CAPTION.format(start + i)} for i in range(CLEAN)]


def images(start: int) -> list[dict[str, Any]]:
    return [{"image_b64": faulty_image(colour=(start + i, 40, 90))} for i in range(CLEAN)]


def sample(name: str, **labels: str) -> float:
    """A counter's value now (0 when never incremented)."""
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def splits(encoder: str, cause: str) -> float:
    """Batches of several calls split after they hung or raised: > 0 shows the bad call had batch-mates."""
    return sample("nobackfill_encoder_splits_total", encoder=encoder, cause=cause)


# ---- the old encoder -----------------------------------------------------------------------------


async def test_an_input_that_hangs_the_old_encoder_costs_only_its_request_and_its_retry_is_refused(
    world: World,
) -> None:
    async with serving(isolating_settings(world)) as running:
        bad = {"text": CAPTION.format(100) + " !hang-old"}
        await assert_only_the_bad_one_fails(running, bad, texts(101), TIMED_OUT, ("old", "timeout"), mode="old")
        before = sample("nobackfill_poison_refusals_total", encoder="old")
        started = time.perf_counter()
        retry = await running.search(queries=[bad], mode="old")
        refused_in = time.perf_counter() - started
        assert_error(retry, 422, "poison_input")
        assert refused_in < HANG_S  # refused before any encoder call: it never waits for the hang
        assert sample("nobackfill_poison_refusals_total", encoder="old") == before + 1
        assert_served([await running.search(queries=[{"text": CAPTION.format(110)}], mode="old")])
        assert (await running.client.get("/readyz")).status_code == 200


@pytest.mark.parametrize("fault", ["raise", "nan"])
async def test_an_input_that_fails_the_old_encoder_costs_only_its_request(world: World, fault: str) -> None:
    async with serving(isolating_settings(world)) as running:
        bad = {"text": CAPTION.format(120) + f" !{fault}-old"}
        # A raise splits its batch and re-runs each call alone (a NaN row fails only its own call: no split).
        split = ("old", "raised") if fault == "raise" else None
        await assert_only_the_bad_one_fails(running, bad, texts(121), FAILED, split, mode="old")
        # A failure is not a hang: the same input is tried again, not refused.
        assert_error(await running.search(queries=[bad], mode="old"), 500, "encoder_failed")


async def test_a_hang_on_the_old_side_of_a_blending_mode_costs_only_its_request(world: World) -> None:
    # Both encoders run for slerp; only the old one hangs.  The new encoder's answer is not enough alone.
    async with serving(isolating_settings(world)) as running:
        bad = {"text": CAPTION.format(130) + " !hang-old"}
        await assert_only_the_bad_one_fails(running, bad, texts(131), TIMED_OUT, ("old", "timeout"), mode="slerp")
        assert_error(await running.search(queries=[bad], mode="slerp"), 422, "poison_input")


# ---- image queries -------------------------------------------------------------------------------
# The session's profile was fitted on text only: image queries name their alpha.


@pytest.mark.parametrize("role", ["old", "new"])
async def test_an_image_that_hangs_an_encoder_costs_only_its_request_and_its_retry_is_refused(
    world: World, role: str
) -> None:
    async with serving(isolating_settings(world)) as running:
        bad = {"image_b64": faulty_image(f"!hang-{role}")}
        await assert_only_the_bad_one_fails(
            running, bad, images(10), TIMED_OUT, (role, "timeout"), mode="slerp", alpha=0.5
        )
        assert_error(await running.search(queries=[bad], mode="slerp", alpha=0.5), 422, "poison_input")
        # The poison memory keys the image itself: another image is served.
        assert_served([await running.search(queries=images(20)[:1], mode="slerp", alpha=0.5)])


@pytest.mark.parametrize("role", ["old", "new"])
async def test_an_image_that_fails_an_encoder_costs_only_its_request(world: World, role: str) -> None:
    async with serving(isolating_settings(world)) as running:
        bad = {"image_b64": faulty_image(f"!raise-{role}")}
        await assert_only_the_bad_one_fails(running, bad, images(30), FAILED, (role, "raised"), mode="slerp", alpha=0.5)


def truncated_jpeg() -> str:
    """A JPEG cut short: its header reads (the API's check lets it in), its pixels do not decode."""
    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return base64.b64encode(buffer.getvalue()[:-200]).decode()


def png_header_only(width: int, height: int) -> str:
    """A valid PNG that declares width x height grey pixels and holds none (a decompression bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


def noise_png(side: int) -> str:
    """A PNG of random pixels (it barely compresses: about 3 x side^2 bytes)."""
    pixels = np.random.default_rng(side).integers(0, 255, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


BAD_IMAGES = {
    # refused by the API's check, before any encoder
    "not an image": (base64.b64encode(b"plain text, not an image").decode(), "is not a readable image"),
    "over the byte cap": (noise_png(64), "byte limit"),  # ~12 kB against a 4 kB cap
    "over the pixel cap": (faulty_image(side=80), "pixel limit"),  # 6,400 pixels against 4,096
    "past PIL's bomb limit": (png_header_only(20_000, 20_000), "pixel limit"),
    # let in by the header check, refused by the encoder's decode (as clip's would refuse it)
    "truncated JPEG": (truncated_jpeg(), "image 0 is not a readable image"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
async def test_a_malformed_or_oversized_image_is_a_400_of_its_own(world: World, case: str) -> None:
    payload, message = BAD_IMAGES[case]
    async with serving(isolating_settings(world, max_image_bytes=4096, max_image_pixels=64 * 64)) as running:
        bad, clean = await beside_clean(running, {"image_b64": payload}, images(40), mode="slerp", alpha=0.5)
        assert_error(bad, 400, "invalid_input")
        assert message in bad.json()["error"]["message"]
        assert_served(clean)


# ---- text at the limit ---------------------------------------------------------------------------


async def test_a_text_at_the_length_limit_is_served_beside_others_and_one_past_it_is_a_400(world: World) -> None:
    limit = 2048  # api.max_text_chars: what reaches a tokenizer, which truncates at its own limit
    async with serving(isolating_settings(world, max_text_chars=limit)) as running:
        at_limit = {"text": ((CAPTION.format(200) + " ") * 100)[:limit]}
        assert len(at_limit["text"]) == limit
        long, clean = await beside_clean(running, at_limit, texts(201), mode="slerp")
        assert_served([long, *clean])
        past = {"text": at_limit["text"] + "x"}
        refused, clean = await beside_clean(running, past, texts(210), mode="slerp")
        assert_error(refused, 400, "invalid_input")
        assert_served(clean)


def test_no_hung_thread_is_left_behind() -> None:
    # The hung calls above return within HANG_S: then no encoder thread lingers.
    assert encoder_threads_left() == []
