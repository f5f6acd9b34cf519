"""The operator page (/ui) in a real Chromium against a real `nobackfill serve` on the synthetic world.

One server (UI on, an API key, an item store holding one hostile item, a quarter-moved segment) and
one browser for the whole module; each test gets a fresh tab context, so a key typed in one test is
not known in the next.  Screenshots and the measured render times go to artifacts/browser/.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import sync_playwright

from service.encoders.synthetic import IMAGE_VIEW, format_item
from tests.support.browser import (
    API_KEY,
    ARTEFACTS,
    CHROMIUM,
    README_SHOT,
    XSS,
    XSS_ID,
    OperatorWorld,
    build_operator_world,
    save_small,
)
from tests.support.servers import serve_process
from tests.support.world import CAPTION, World

QUERY_ID = 21  # old and slerp both put this item first for its caption
K = 10
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def operator_world(world: World, tmp_path_factory: pytest.TempPathFactory) -> OperatorWorld:
    """The session world with an item store and a segment beside it."""
    return build_operator_world(world, tmp_path_factory.mktemp("operator"))


@pytest.fixture(scope="module")
def base(operator_world: OperatorWorld) -> Iterator[str]:
    """One `nobackfill serve` with the page on and an API key, shared by the module's tests."""
    env = {
        "NOBACKFILL_API__UI": "true",
        "NOBACKFILL_API__API_KEY": API_KEY,
        "NOBACKFILL_INDEX__ITEM_STORE": str(operator_world.items),
        "NOBACKFILL_INDEX__SEGMENT_DIR": str(operator_world.segment),
        "NOBACKFILL_API__UI_EVAL": str(operator_world.eval),
        "NOBACKFILL_API__UI_COMPARE": str(operator_world.compare),
        # Hybrid re-ranks through the item store by default and writes what it encodes into the segment;
        # off here, so the segment stays as the backfill left it and the health panel can match /v1/info.
        "NOBACKFILL_CASCADE__IN_HYBRID": "false",
    }
    with serve_process(operator_world.world, env=env) as url:
        yield url


@pytest.fixture(scope="module")
def keyless_base(operator_world: OperatorWorld) -> Iterator[str]:
    """A second `nobackfill serve` with the page on and no API key (the demo's case)."""
    with serve_process(operator_world.world, env={"NOBACKFILL_API__UI": "true"}) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module; a missing one fails (not skips), saying how `make test` installs it."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make browser` (a step of `make test`) installs Debian's chromium")
    with sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=str(CHROMIUM))
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def info(base: str) -> dict[str, Any]:
    """/v1/info of the served process."""
    return httpx.get(f"{base}/v1/info", timeout=10).json()  # type: ignore[no-any-return]


class Tab:
    """One page in a fresh browser context, with what it logged and every dialog it tried to open."""

    def __init__(self, browser: Any, base: str) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 860})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", self._dialog)
        self.response = self.page.goto(f"{base}/ui/")
        self.page.wait_for_selector("body[data-ready='1']")

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def enter_key(self) -> None:
        """Type the API key into the key box and submit it."""
        self.page.fill("#api-key", API_KEY)
        self.page.press("#api-key", "Enter")

    def search(self, text: str, *, texts: bool = True) -> float:
        """Run one search from the form; the page's own submit-to-rendered time (ms)."""
        self.page.fill("#query", text)
        self.page.set_checked("#with-texts", texts)
        self.page.evaluate("delete document.body.dataset.renderMs")
        ended = self.page.evaluate("Number(document.body.dataset.searchesEnded || 0)")
        self.page.press("#query", "Enter")
        # Wait for this search to end either way, so a refused one fails here with the page's own words.
        self.page.wait_for_selector(f"body[data-searches-ended='{ended + 1}']", state="attached", timeout=120_000)
        rendered = self.page.evaluate("document.body.dataset.renderMs")
        assert rendered is not None, f"the search ended without rendering: {self.page.inner_text('#search-status')!r}"
        return float(rendered)

    def cells(self, mode: str) -> list[tuple[int, str]]:
        """(id, shown text) of each row of one column."""
        rows = self.page.query_selector_all(f".column[data-mode='{mode}'] tbody tr")
        return [
            (int(r.get_attribute("data-id")), r.query_selector("td.text").evaluate("n => n.firstChild.data"))
            for r in rows
        ]


@pytest.fixture
def tab(browser: Any, base: str) -> Iterator[Tab]:
    """A fresh tab on /ui/ (no key typed yet)."""
    opened = Tab(browser, base)
    yield opened
    opened.context.close()


def expected_columns(info: dict[str, Any]) -> list[str]:
    """The columns the page opens with: old, the profile's head, hybrid and new."""
    return [m for m in info["modes"] if m in ("old", info["profile"]["head"], "hybrid", "new")]


def record(name: str, value: Any) -> None:
    """Add a measured figure to artifacts/browser/timings.json (measured, not asserted)."""
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTEFACTS / "timings.json"
    found = json.loads(path.read_text()) if path.exists() else {}
    found[name] = value
    path.write_text(json.dumps(found, indent=2) + "\n")


