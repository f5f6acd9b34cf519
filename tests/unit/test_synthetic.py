"""The synthetic upgrade world: deterministic encoders, the regime it is tuned to, the registry.

torch is imported inside the tests, after `service` (which sets OMP_WAIT_POLICY=PASSIVE first).

Regime (docs/synthetic-world.md): caption -> image retrieval; old->old is mediocre, new->new clearly
better, Procrustes alone no better than SLERP, and SLERP with alpha chosen on a disjoint support set
beats both old->old and Procrustes alone.  Checked on 10^4 items here; the 10^5 figures are `slow`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

from service.compat.interpolation import slerp
from service.compat.procrustes import align, fit_rotation, pad
from service.encoders.base import Encoder, resolve_device
from service.encoders.registry import create_encoder
from service.encoders.synthetic import (
    HASHED_ITEM_BASE,
    IMAGE_VIEW,
    SyntheticNewEncoder,
    SyntheticOldEncoder,
    format_item,
    parse_inputs,
)
from service.errors import InputError
from service.settings import EncoderSettings
from tests.support.world import digest

SUPPORT_BASE = 10**12
Rows = npt.NDArray[np.float32]


# --------------------------------------------------------------------------- the Encoder protocol


def test_encoders_implement_the_protocol(old: SyntheticOldEncoder, new: SyntheticNewEncoder) -> None:
    for enc, dim, model_id in ((old, 512, "synthetic-old"), (new, 768, "synthetic-new")):
        assert isinstance(enc, Encoder)
        assert (enc.dim, enc.model_id, enc.device) == (dim, model_id, "cpu")
        enc.warmup()
        rows = enc.encode(["item-0000000001 caption-0", "item-0000000001 image", "anything at all"], "text")
        assert rows.shape == (3, dim) and rows.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-6)
        assert np.isfinite(rows).all()
        assert enc.encode([], "text").shape == (0, dim)


def test_parse_inputs_reads_item_and_view() -> None:
    items, views = parse_inputs(["item-0000001234 caption-3", "  item-42 image ", "item-7", "item-7", "hello"], "text")
    assert items[:4].tolist() == [1234, 42, 7, 7]
    assert views[:4].tolist() == [3, IMAGE_VIEW, 0, 0]
    assert items[4] >= HASHED_ITEM_BASE and views[4] == 0
    img_items, img_views = parse_inputs(["item-7", "hello"], "image")
    assert img_views.tolist() == [IMAGE_VIEW, IMAGE_VIEW] and img_items[1] == items[4]
    assert format_item(42, 1) == "item-0000000042 caption-1" and format_item(42) == "item-0000000042 image"


def test_any_text_embeds_deterministically(old: SyntheticOldEncoder) -> None:
    texts = ["a photo of a dog", "", "ünïcødé ✓", "item-x caption-1", "item-12 caption-", "a photo of a dog"]
    first, again = old.encode(texts, "text"), old.encode(list(reversed(texts)), "text")[::-1]
    assert digest(first) == digest(again)
    assert np.array_equal(first[0], first[5])
    assert len({digest(r[None]) for r in first[:5]}) == 5


# --------------------------------------------------------------------------- determinism


def test_bit_identical_across_batch_sizes_and_apis(old: SyntheticOldEncoder, new: SyntheticNewEncoder) -> None:
    ids = np.arange(0, 3000, 7, dtype=np.int64)
    for enc in (old, new):
        bulk = enc.encode_items(ids, IMAGE_VIEW)
        singles = np.concatenate([enc.encode([format_item(int(i))], "image") for i in ids[:40]])
        assert digest(singles) == digest(bulk[:40])
        chunked = np.concatenate([enc.encode_items(ids[s : s + 33], IMAGE_VIEW) for s in range(0, ids.size, 33)])
        assert digest(chunked) == digest(bulk)


def test_bit_identical_across_threads_and_matmul_precision(old: SyntheticOldEncoder) -> None:
    import torch

    ids = np.arange(500, dtype=np.int64)
    reference = old.encode_items(ids, 2)
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    try:
        torch.set_num_threads(1)
        assert digest(old.encode_items(ids, 2)) == digest(reference)
        # A lower matmul precision switches the encoder to its float64 path: still the same bits.
        torch.set_float32_matmul_precision("medium")
        assert digest(old.encode_items(ids, 2)) == digest(reference)
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)


def test_views_and_models_differ(old: SyntheticOldEncoder, new: SyntheticNewEncoder) -> None:
    ids = np.arange(200, dtype=np.int64)
    image, cap0, cap1 = (old.encode_items(ids, v) for v in (IMAGE_VIEW, 0, 1))
    own = np.sum(image * cap0, axis=1)
    other = np.sum(image * np.roll(cap0, 1, axis=0), axis=1)
    assert not np.array_equal(cap0, cap1) and not np.array_equal(image, cap0)
    assert own.mean() > other.mean() + 0.2, "a caption should be closer to its own image than to another's"
    assert not np.allclose(old.encode_items(ids[:5])[:, :64], new.encode_items(ids[:5])[:, :64])


# --------------------------------------------------------------------------- the regime


def recall_at(queries: Rows, targets: Rows, qids: npt.NDArray[np.int64], tids: npt.NDArray[np.int64], k: int) -> float:
    """Share of queries whose relevant target (same id) is in the exact top-k, in percent."""
    import torch

    t = torch.from_numpy(targets)
    hits = 0
    for s in range(0, queries.shape[0], 2048):
        top = torch.topk(torch.from_numpy(queries[s : s + 2048]) @ t.T, k, dim=1).indices.numpy()
        hits += int((tids[top] == qids[s : s + 2048, None]).any(axis=1).sum())
    return 100.0 * hits / queries.shape[0]


@dataclass(frozen=True)
class Split:
    """Caption queries and image targets of some items, through both models."""

    ids: npt.NDArray[np.int64]
    old_q: Rows
    new_q: Rows
    old_t: Rows
    new_t: Rows


def split(old: SyntheticOldEncoder, new: SyntheticNewEncoder, ids: npt.NDArray[np.int64], n_queries: int) -> Split:
    """Targets: image views of all ids; queries: caption (id mod 5) of the first n_queries ids."""
    q = ids[:n_queries]
    cap = q % 5
    return Split(q, old.encode_items(q, cap), new.encode_items(q, cap), old.encode_items(ids), new.encode_items(ids))


def blend(old_q: Rows, new_q: Rows, r: Rows, alpha: float) -> Rows:
    """SLERP of the old query and the aligned new query, cut back to the old coordinates."""
    d_old = old_q.shape[1]
    q = slerp(pad(old_q, r.shape[0]), align(new_q, r, d_old), alpha)
    return np.ascontiguousarray(q[:, :d_old])


def fit_alpha(support: Split, grid: npt.NDArray[np.float64]) -> float:
    """Alpha with the best 2-fold cross-fitted support Recall@1 (R fitted on the other fold)."""
    half = support.ids.size // 2
    score = np.zeros(grid.size)
    for fit, held in ((slice(0, half), slice(half, None)), (slice(half, None), slice(0, half))):
        r = fit_rotation(support.new_q[fit], support.old_q[fit])
        ids = support.ids[held]
        for j, alpha in enumerate(grid):
            q = blend(support.old_q[held], support.new_q[held], r, float(alpha))
            score[j] += recall_at(q, support.old_t[held], ids, ids, 1)
    return float(grid[int(np.argmax(score))])


def regime(
    old: SyntheticOldEncoder, new: SyntheticNewEncoder, items: int, queries: int, support: int
) -> dict[str, float]:
    """Caption->image Recall@1 of old->old, new->new, aligned and fitted SLERP on `items` items."""
    test = split(old, new, np.arange(items, dtype=np.int64), queries)
    sup = split(old, new, np.arange(SUPPORT_BASE, SUPPORT_BASE + support, dtype=np.int64), support)
    tids = np.arange(items, dtype=np.int64)
    alpha = fit_alpha(sup, np.linspace(0.0, 1.0, 11))
    r = fit_rotation(sup.new_q, sup.old_q)
    return {
        "old": recall_at(test.old_q, test.old_t, test.ids, tids, 1),
        "new": recall_at(test.new_q, test.new_t, test.ids, tids, 1),
        "aligned": recall_at(blend(test.old_q, test.new_q, r, 1.0), test.old_t, test.ids, tids, 1),
        "slerp": recall_at(blend(test.old_q, test.new_q, r, alpha), test.old_t, test.ids, tids, 1),
        "alpha": alpha,
    }


def check_regime(r: dict[str, float]) -> None:
    """The relations the world is tuned for."""
    assert r["new"] >= r["old"] + 10, r
    assert r["aligned"] <= r["slerp"], r
    assert r["slerp"] > r["old"] and r["slerp"] > r["aligned"], r
    assert 0.0 < r["alpha"] < 1.0, r


def test_regime_on_ten_thousand_items(old: SyntheticOldEncoder, new: SyntheticNewEncoder) -> None:
    r = regime(old, new, items=10_000, queries=2_000, support=3_000)
    check_regime(r)
    assert 30 <= r["old"] <= 75, r  # 10^4 items are easier than the 10^5 the 20-60% band is set for


@pytest.mark.scale  # make test-scale; make test runs the 10^4 version above
def test_regime_on_a_hundred_thousand_items(old: SyntheticOldEncoder, new: SyntheticNewEncoder) -> None:
    r = regime(old, new, items=100_000, queries=2_000, support=10_000)
    check_regime(r)
    assert 20 <= r["old"] <= 60, r


# --------------------------------------------------------------------------- registry


def test_registry_builds_synthetic_encoders_on_cpu() -> None:
    enc = create_encoder(EncoderSettings(backend="synthetic-new", device="auto"), "new")
    assert (enc.model_id, enc.dim) == ("synthetic-new", 768)
    assert enc.device == resolve_device("auto", "new")
    slow = create_encoder(EncoderSettings(backend="synthetic-old", device="cpu", simulated_cost_ms=1.0), "old")
    assert slow.model_id == "synthetic-old" and type(slow).__name__ == "SimulatedCostEncoder"
    assert slow.encode(["item-1 image"], "image").shape == (1, 512)


def test_registry_refuses_unknown_backend() -> None:
    with pytest.raises(InputError, match="unknown encoder backend"):
        create_encoder(EncoderSettings(backend="no-such-model"), "old")
