"""What the store tests share (pgvector, Qdrant, Milvus: a user's store served where it is, and the migration in
the store's own form), so that each test file keeps only what differs per store.

- items_fixture, old_model_rows, export_index: the items backfill re-encodes, the rows a user's store holds, the
  settings a user exports
- backfill, backfill_process: `backfill run --segment SPEC` with the synthetic new model, here or as a process
- Captions and exact_top: the queries a test asks at every step, and the answer an exact search gives them
- the migration's steps that every store walks alike, each one asserted the same way for all of them
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.app import Running, serving
from tests.support.cli import NOBACKFILL, Done, cli
from tests.support.world import CAPTION, World


def items_fixture(size: int) -> Any:
    """The module fixture `items` (assign it to that name): the synthetic world's first `size` items as an item
    store, what backfill re-encodes."""

    @pytest.fixture(scope="module", name="items")
    def items(tmp_path_factory: pytest.TempPathFactory) -> Path:
        out = tmp_path_factory.mktemp("items") / "store"
        done = cli("synth", "items", "--size", size, "--out", out)
        assert done.returncode == 0, done.stderr
        return out

    return items


def old_model_rows(n: int) -> np.ndarray:
    """The synthetic old model's rows of the world's items 0..n-1: what the user's store holds before a migration."""
    from service.encoders.synthetic import SyntheticOldEncoder

    return np.asarray(SyntheticOldEncoder().encode_items(np.arange(n, dtype=np.int64)))


def export_index(env: pytest.MonkeyPatch, **settings: str) -> None:
    """NOBACKFILL_INDEX__<SETTING> for each setting: what a user exports for both the service and the CLI."""
    for name, value in settings.items():
        env.setenv(f"NOBACKFILL_INDEX__{name.upper()}", value)


def backfill(world: World, items: Path, spec: str, *args: str | int) -> Done:
    """`backfill run --segment SPEC` in this process: the world's items re-encoded by the synthetic new model."""
    return cli(
        "backfill", "run", "--segment", spec, "--input", items,
        "--backend", "synthetic-new", "--profile", world.profile_dir, *args,
    )  # fmt: skip


