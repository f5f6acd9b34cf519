"""MKP adapter: loss functions on exact inputs, focal weights, samplers, training, and the tensor round trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.torch import load_file, save_file

from service.compat.adapter import (
    AdapterConfig,
    AdapterMLP,
    TrainedAdapter,
    load_adapter,
    train_adapter,
)
from service.compat.metrics import default_ids, relevance, search_recall
from service.compat.mkp_loss import (
    angle_cosines,
    base_loss,
    batch_index,
    distance_errors,
    distance_matrix,
    focal_mean,
    focal_weights,
    gram,
    local_pairs,
    local_triplets,
    mkp_loss,
    nearest_neighbours,
    point_errors,
    sample_pairs,
    sample_triplets,
)
from service.compat.procrustes import normalize_rows

FAST = settings(max_examples=40, deadline=None)


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


def synthetic_pairs(n: int, seed: int, d_z: int = 24, d_new: int = 96, d_old: int = 64) -> tuple[np.ndarray, ...]:
    """old = normalise(tanh(z A)), new = normalise(z B + noise): related, not a rotation of each other."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(d_z, d_old)) / np.sqrt(d_z)
    b = rng.normal(size=(d_z, d_new)) / np.sqrt(d_z)
    z = rng.normal(size=(n, d_z))
    old = normalize_rows(np.tanh(1.5 * z @ a) + 0.25 * rng.normal(size=(n, d_old)))
    new = normalize_rows(z @ b + 0.1 * rng.normal(size=(n, d_new)))
    return new, old


# --- focal weights ---------------------------------------------------------------------------------


@FAST
@given(
    hnp.arrays(np.float64, st.integers(1, 200), elements=st.floats(0.0, 1e3)),
    st.floats(0.0, 3.0),
)
def test_focal_weights_average_to_one(errors: np.ndarray, gamma: float) -> None:
    w = focal_weights(torch.from_numpy(errors), gamma)
    assert torch.all(torch.isfinite(w))
    assert float(w.mean()) == pytest.approx(1.0, rel=1e-9, abs=1e-9)
    assert not w.requires_grad


def test_focal_weights_emphasise_hard_items_and_switch_off_at_gamma_zero() -> None:
    e = torch.tensor([0.1, 0.2, 0.4, 0.8])
    w = focal_weights(e, 1.0)
    assert torch.all(w[1:] > w[:-1])
    assert torch.allclose(w, e / e.mean())  # gamma = 1 is the paper's weight exactly
    assert torch.equal(focal_weights(e, 0.0), torch.ones(4))
    assert torch.equal(focal_weights(torch.zeros(3), 2.0), torch.ones(3))
    assert float(focal_mean(e, 0.0)) == pytest.approx(float(e.mean()))


# --- geometry and losses on exact inputs ---------------------------------------------------------


def test_distances_and_angles_read_off_the_gram_matrix_are_exact() -> None:
    x = torch.randn(9, 5, dtype=torch.float64)
    g = gram(x)
    d = distance_matrix(g)
    assert torch.allclose(d, torch.cdist(x, x), atol=1e-6)
    i, j, k = torch.tensor([0, 3, 8]), torch.tensor([1, 4, 2]), torch.tensor([2, 5, 7])
    e_ij, e_kj = unit(x[i] - x[j]), unit(x[k] - x[j])
    assert torch.allclose(angle_cosines(g, d, i, j, k), (e_ij * e_kj).sum(dim=1), atol=1e-9)