def test_the_page_loads_with_a_strict_csp_and_no_console_error(tab: Tab) -> None:
    headers = tab.response.headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "unsafe-inline" not in headers["content-security-policy"]
    assert tab.page.query_selector_all("script:not([src])") == []  # no inline script to allow
    assert tab.page.is_visible("#key-form")  # the service has a key: the page asks for it up front
    timing = tab.page.evaluate(
        "(() => { const n = performance.getEntriesByType('navigation')[0];"
        " const f = performance.getEntriesByName('first-render')[0];"
        " return {dom_content_loaded_ms: n.domContentLoadedEventEnd, load_ms: n.loadEventEnd,"
        " first_render_ms: f.startTime}; })()"
    )
    record("first_render", timing)
    assert timing["first_render_ms"] > 0
    assert tab.errors == []


def test_keyboard_only_query_shows_every_column_with_the_item_texts(tab: Tab, info: dict[str, Any]) -> None:
    page = tab.page
    page.focus("body")
    for _ in range(12):  # Tab through the page until the key box has the focus
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "api-key":
            break
    page.keyboard.type(API_KEY)
    page.keyboard.press("Enter")  # the page takes the key and moves the focus to the query box
    assert page.evaluate("document.activeElement.id") == "query"
    page.keyboard.type(CAPTION.format(QUERY_ID))
    page.keyboard.press("Enter")
    page.wait_for_selector("body[data-render-ms]")
    columns = page.eval_on_selector_all(".column", "cs => cs.map(c => c.dataset.mode)")
    assert columns == expected_columns(info) and "hybrid" in columns
    for mode in columns:
        cells = tab.cells(mode)
        assert len(cells) == K, mode
        assert all(text == (XSS if i == XSS_ID else format_item(i, IMAGE_VIEW)) for i, text in cells), mode
    assert tab.cells("slerp")[0][0] == QUERY_ID  # the caption finds its own item
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTEFACTS / "search.png"), full_page=True)
    save_small(ARTEFACTS / "search.png", README_SHOT)
    assert page.inner_text(".column[data-mode='slerp'] .overlap").startswith(f"overlap@{K}: old ")
    assert "search" in page.inner_text(".column[data-mode='old'] .timings")
    assert "residual angle" in page.inner_text(".column[data-mode='slerp'] .meta")
    assert tab.errors == []


def test_a_keyless_service_shows_no_key_bar(browser: Any, keyless_base: str) -> None:
    assert httpx.get(f"{keyless_base}/ui/api/config", timeout=10).json() == {"api_key_required": False}
    keyless = Tab(browser, keyless_base)
    try:
        # In the DOM but hidden: a stylesheet rule that sets display (.bar's flex) must not undo `hidden`.
        assert keyless.page.get_attribute("#key-form", "hidden") is not None
        assert not keyless.page.is_visible("#key-form")
        keyless.search(CAPTION.format(QUERY_ID))  # and searching needs no key
        assert keyless.cells("old")[0][0] == QUERY_ID
        assert keyless.errors == []
    finally:
        keyless.context.close()


def test_a_hit_the_first_column_lacks_is_marked_entered_not_new(tab: Tab) -> None:
    # "new" names the new model on this page (a mode, a column); the mark must not read as it.
    tab.enter_key()
    tab.search(CAPTION.format(QUERY_ID))
    first = {i for i, _ in tab.cells("old")}
    marked = tab.page.eval_on_selector_all(
        ".column[data-mode='new'] tbody tr",
        "rows => rows.map(r => [+r.dataset.id, r.querySelector('.move.fresh')?.textContent ?? null])",
    )
    assert any(i not in first for i, _ in marked), "the new model's top k is the old one's: nothing to mark"
    assert [mark for _, mark in marked] == ["entered" if i not in first else None for i, _ in marked]
    assert "entered" in tab.page.inner_text(".legend")
    assert tab.errors == []


def test_an_item_whose_text_is_html_stays_text(tab: Tab) -> None:
    tab.enter_key()
    tab.search(CAPTION.format(XSS_ID))
    assert (XSS_ID, XSS) in tab.cells("old")
    assert tab.page.query_selector_all("#columns img") == []
    tab.page.wait_for_timeout(300)  # an onerror handler would have fired by now
    assert tab.dialogs == []
    assert tab.errors == []


def test_no_results_without_the_key_and_results_with_it(tab: Tab) -> None:
    tab.page.fill("#query", CAPTION.format(QUERY_ID))
    tab.page.press("#query", "Enter")
    tab.page.wait_for_selector("#search-status.error")
    assert "API key" in tab.page.inner_text("#search-status")
    assert tab.page.query_selector_all(".column") == []
    tab.enter_key()
    tab.search(CAPTION.format(QUERY_ID))
    assert tab.cells("old")[0][0] == QUERY_ID
    # The key lives in the page's memory only: nothing in either storage, no cookie.
    assert tab.page.evaluate("localStorage.length + sessionStorage.length") == 0
    assert tab.context.cookies() == []
    # Chromium logs each keyless 401 itself, one per column's search, some after the page showed the
    # error; a keyed search refused would have left no results above.  Any other error counts.
    assert [e for e in tab.errors if "status of 401 (Unauthorized)" not in e] == []


