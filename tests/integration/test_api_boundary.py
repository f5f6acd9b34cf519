"""The API boundary: one error envelope with a request id, the body cap, admin lock-down, keys, metrics port.

In process through the real ASGI stack (httpx's ASGI transport, or raw ASGI calls where the test
must control how the body arrives).  What only a socket shows (the body cap of a served process):
tests/system/test_serve_process.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api import inputs
from service.api.app import create_app
from service.api.auth import key_matches
from service.errors import (
    EncoderError,
    EncoderFailed,
    EncoderProcessExited,
    EncoderTimeout,
    GalleryUnavailable,
    InputError,
    NotReady,
    Overloaded,
    SettingsError,
    Unavailable,
)
from tests.support.app import Running, serving
from tests.support.servers import free_port
from tests.support.world import CAPTION, World, make_settings

API_KEY, ADMIN_KEY = "search-key", "admin-key"
SEARCH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
RELOAD = "/v1/admin/reload-profile"


def assert_envelope(response: httpx.Response, status: int, code: str) -> dict[str, str]:
    """The one error shape, its request id equal to the X-Request-ID header; returns the error object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "request_id"}, body
    assert body["error"]["code"] == code, body
    assert body["error"]["request_id"] == response.headers["x-request-id"]
    return dict(body["error"])


@pytest.fixture
async def locked(world: World) -> AsyncIterator[Running]:
    """The service with both keys set, reloads confined to the world's folder."""
    settings = make_settings(
        world, api={"api_key": API_KEY, "admin_key": ADMIN_KEY, "profiles_root": str(world.profile_dir.parent)}
    )
    async with serving(settings) as running:
        yield running


async def test_every_error_status_has_the_envelope(locked: Running) -> None:
    client = locked.client
    assert_envelope(await client.get("/no/such/route"), 404, "not_found")
    refused = await client.delete("/v1/search")
    assert_envelope(refused, 405, "method_not_allowed")
    assert refused.headers["allow"] == "POST"
    unauthorized = await client.post("/v1/search", json={"queries": [{"text": "x"}]})
    assert_envelope(unauthorized, 401, "unauthorized")
    assert unauthorized.headers["www-authenticate"] == "Bearer"
    assert_envelope(await client.post("/v1/search", json={"queries": "x"}, headers=SEARCH), 422, "invalid_request")
    bad_json = await client.post("/v1/search", content=b"{", headers={**SEARCH, "content-type": "application/json"})
    assert "not valid JSON" in assert_envelope(bad_json, 422, "invalid_request")["message"]
    untyped = await client.post("/v1/search", content=b'{"queries": [{"text": "x"}]}', headers=SEARCH)  # curl -d
    assert "Content-Type: application/json" in assert_envelope(untyped, 422, "invalid_request")["message"]
    a_list = await client.post("/v1/search", json=[{"text": "x"}], headers=SEARCH)
    assert "must be a JSON object" in assert_envelope(a_list, 422, "invalid_request")["message"]
    assert_envelope(await client.post("/v1/search", json={"queries": []}, headers=SEARCH), 400, "invalid_input")
    many = {"queries": [{"text": "x"}] * 65}
    assert_envelope(await client.post("/v1/search", json=many, headers=SEARCH), 413, "too_many_queries")


async def test_not_ready_is_503_in_the_envelope(world: World) -> None:
    app = create_app(make_settings(world))  # lifespan not run: nothing loaded yet
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert_envelope(await client.get("/v1/info"), 503, "not_ready")


async def test_request_id_is_echoed_when_sane_and_replaced_otherwise(locked: Running) -> None:
    echoed = await locked.client.get("/healthz", headers={"X-Request-ID": "trace-42.a:b"})
    assert echoed.headers["x-request-id"] == "trace-42.a:b"
    for insane in ("two words", "x" * 129, "line\tbreak"):
        replaced = await locked.client.get("/no/route", headers={"X-Request-ID": insane})
        assert replaced.headers["x-request-id"] != insane
        assert assert_envelope(replaced, 404, "not_found")["request_id"] == replaced.headers["x-request-id"]
    first, second = [await locked.client.get("/healthz") for _ in range(2)]
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