def test_every_loss_is_zero_for_an_isometry_onto_the_old_space() -> None:
    torch.manual_seed(0)
    n, d_old, d_new = 64, 12, 20
    old = unit(torch.randn(n, d_old, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(d_new, d_new, dtype=torch.float64))
    new = torch.nn.functional.pad(old, (0, d_new - d_old)) @ q  # an exact isometric copy of old
    index = batch_index(gram(new), m=10, per_anchor=8, gen=torch.Generator().manual_seed(0))
    cfg = AdapterConfig()
    # The network output equals the target (h(new) = old) and the cycle is exact (g(old) = new).
    total, parts = mkp_loss(old, new, new, old, index, cfg)
    for name, value in parts.items():
        assert float(value) == pytest.approx(0.0, abs=1e-6), name
    assert float(total) == pytest.approx(0.0, abs=1e-6)

    # The same terms are clearly non-zero once the output is not an isometry of the input.
    warped = unit(old + 0.3 * torch.randn_like(old))
    _, bad = mkp_loss(warped, new, new, old, index, cfg)
    assert float(bad["base"]) > 1e-2 and float(bad["distance"]) > 1e-2 and float(bad["angle"]) > 1e-2
    assert float(point_errors(unit(new + 0.1), new).mean()) > 1e-3
    assert float(base_loss(old, old)) == 0.0


def test_distance_errors_see_only_the_chosen_pairs() -> None:
    d_in = torch.zeros(4, 4)
    d_out = torch.zeros(4, 4)
    d_out[1, 2] = 0.5
    i, j = torch.tensor([0, 1]), torch.tensor([3, 2])
    assert torch.equal(distance_errors(d_out, d_in, i, j), torch.tensor([0.0, 0.5]))


# --- samplers ------------------------------------------------------------------------------------


def test_samplers_never_pair_a_row_with_itself() -> None:
    gen = torch.Generator().manual_seed(0)
    a, p = sample_pairs(5, 200, gen)
    assert torch.all(a != p) and p.min() >= 0 and p.max() <= 4
    assert set(p[a == 0].tolist()) == {1, 2, 3, 4}  # every partner is reachable
    i, j, k = sample_triplets(4, 300, gen)
    assert torch.all(i != j) and torch.all(k != j) and torch.all(i != k)
    assert i.max() <= 3 and k.max() <= 3 and k.min() >= 0


def test_local_neighbours_are_the_true_nearest_rows_in_the_new_space() -> None:
    x = unit(torch.randn(40, 6))
    nbrs = nearest_neighbours(gram(x), m=5)
    d = torch.cdist(x, x)
    d.fill_diagonal_(torch.inf)
    brute = torch.topk(d, 5, dim=1, largest=False).indices
    assert torch.equal(nbrs.sort(dim=1).values, brute.sort(dim=1).values)
    assert nearest_neighbours(gram(x[:4]), m=100).shape == (4, 3)  # capped at n - 1
    anchor, nb = local_pairs(nbrs)
    assert torch.all(anchor != nb)
    i, j, k = local_triplets(nbrs, 16, torch.Generator().manual_seed(1))
    assert torch.all(i != k) and torch.all(i != j) and torch.all(k != j)
    members = nbrs[j]
    assert torch.all((members == i[:, None]).any(dim=1)) and torch.all((members == k[:, None]).any(dim=1))


# --- training ------------------------------------------------------------------------------------


SMALL = AdapterConfig(epochs=5, batch_size=128, m=32, seed=3, precision="fp32")


@pytest.fixture(scope="module")
def trained() -> tuple[TrainedAdapter, np.ndarray, np.ndarray]:
    new, old = synthetic_pairs(3000, seed=0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures are set up before the autouse one-thread fixture
    try:
        adapter = train_adapter(new, old, SMALL, progress=False)
    finally:
        torch.set_num_threads(before)
    return adapter, new, old


def test_training_reduces_the_loss_and_beats_an_untrained_adapter(
    trained: tuple[TrainedAdapter, np.ndarray, np.ndarray],
) -> None:
    adapter, _, _ = trained
    history = adapter.report["history"]
    assert history[-1]["total"] < history[0]["total"]
    test_new, test_old = _held_out()
    torch.manual_seed(3)
    untrained = TrainedAdapter(AdapterMLP(96, 96, 64, 0.1), SMALL, 96, 64)
    rel = relevance(default_ids(len(test_new)), default_ids(len(test_old)))
    r_trained = search_recall(adapter.apply(test_new), test_old, rel, ks=(1,))[1]
    r_untrained = search_recall(untrained.apply(test_new), test_old, rel, ks=(1,))[1]
    mse_trained = float(np.mean(np.sum((adapter.apply(test_new) - test_old) ** 2, axis=1)))
    mse_untrained = float(np.mean(np.sum((untrained.apply(test_new) - test_old) ** 2, axis=1)))
    assert mse_trained < 0.5 * mse_untrained
    assert r_trained > r_untrained + 0.2, (r_trained, r_untrained)


def _held_out() -> tuple[np.ndarray, np.ndarray]:
    """Fresh pairs from the same world as the training pairs (same maps A, B; new latents)."""
    new, old = synthetic_pairs(4000, seed=0)
    return new[3000:], old[3000:]


def test_apply_returns_float32_unit_rows_and_numpy_agrees_with_torch(
    trained: tuple[TrainedAdapter, np.ndarray, np.ndarray],
) -> None:
    adapter, new, _ = trained
    out_t = adapter.apply_torch(new[:500])
    out_n = adapter.apply_numpy(new[:500])
    assert out_t.dtype == np.float32 and out_t.shape == (500, 64)
    assert np.allclose(np.linalg.norm(out_t, axis=1), 1.0, atol=1e-5)
    assert np.abs(out_t - out_n).max() < 1e-5
    # apply() picks a path by batch size; both ends agree with the torch reference.
    assert np.abs(adapter.apply(new[:1]) - out_t[:1]).max() < 1e-5
    assert np.array_equal(adapter.apply(new[:500]), out_t)
    # Rows need not be unit on input: the adapter normalises them first, as in training.
    assert np.abs(adapter.apply(3.0 * new[:1]) - out_t[:1]).max() < 1e-5


def test_round_trip_through_a_safetensors_file_is_bit_exact(
    trained: tuple[TrainedAdapter, np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    adapter, new, _ = trained
    tensors = adapter.state_dict_tensors()
    assert set(tensors) == {
        "adapter.norm.weight",
        "adapter.norm.bias",
        "adapter.fc1.weight",
        "adapter.fc1.bias",
        "adapter.fc2.weight",
        "adapter.fc2.bias",
    }
    assert tensors["adapter.fc1.weight"].shape == (96, 96) and tensors["adapter.fc2.weight"].shape == (64, 96)
    save_file(tensors, str(tmp_path / "adapter.safetensors"))
    (tmp_path / "meta.json").write_text(json.dumps(adapter.meta()))
    loaded = load_adapter(
        load_file(str(tmp_path / "adapter.safetensors")), json.loads((tmp_path / "meta.json").read_text())
    )
    assert loaded.config == adapter.config
    for name, t in loaded.state_dict_tensors().items():
        assert torch.equal(t, tensors[name]), name
    assert np.array_equal(loaded.apply_torch(new[:300]), adapter.apply_torch(new[:300]))
    assert np.array_equal(loaded.apply_numpy(new[:3]), adapter.apply_numpy(new[:3]))
    # numpy arrays (safetensors.numpy, as the profile stores them) load to the same adapter.
    as_numpy = {k: v.numpy() for k, v in tensors.items()}
    assert np.array_equal(load_adapter(as_numpy, adapter.meta()).apply(new[:300]), adapter.apply(new[:300]))


def test_load_refuses_wrong_shapes_and_formats(trained: tuple[TrainedAdapter, np.ndarray, np.ndarray]) -> None:
    adapter, _, _ = trained
    tensors = adapter.state_dict_tensors()
    with pytest.raises(ValueError, match="format"):
        load_adapter(tensors, {**adapter.meta(), "format": "other/9"})
    with pytest.raises(ValueError, match="fc2.bias"):
        load_adapter({**tensors, "adapter.fc2.bias": torch.zeros(3)}, adapter.meta())
    with pytest.raises(ValueError, match="missing"):
        load_adapter({k: v for k, v in tensors.items() if "norm" not in k}, adapter.meta())


def test_training_is_deterministic_for_a_seed_and_leaves_the_global_rng_alone() -> None:
    new, old = synthetic_pairs(400, seed=5, d_new=16, d_old=12)
    cfg = AdapterConfig(epochs=2, batch_size=64, m=16, seed=7, precision="fp32")
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = train_adapter(new, old, cfg, progress=False)
    after = torch.rand(1)
    b = train_adapter(new, old, cfg, progress=False)
    assert torch.equal(before, after)
    for name, t in a.state_dict_tensors().items():
        assert torch.equal(t, b.state_dict_tensors()[name]), name
    c = train_adapter(new, old, AdapterConfig(epochs=2, batch_size=64, m=16, seed=8, precision="fp32"), progress=False)
    assert not torch.equal(a.state_dict_tensors()["adapter.fc1.weight"], c.state_dict_tensors()["adapter.fc1.weight"])


def test_bf16_autocast_training_still_learns() -> None:
    new, old = synthetic_pairs(600, seed=6, d_new=32, d_old=24)
    adapter = train_adapter(new, old, AdapterConfig(epochs=3, batch_size=64, m=16, precision="bf16"), progress=False)
    assert adapter.report["autocast"] == "bfloat16"
    assert adapter.report["history"][-1]["base"] < adapter.report["history"][0]["base"]
    assert np.all(np.isfinite(adapter.apply(new)))


def test_config_and_inputs_are_validated() -> None:
    with pytest.raises(ValueError):
        AdapterConfig(batch_size=2)
    with pytest.raises(ValueError):
        AdapterConfig(precision="fp8")
    with pytest.raises(ValueError):
        AdapterConfig(warmup=1.5)
    with pytest.raises(AssertionError):
        train_adapter(np.zeros((10, 4)), np.zeros((9, 4)), progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_on_cuda_gives_a_cpu_adapter() -> None:
    new, old = synthetic_pairs(2000, seed=8)
    adapter = train_adapter(new, old, AdapterConfig(epochs=2, batch_size=256, device="cuda"), progress=False)
    assert adapter.report["device"].startswith("cuda")
    assert all(t.device.type == "cpu" for t in adapter.state_dict_tensors().values())
    assert adapter.report["history"][-1]["total"] < adapter.report["history"][0]["total"]
    out = adapter.apply(new[:100])
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)


# --- early stopping ---------------------------------------------------------------------------------


def test_a_run_stopped_at_epoch_e_equals_the_first_e_epochs_of_a_full_run() -> None:
    new, old = synthetic_pairs(300, seed=9, d_new=16, d_old=12)
    cfg = AdapterConfig(epochs=4, batch_size=64, m=16, seed=3, precision="fp32")
    probe = normalize_rows(np.random.default_rng(0).normal(size=(20, 16)))
    seen: dict[int, np.ndarray] = {}
    full = train_adapter(new, old, cfg, progress=False, on_epoch=lambda e, live: seen.setdefault(e, live.apply(probe)))
    assert sorted(seen) == [1, 2, 3, 4] and full.report["epochs"] == 4
    np.testing.assert_allclose(seen[4], full.apply(probe), atol=1e-6)
    stopped = train_adapter(new, old, cfg, progress=False, stop_after=2)
    assert stopped.report["epochs"] == 2 and stopped.report["steps"] == full.report["steps"] // 2
    np.testing.assert_allclose(stopped.apply(probe), seen[2], atol=1e-6)
    assert not np.allclose(seen[2], seen[4], atol=1e-4)


def test_early_stopping_on_the_folds_and_the_comparison_with_procrustes(tmp_path: Path) -> None:
    from service.compat import criteria, mapped_selection
    from service.compat.fit_options import FitOptions
    from service.compat.io import load_split
    from tests.support.upgrade_standin import make_world, write_split

    split = load_split(write_split(tmp_path / "s", 300, make_world(12, 16, 8), seed=1))
    cfg = AdapterConfig(epochs=6, batch_size=64, m=16, precision="fp32")
    calls: list[int | None] = []

    def fit_map(
        new: np.ndarray, old: np.ndarray, on_epoch: object = None, stop_after: int | None = None
    ) -> TrainedAdapter:
        calls.append(stop_after)
        return train_adapter(new, old, cfg, progress=False, on_epoch=on_epoch, stop_after=stop_after)  # type: ignore[arg-type]

    fitted = mapped_selection.fit_mapped_slerp(split, fit_map, FitOptions(folds=3), mode="adapter", early_stop=True)
    stop = fitted.report["early_stopping"]
    assert stop["max_epochs"] == 6 and [r["epoch"] for r in stop["curve"]] == list(range(1, 7))
    best = max(r[stop["score"]] for r in stop["curve"])
    chosen = stop["curve"][stop["epochs"] - 1]
    # The fewest epochs within one standard error of the best held-out epoch.
    assert chosen[stop["score"]] >= best - criteria.curve_se(stop["curve"], criteria.DEFAULT_CRITERION)
    assert calls == [None, None, None, stop["epochs"]] and fitted.mapper.report["epochs"] == stop["epochs"]
    vs = fitted.report["versus_procrustes"]
    assert vs["adapter_loses"] == (vs["adapter_alone_r1"] < vs["procrustes_alone_r1"])
    assert ("loses" if vs["adapter_loses"] else "beats") in vs["verdict"]