def test_a_search_the_service_sheds_is_asked_again_after_its_retry_after(tab: Tab) -> None:
    # The browser's own network layer answers the first search request with the service's shed (503
    # overloaded, Retry-After: 1, the body the service sends); every later request goes to the real server.
    shed: list[str] = []

    def first_one_shed(route: Any) -> None:
        if shed:
            route.fallback()
            return
        shed.append(route.request.post_data or "")
        body = {"error": {"code": "overloaded", "message": "overloaded: shed for this test"}}
        route.fulfill(status=503, headers={"Retry-After": "1"}, content_type="application/json", body=json.dumps(body))

    tab.page.route("**/v1/search", first_one_shed)
    tab.enter_key()
    tab.search(CAPTION.format(QUERY_ID))
    assert len(shed) == 1
    assert tab.cells("old")[0][0] == QUERY_ID  # every column rendered, the shed one after its retry
    assert [e for e in tab.errors if "status of 503" not in e] == []


def test_the_health_panel_matches_v1_info(tab: Tab, base: str, info: dict[str, Any]) -> None:
    body = {"queries": [{"text": CAPTION.format(7)}], "k": 5}
    assert httpx.post(f"{base}/v1/search", json=body, headers=AUTH, timeout=30).status_code == 200
    tab.page.click(".tab[data-view='health']")
    tab.page.wait_for_selector("[data-field='health.status']")

    def shown(field: str) -> str:
        return tab.page.inner_text(f"[data-field='{field}']")

    assert shown("health.status") == "ready"
    assert shown("gallery.fingerprint") == info["gallery"]["fingerprint"]
    assert shown("gallery.ntotal") == f"{info['gallery']['ntotal']:,}"
    assert shown("profile.id") == f"{info['profile']['id']} ({info['profile']['head']})"
    assert shown("default_mode") == info["default_mode"]
    assert shown("modes") == ", ".join(info["modes"])
    assert shown("cache.kind") == info["cache"]["kind"]
    assert shown("cache.state") == info["cache"]["state"]
    assert shown("old_model.id") == info["old_model"]["id"]
    assert shown("new_model.id") == info["new_model"]["id"]
    assert shown("items.count") == f"{info['items']['count']:,} items"
    segment = info["segment"]
    assert shown("segment.moved") == f"{segment['moved']:,} of {segment['gallery_items']:,}"
    assert shown("segment.coverage") == f"{segment['coverage'] * 100:.2f} %"
    assert int(shown("recent.requests").replace(",", "")) >= 1  # at least the search above
    assert shown("recent.p50_ms").endswith(" ms")
    assert tab.errors == []


def test_the_profile_view_draws_each_fitted_curve_and_the_saved_results(
    tab: Tab, info: dict[str, Any], world: World, operator_world: OperatorWorld
) -> None:
    profile = json.loads((world.profile_dir / "profile.json").read_text())
    report = profile["fit_report"]
    tab.page.click(".tab[data-view='profile']")
    tab.page.wait_for_selector("svg.curve")
    assert tab.page.inner_text("[data-field='profile.id']") == info["profile"]["id"]
    assert tab.page.inner_text("[data-field='gallery.fingerprint']") == info["gallery"]["fingerprint"]
    points = sum(len(rows) for rows in report["support_recall"].values())
    assert len(tab.page.query_selector_all("svg.curve circle")) == points
    saved = json.loads(operator_world.eval.read_text())
    shown = tab.page.eval_on_selector_all(
        "#profile-eval table.eval tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
    )
    assert [row[0] for row in shown] == [row["method"] for row in saved["rows"]]
    slerp = next(row for row in saved["rows"] if row["method"] == "slerp")
    assert next(row for row in shown if row[0] == "slerp")[2:5] == [f"{slerp[f'recall@{k}']:.4f}" for k in (1, 5, 10)]
    assert tab.page.inner_text("#profile-compare .verdict strong") == "PASS"  # the profile against itself
    tab.page.screenshot(path=str(ARTEFACTS / "profile.png"), full_page=True)
    assert tab.errors == []


def test_item_texts_render_within_reach_of_ids_only(tab: Tab) -> None:
    tab.enter_key()
    with_texts, ids_only = [], []
    for i in range(5):
        query = CAPTION.format(QUERY_ID + i)
        tab.search(query, texts=False)  # the first search of a query pays for its cache misses
        with_texts.append(tab.search(query, texts=True))
        ids_only.append(tab.search(query, texts=False))
    assert all(text == f"#{i}" for i, text in tab.cells("old"))  # ids only shows ids
    texts_ms, ids_ms = statistics.median(with_texts), statistics.median(ids_only)
    record("render_ms", {"with_texts": texts_ms, "ids_only": ids_ms, "ratio": round(texts_ms / ids_ms, 3)})
    assert tab.errors == []