def backfill_process(world: World, items: Path, spec: str, *args: str) -> subprocess.Popen[str]:
    """The same run as a process of its own, one a test can kill: batches of 50, shards of 100, a --json summary."""
    command = [
        *NOBACKFILL, "backfill", "run", "--segment", spec, "--input", str(items), "--backend", "synthetic-new",
        "--profile", str(world.profile_dir), "--batch-size", "50", "--shard-size", "100", "--json", *args,
    ]  # fmt: skip
    return subprocess.Popen(command, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Poll `condition` (a generous bound: a busy box only makes it wait longer, never fail early)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def exact_top(ids: np.ndarray, rows: np.ndarray, queries: np.ndarray, k: int) -> list[list[int]]:
    """The `k` ids whose rows score highest with each query by inner product (ties in row order): exact search."""
    return ids[np.argsort(-(queries @ rows.T), axis=1, kind="stable")[:, :k]].tolist()


@dataclass(frozen=True)
class Captions:
    """World item i's caption for each i in `items`: the text queries a test asks at every step."""

    items: tuple[int, ...]

    def queries(self) -> list[dict[str, str]]:
        """The search body's queries."""
        return [{"text": CAPTION.format(i)} for i in self.items]

    async def search(self, service: Running, mode: str | None = None, k: int = 10) -> list[dict[str, Any]]:
        """Every caption in one search (in the service's default mode when `mode` is None); its results."""
        response = await service.search(queries=self.queries(), k=k, **({"mode": mode} if mode else {}))
        assert response.status_code == 200, response.text
        return list(response.json()["results"])

    def encoded(self, encoder: Any) -> np.ndarray:
        """The captions as `encoder` embeds a text query."""
        from service.vocabulary import Modality

        return np.asarray(encoder.encode([CAPTION.format(i) for i in self.items], Modality.text))

    def new_queries(self) -> np.ndarray:
        """The captions as the synthetic new model embeds them."""
        from service.encoders.synthetic import SyntheticNewEncoder

        return self.encoded(SyntheticNewEncoder())

    def old_item_rows(self) -> np.ndarray:
        """The items' own rows by the synthetic old model: what the old store holds for them."""
        from service.encoders.synthetic import SyntheticOldEncoder

        return np.asarray(SyntheticOldEncoder().encode_items(np.array(self.items)))


def ids_of(results: list[dict[str, Any]]) -> list[list[int]]:
    """Each result's ids."""
    return [r["ids"] for r in results]


async def info_of(service: Running) -> dict[str, Any]:
    """GET /v1/info."""
    return dict((await service.client.get("/v1/info")).json())


def assert_refused_without_consent(world: World, items: Path, spec: str, consent: str) -> None:
    """A run that would create the segment is refused in one line naming the flag that consents to it."""
    refused = backfill(world, items, spec, "--fraction", 0.5)
    assert refused.returncode == 2 and consent in refused.stderr and refused.stderr.count("\n") == 1


def assert_contradicting_settings_refused(
    index: Callable[..., Any], cases: list[tuple[dict[str, Any], str]], backend: str, **new_segment: Any
) -> None:
    """Each case's settings beside the old store's (`index(**settings)`) refused in one line saying `message`; a new
    segment's setting without NOBACKFILL_INDEX__BACKEND=`backend` refused as needing it."""
    from service.errors import SettingsError
    from service.settings import IndexSettings, Settings

    for settings, message in cases:
        with pytest.raises(SettingsError) as refused:
            Settings(index=index(**settings))
        assert message in refused.value.message and "\n" not in refused.value.message
    with pytest.raises(SettingsError) as refused:
        Settings(index=IndexSettings(**new_segment))
    assert f"needs NOBACKFILL_INDEX__BACKEND={backend}" in refused.value.message


async def assert_hybrid_is_compat_before_anything_moved(settings: Any, captions: Captions) -> list[dict[str, Any]]:
    """Day 0, the segment named, not there yet: hybrid serves as the compatible search (slerp); slerp's results.

    Slerp is asked before hybrid and after it: the answer does not depend on which search reached the store first.
    """
    async with serving(settings) as service:
        info = await info_of(service)
        assert info["default_mode"] == "hybrid" and info["segment"]["created"] is False
        first = await captions.search(service, "slerp")
        hybrid, slerp = await captions.search(service, "hybrid"), await captions.search(service, "slerp")
    assert ids_of(hybrid) == ids_of(slerp) == ids_of(first)
    return slerp


def assert_half_moves_resumably(world: World, items: Path, spec: str, n: int, *, where: str, unit: str,
                                first: tuple[str | int, ...]) -> None:  # fmt: skip
    """Half of the `n` items moved into `where` (`first`: the consent and the batch sizes); then a rerun moves
    nothing, status says half, and the cut-over refuses a segment that holds half its `unit` (rows, points)."""
    half, whole = f"{n // 2:,}", f"{n:,}"
    moved = backfill(world, items, spec, "--fraction", 0.5, *first)
    assert moved.returncode == 0, moved.stderr
    assert f"into {where}" in moved.stdout and f"{half} of {whole} (50.0%)" in moved.stdout
    again = backfill(world, items, spec, "--fraction", 0.5, "--json")
    assert again.returncode == 0 and '"moved": 0' in again.stdout  # resumable: nothing is encoded twice
    status = cli("backfill", "status", spec)
    assert status.returncode == 0 and f"moved {half} of {whole} items (50.0%)" in status.stdout, status.stderr
    early = cli("backfill", "cutover", spec)
    assert early.returncode == 2 and f"holds {half} of {whole} {unit} (50.0%)" in early.stderr


async def assert_both_answer_at_half(settings: Any, captions: Captions, backend: str, moved: int) -> None:
    """Half moved: the segment says so, and hybrid's top 10s are whole, without repeats, and drawn from both."""
    async with serving(settings) as service:
        info = (await info_of(service))["segment"]
        assert (info["backend"], info["moved"], info["coverage"]) == (backend, moved, 0.5)
        results = await captions.search(service, "hybrid")
        assert all(len(set(r["ids"])) == len(r["ids"]) == 10 for r in results)
        assert 0 < sum(r["segment_hits"] for r in results) < 10 * len(results)  # both searches answer


def assert_the_old_search_leaves_moved_out(gallery: Any, queries: np.ndarray, exclude: Any, moved: set[int]) -> Any:
    """The old store's search with `exclude` finds none of the moved items, which it finds without; its ids."""
    _, old_ids = gallery.search(queries, 50, nprobe=1, exclude=exclude)
    _, all_ids = gallery.search(queries, 50, nprobe=1)
    assert not set(old_ids.ravel().tolist()) & moved  # the old search left the moved items out
    assert set(all_ids.ravel().tolist()) & moved  # (which it would have found)
    return old_ids


def assert_the_rest_moves(world: World, items: Path, spec: str, n: int) -> None:
    """A run without a fraction moves every item still left."""
    rest = backfill(world, items, spec)
    assert rest.returncode == 0 and f"{n:,} of {n:,} (100.0%)" in rest.stdout, rest.stderr


async def assert_new_and_hybrid_are_exact(
    settings: Any, captions: Captions, ids: np.ndarray, rows: np.ndarray
) -> list[list[int]]:
    """Everything moved: mode new is the new model's exact search over the new `rows`, and hybrid is the
    re-indexed search, the same; that exact top 10 per caption."""
    async with serving(settings) as service:
        hybrid, new = await captions.search(service, "hybrid"), await captions.search(service, "new")
    want = exact_top(ids, rows, captions.new_queries(), 10)
    assert ids_of(new) == want  # the new model over the new rows, exactly
    assert ids_of(hybrid) == want  # everything moved: hybrid is the re-indexed search
    return want


async def served_alone(settings: Any, captions: Captions) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """After the cut-over, the new rows served without the old model: /v1/info and mode new's results."""
    async with serving(settings) as service:
        return await info_of(service), await captions.search(service, "new")


async def assert_searches_are_reranked(service: Running, captions: Captions) -> None:
    """A search in the default mode with an item store: the cascade re-ranks every result (and encodes)."""
    assert all(r["reranked"] for r in await captions.search(service, k=5))


async def info_once_moved_past(service: Running, moved: int) -> dict[str, Any]:
    """/v1/info once the segment holds more than `moved` rows: the writer's flush, then a refresh, waited for
    (never timed); the last info seen otherwise."""
    for _ in range(2400):
        info = await info_of(service)
        if info["segment"]["moved"] > moved:
            break
        await asyncio.sleep(0.05)
    return info


async def assert_the_cascade_writes(settings: Any, captions: Captions) -> dict[str, Any]:
    """Served with an item store, the cascade re-ranks every search and writes what it encodes into the segment;
    /v1/info once the segment holds more than the one row the run put there."""
    async with serving(settings) as service:
        await assert_searches_are_reranked(service, captions)
        info = await info_once_moved_past(service, 1)
    assert info["segment"]["moved"] > 1 and info["cascade"]["writes_segment"] is True
    return info


async def what_anyone_sees(service: Running) -> list[str]:
    """What the service shows anyone, where a secret must never be: a search's answer, an error answer,
    /v1/info and /metrics."""
    one = Captions((3,))
    return [
        (await service.search(queries=one.queries(), k=5)).text,
        (await service.search(queries=one.queries(), k=5, mode="nope")).text,
        (await service.client.get("/v1/info")).text,
        (await service.client.get("/metrics")).text,
    ]


async def assert_old_rows_are_served_exactly(
    world: World, index: Any, captions: Captions, ids: np.ndarray, rows: np.ndarray
) -> dict[str, Any]:
    """The service over a user's store (`index`) of the old model's `rows`, keyed by `ids`: mode old answers the old
    model's own exact top 5 of each caption, and slerp answers 5 too; /v1/info."""
    from service.encoders.synthetic import SyntheticOldEncoder
    from service.settings import CompatSettings, EncoderSettings, Settings

    old_model = EncoderSettings(backend="synthetic-old")
    settings = Settings(old=old_model, index=index, compat=CompatSettings(profile_dir=world.profile_dir))
    async with serving(settings) as service:
        old = await captions.search(service, "old", k=5)
        info = await info_of(service)
        slerp = await captions.search(service, "slerp", k=5)
    assert all(len(r["ids"]) == 5 for r in slerp)
    assert ids_of(old) == exact_top(ids, rows, captions.encoded(SyntheticOldEncoder()), 5)  # exactly, in the store
    return info