@pytest.mark.parametrize(
    "failure",
    [RuntimeError("faiss: index /srv/secret/index.faiss is corrupt"), OSError(5, "Input/output error", "/srv/secret")],
)
async def test_a_foreign_exception_is_a_500_without_internals_and_is_logged(
    locked: Running, failure: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken_search(*_: Any, **__: Any) -> Any:
        raise failure

    locked.pipeline.search = broken_search
    with caplog.at_level(logging.ERROR, logger="nobackfill"):
        response = await locked.client.post("/v1/search", json={"queries": [{"text": "x"}]}, headers=SEARCH)
    error = assert_envelope(response, 500, "internal")
    assert "secret" not in response.text and "faiss" not in response.text
    logged = [r for r in caplog.records if error["request_id"] in r.getMessage()]
    assert logged and logged[0].exc_info is not None and logged[0].exc_info[1] is failure


def test_errors_come_in_families() -> None:
    for unavailable in (NotReady("x"), Overloaded("x"), GalleryUnavailable("x")):
        assert isinstance(unavailable, Unavailable) and unavailable.status == 503
    for encoder in (EncoderFailed("x"), EncoderTimeout("x"), EncoderProcessExited("x")):
        assert isinstance(encoder, EncoderError) and not isinstance(encoder, Unavailable | InputError)
    assert isinstance(SettingsError("x"), InputError) and not isinstance(SettingsError("x"), Unavailable)
    assert EncoderProcessExited("x").code == EncoderFailed("x").code == "encoder_failed"


@pytest.mark.parametrize(
    ("refusal", "code", "level"),
    [
        (
            GalleryUnavailable("the gallery (Milvus collection 'c') did not answer within 2 s"),
            "gallery_unavailable",
            logging.WARNING,
        ),
        (NotReady("still loading"), "not_ready", logging.DEBUG),
        (Overloaded("256 queries in flight"), "overloaded", logging.DEBUG),
    ],
)
async def test_a_503_refusal_is_one_log_line_without_a_traceback(
    locked: Running, refusal: Unavailable, code: str, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    async def refusing_search(*_: Any, **__: Any) -> Any:
        raise refusal from OSError(111, "Connection refused")  # a cause, as a Milvus outage has one

    locked.pipeline.search = refusing_search
    with caplog.at_level(logging.DEBUG, logger="nobackfill"):
        response = await locked.client.post("/v1/search", json={"queries": [{"text": "x"}]}, headers=SEARCH)
    error = assert_envelope(response, 503, code)
    assert error["message"] == refusal.message
    logged = [r for r in caplog.records if error["request_id"] in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is None and logged[0].levelno == level
    assert f"refused: {code}: {refusal.message}" in logged[0].getMessage() and "\n" not in logged[0].getMessage()


async def test_access_line_carries_the_request_id(world: World, caplog: pytest.LogCaptureFixture) -> None:
    async with serving(make_settings(world, api={"access_log": True})) as running:
        with caplog.at_level(logging.INFO, logger="nobackfill.access"):
            response = await running.client.get("/healthz", headers={"X-Request-ID": "abc-123"})
        assert response.status_code == 200
        lines = [r.getMessage() for r in caplog.records if r.name == "nobackfill.access"]
        assert any('"GET /healthz" 200' in line and "id=abc-123" in line for line in lines), lines


async def call_raw(app: Any, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, int, bytes]:
    """POST /v1/search through the raw ASGI interface: (status, chunks the app pulled, response body)."""
    pulled = 0

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        if pulled >= len(chunks):
            return {"type": "http.disconnect"}
        pulled += 1
        return {"type": "http.request", "body": chunks[pulled - 1], "more_body": pulled < len(chunks)}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/search",
        "raw_path": b"/v1/search",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], pulled, body


async def test_body_cap_stops_reading_at_the_limit_and_honours_content_length(world: World) -> None:
    async with serving(make_settings(world, api={"max_body_bytes": 4096})) as running:
        chunks = [b'{"queries": [' + b" " * 1000] + [b" " * 1024] * 99  # ~100 kB, never finished
        status, pulled, body = await call_raw(running.app, [], chunks)
        assert status == 413 and b"body_too_large" in body
        assert pulled == 5, "reading must stop at the first chunk past the cap"
        status, pulled, body = await call_raw(running.app, [(b"content-length", b"1000000000")], chunks)
        assert status == 413 and b"body_too_large" in body and pulled == 0
        ok = await running.client.post("/v1/search", json={"queries": [{"text": CAPTION.format(2)}]})
        assert ok.status_code == 200, ok.text


async def test_images_are_checked_off_the_event_loop(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    real_verify = inputs.verify_image

    def recording_verify(payload: str, what: str, max_pixels: int) -> None:
        threads.append(threading.get_ident())
        real_verify(payload, what, max_pixels)

    monkeypatch.setattr(inputs, "verify_image", recording_verify)
    async with serving(make_settings(world)) as running:
        response = await running.search(queries=[{"image_b64": "aGVsbG8="}])
        assert_envelope(response, 400, "invalid_input")
        assert threads and threading.get_ident() not in threads


async def test_admin_routes_are_off_without_an_admin_key(world: World) -> None:
    async with serving(make_settings(world, api={"api_key": API_KEY})) as running:
        for headers in ({}, SEARCH):
            assert_envelope(await running.client.post(RELOAD, headers=headers), 404, "not_found")
        assert RELOAD not in (await running.client.get("/openapi.json")).json()["paths"]


async def test_openapi_declares_bearer_security_only_for_the_keys_configured(world: World, locked: Running) -> None:
    keyed = (await locked.client.get("/openapi.json")).json()
    assert keyed["paths"]["/v1/search"]["post"]["security"] == [{"ApiKey": []}]
    assert set(keyed["components"]["securitySchemes"]) == {"ApiKey", "AdminKey"}
    async with serving(make_settings(world)) as running:  # keyless, as `make demo` serves
        keyless = (await running.client.get("/openapi.json")).json()
        assert "security" not in keyless["paths"]["/v1/search"]["post"]
        assert "securitySchemes" not in keyless.get("components", {})


async def test_search_and_admin_refuse_a_missing_or_wrong_key(locked: Running) -> None:
    body = {"queries": [{"text": CAPTION.format(3)}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}, ADMIN):
        assert_envelope(await locked.client.post("/v1/search", json=body, headers=headers), 401, "unauthorized")
    for headers in ({}, {"Authorization": "Bearer wrong"}, SEARCH):
        assert_envelope(await locked.client.post(RELOAD, headers=headers), 401, "unauthorized")
    assert (await locked.client.post("/v1/search", json=body, headers=SEARCH)).status_code == 200
    assert (await locked.client.post(RELOAD, headers=ADMIN)).status_code == 200


def test_key_comparison() -> None:
    from fastapi.security import HTTPAuthorizationCredentials
    from pydantic import SecretStr

    def bearer(token: str) -> HTTPAuthorizationCredentials:
        return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)

    assert key_matches(bearer("k3y"), SecretStr("k3y"))
    assert not key_matches(bearer("k3y-and-more"), SecretStr("k3y"))
    assert not key_matches(None, SecretStr("k3y"))


async def test_reload_is_confined_to_the_profiles_root(
    world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, outside_dir = tmp_path / "profiles", tmp_path / "outside"
    shutil.copytree(world.profile_dir, root / "v2")
    shutil.copytree(world.profile_dir, outside_dir)
    (root / "escape").symlink_to(outside_dir)  # a link inside the root to a profile outside it
    outside = [
        "/etc",
        "/no/such/folder",
        str(outside_dir),
        "../outside",
        "v2/../../outside",
        "escape",
        "escape/../v2",
        "bad\x00name",
    ]
    settings = make_settings(world, api={"admin_key": ADMIN_KEY, "profiles_root": str(root)})
    async with serving(settings) as running:
        before = running.pipeline.profile.profile_id
        messages = set()
        with caplog.at_level(logging.WARNING, logger="nobackfill"):
            for given in outside:
                refused = await running.client.post(RELOAD, json={"profile_dir": given}, headers=ADMIN)
                messages.add(assert_envelope(refused, 400, "invalid_input")["message"])
        assert len(messages) == 1, messages  # one answer, whatever exists out there
        assert str(tmp_path) not in messages.pop()
        refusals = [r for r in caplog.records if "admin reload of" in r.getMessage() and "refused" in r.getMessage()]
        assert len(refusals) == len(outside)
        assert running.pipeline.profile.profile_id == before
        for inside in ("v2", str(root / "v2"), "v2/../v2"):
            reloaded = await running.client.post(RELOAD, json={"profile_dir": inside}, headers=ADMIN)
            assert reloaded.status_code == 200 and reloaded.json()["profile_id"] == before, reloaded.text
        missing = await running.client.post(RELOAD, json={"profile_dir": "no-profile-here"}, headers=ADMIN)
        assert_envelope(missing, 400, "bad_artifact")
        too_long = await running.client.post(RELOAD, json={"profile_dir": "x" * 5000}, headers=ADMIN)
        assert "cannot be read" in assert_envelope(too_long, 400, "invalid_input")["message"]


async def test_openapi_declares_the_error_envelope_for_every_error_status(locked: Running) -> None:
    document = (await locked.client.get("/openapi.json")).json()
    assert "HTTPValidationError" not in document["components"]["schemas"]
    probes = {"/healthz", "/readyz"}  # health probes answer 503 with their own status body
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            errors = {status: r for status, r in operation["responses"].items() if not status.startswith("2")}
            assert "500" in errors or path in probes, (method, path)
            for status, response in errors.items():
                if path not in probes:
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
    limits = document["components"]["schemas"]["SearchRequest"]["properties"]
    assert limits["queries"]["maxItems"] == 64 and limits["k"]["maximum"] == 1000


async def test_metrics_move_to_their_own_port(world: World) -> None:
    port = free_port()
    async with serving(make_settings(world, api={"metrics_port": port})) as running:
        assert_envelope(await running.client.get("/metrics"), 404, "not_found")
        async with httpx.AsyncClient() as scraper:
            scraped = await scraper.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            assert scraped.status_code == 200 and "nobackfill_requests_total" in scraped.text
            assert (await scraper.get(f"http://127.0.0.1:{port}/other", timeout=10)).status_code == 404
    await asyncio.sleep(0)
    with socket.socket() as probe:  # stopped with the app: the port is free again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))


async def test_a_refused_sighup_reload_is_logged_with_its_reason(
    world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profile = tmp_path / "profile"
    shutil.copytree(world.profile_dir, profile)
    settings = make_settings(world)
    settings.compat.profile_dir = profile
    async with serving(settings) as running:
        before = running.pipeline.profile.profile_id
        (profile / "profile.json").write_text("{not json")
        with caplog.at_level(logging.INFO, logger="nobackfill"):
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(200):  # the reload runs as a task on this loop: let it finish
                await asyncio.sleep(0.05)
                if any("SIGHUP: profile reload" in r.getMessage() for r in caplog.records):
                    break
        refused = [r.getMessage() for r in caplog.records if "SIGHUP: profile reload refused" in r.getMessage()]
        assert refused and "profile.json" in refused[0], [r.getMessage() for r in caplog.records]
        assert running.pipeline.profile.profile_id == before
