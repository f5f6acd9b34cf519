"""Simulated OLD and NEW encoders of the synthetic upgrade world (docs/synthetic-world.md).

An input string names an item and a view (`item-0001234567 caption-3`, `item-0001234567 image`).
Item i has a latent z_i drawn from a clustered distribution by a counter-based generator keyed by i;
a view adds view noise keyed by (i, view); each model adds its own noise keyed by (model, i, view)
and maps the result through a fixed random ReLU MLP with a linear skip.  The NEW model is less noisy,
so new->new beats old->old, and its map differs, so Procrustes only aligns the spaces approximately.

Bit-identical outputs whatever the batch size, thread count or BLAS kernel: every reduction runs on
dyadic numbers small enough that float64 sums are exact in any order (see `_quantize`), and the
remaining steps are single IEEE operations, which are correctly rounded everywhere.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from service.encoders.base import Embeddings
from service.vocabulary import Modality

IntArray = npt.NDArray[np.int64]

IMAGE_VIEW: Final = -1
"""View code of the image view; caption j has view code j (0 <= j < MAX_CAPTION)."""
MAX_CAPTION: Final = 1_000_000
MAX_ITEM_ID: Final = 10**18 - 1
HASHED_ITEM_BASE: Final = 1 << 62
"""Unparseable inputs get item ids in [2^62, 2^63), disjoint from every numbered item."""

_INPUT = re.compile(r"^\s*item-(\d{1,18})(?:\s+(?:(image)|caption-(\d{1,6})))?\s*$")

# Stream constants keep the hash streams (latent, cluster, view, model noise) independent.
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_STREAM_LATENT: Final = 0x4C4154454E54
_STREAM_CLUSTER: Final = 0x434C5553
_STREAM_VIEW: Final = 0x56494557
_STREAM_MODEL: Final = 0x4D4F44454C
_SLOTS: Final = 5
_H_M2: Final = 0.5
"""Second moment of a hidden unit relu(w.x + b) with w.x ~ N(0, 1), b ~ N(0, 1/4): roughly 1/2."""
_W2_STD: Final = 0.06
_SLOT_BITS: Final = 12


@dataclass(frozen=True)
class WorldParams:
    """Parameters of the shared latent world; both encoders must use the same instance."""

    seed: int = 20260501
    latent_dim: int = 64
    n_clusters: int = 4096
    cluster_spread: float = 0.8
    caption_noise: float = 0.7
    image_noise: float = 0.4
    hidden: int = 128


@dataclass(frozen=True)
class ModelParams:
    """One simulated model: output width, its own input noise, how nonlinear its map is."""

    model_id: str
    dim: int
    model_noise: float
    nonlinearity: float
    weight_seed: int


OLD_MODEL: Final = ModelParams("synthetic-old", 512, model_noise=0.6, nonlinearity=0.85, weight_seed=1)
NEW_MODEL: Final = ModelParams("synthetic-new", 768, model_noise=0.25, nonlinearity=0.85, weight_seed=2)
# The upgrade after next (docs/backfill.md): once synthetic-new has replaced synthetic-old, it is replaced in turn.
NEXT_MODEL: Final = ModelParams("synthetic-next", 1024, model_noise=0.12, nonlinearity=0.85, weight_seed=3)
# `synthetic-NAME` backends and the synth commands' --old-model / --new-model choices.
SYNTHETIC_MODELS: Final = {"old": OLD_MODEL, "new": NEW_MODEL, "next": NEXT_MODEL}
DEFAULT_WORLD: Final = WorldParams()


# --------------------------------------------------------------------------- counter-based hashing


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser: a bijective avalanche mix of each uint64 (wraps mod 2^64 by design)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash(stream: int, seed: int, *parts: npt.NDArray[np.uint64] | int) -> npt.NDArray[np.uint64]:
    """One uint64 per element from (stream, seed, parts...), by chaining splitmix64 (a counter-based RNG)."""
    with np.errstate(over="ignore"):
        h = _mix64(np.asarray([(stream * 0x100000001B3 + seed) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
        for part in parts:
            h = _mix64(h + np.asarray(part).astype(np.uint64) * _GOLDEN)
    return h


def _quantize(x: torch.Tensor, bits: int, limit: float) -> torch.Tensor:
    """Round to the grid 2^-bits and clamp to [-limit, limit]: exact steps that make later sums exact."""
    scale = float(2**bits)
    return torch.clamp(torch.round(x * scale) / scale, -limit, limit)


# --------------------------------------------------------------------------- the latent world


class SyntheticWorld:
    """Latents and view noise of the synthetic items; pure functions of (params, item id, view)."""

    def __init__(self, params: WorldParams = DEFAULT_WORLD) -> None:
        self.params = params
        rng = np.random.Generator(np.random.Philox(key=params.seed))
        dz = params.latent_dim
        self.centres = _dyadic(rng.standard_normal((params.n_clusters, dz)), 12)
        # A Gaussian vector per key: the sum of one row from each of _SLOTS tables, the rows chosen by
        # 12-bit fields of one hash.  One hash per vector instead of one per coordinate keeps 10^7
        # latents cheap; all values are dyadic, so the float32 sums are exact.
        tables = rng.standard_normal((_SLOTS, 1 << _SLOT_BITS, dz)) / np.sqrt(_SLOTS)
        self.tables = _dyadic(tables, 12)

    def gaussian(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.float32]:
        """A standard-normal-like vector [n, dz] per uint64 key (deterministic, exact float32 sums)."""
        mask = np.uint64((1 << _SLOT_BITS) - 1)
        out: npt.NDArray[np.float32] = self.tables[0][(keys & mask).astype(np.intp)]
        for slot in range(1, _SLOTS):
            idx = ((keys >> np.uint64(slot * _SLOT_BITS)) & mask).astype(np.intp)
            out += self.tables[slot][idx]
        return out

    def latents(self, item_ids: IntArray) -> npt.NDArray[np.float32]:
        """Latent z [n, dz] of each item: its cluster centre plus within-cluster spread, unit variance."""
        p = self.params
        ids = item_ids.astype(np.uint64)
        cluster = (_hash(_STREAM_CLUSTER, p.seed, ids) % np.uint64(p.n_clusters)).astype(np.intp)
        spread = self.gaussian(_hash(_STREAM_LATENT, p.seed, ids))
        z = self.centres[cluster] + np.float32(p.cluster_spread) * spread
        return z * np.float32(1.0 / np.sqrt(1.0 + p.cluster_spread**2))

    def view_noise(self, item_ids: IntArray, views: IntArray) -> npt.NDArray[np.float32]:
        """Noise [n, dz] a view adds to its item's latent; shared by every model that sees the view."""
        p = self.params
        keys = _hash(_STREAM_VIEW, p.seed, item_ids.astype(np.uint64), _view_key(views))
        sigma = np.where(views == IMAGE_VIEW, p.image_noise, p.caption_noise).astype(np.float32)
        return self.gaussian(keys) * sigma[:, None]

    def model_noise(self, model_seed: int, item_ids: IntArray, views: IntArray) -> npt.NDArray[np.float32]:
        """Unit-scale noise [n, dz] one model adds to one (item, view): the model's own error."""
        keys = _hash(_STREAM_MODEL, self.params.seed, model_seed, item_ids.astype(np.uint64), _view_key(views))
        return self.gaussian(keys)


def _view_key(views: IntArray) -> npt.NDArray[np.uint64]:
    """Views as hash parts: image -> 0, caption j -> j + 1."""
    return (views.astype(np.int64) + 1).astype(np.uint64)


def _dyadic(x: npt.NDArray[np.float64], bits: int) -> npt.NDArray[np.float32]:
    """Round to multiples of 2^-bits as float32 (exact: values stay far below 2^(24-bits))."""
    return (np.round(x * 2.0**bits) / 2.0**bits).astype(np.float32)


@lru_cache(maxsize=4)
def world_for(params: WorldParams = DEFAULT_WORLD) -> SyntheticWorld:
    """The shared world for these parameters (built once per process: a few MB of tables)."""
    return SyntheticWorld(params)


# --------------------------------------------------------------------------- parsing inputs


def parse_inputs(batch: Sequence[str], modality: Modality = Modality.text) -> tuple[IntArray, IntArray]:
    """Map input strings to (item ids, view codes); anything unparseable hashes to its own item.

    The view comes from the string; without one, `text` means caption-0 and `image` the image view.
    """
    default_view = 0 if modality == "text" else IMAGE_VIEW
    items = np.empty(len(batch), dtype=np.int64)
    views = np.empty(len(batch), dtype=np.int64)
    for k, text in enumerate(batch):
        match = _INPUT.match(text)
        if match is None:
            digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            items[k] = HASHED_ITEM_BASE | (int.from_bytes(digest, "little") & (HASHED_ITEM_BASE - 1))
            views[k] = default_view
            continue
        items[k] = int(match.group(1))
        if match.group(2):
            views[k] = IMAGE_VIEW
        elif match.group(3) is not None:
            views[k] = int(match.group(3))
        else:
            views[k] = default_view
    return items, views


def format_item(item_id: int, view: int = IMAGE_VIEW) -> str:
    """The input string naming (item, view), e.g. `item-0000000042 caption-1`."""
    suffix = "image" if view == IMAGE_VIEW else f"caption-{view}"
    return f"item-{item_id:010d} {suffix}"


# --------------------------------------------------------------------------- the encoders


class SyntheticEncoder:
    """A simulated model of the synthetic world; implements the `Encoder` protocol."""

    # Grids that make every sum exact: inputs and hidden units on 2^-5 within +-8 (<= 2^8 units),
    # weights on 2^-8 within +-0.5 (<= 2^7 units), so products are <= 2^15 units of 2^-13 and
    # <= 192 of them stay below 2^23: exact even in float32.  Outputs are re-rounded to 2^-11
    # (<= 2^21 units) so the squared norm (< 2^52) is exact in float64.
    _X_BITS, _X_LIMIT = 5, 8.0
    _W_BITS, _W_LIMIT = 8, 0.5
    _Y_BITS = 11

    def __init__(
        self,
        model: ModelParams,
        device: str = "cpu",
        world: WorldParams = DEFAULT_WORLD,
        chunk_size: int = 4096,
    ) -> None:
        self.model = model
        self.world = world_for(world)
        self.dim = model.dim
        self.model_id = model.model_id
        self.device = device
        self.chunk_size = chunk_size
        self._torch_device = torch.device(device)
        self._weights64 = self._weights()
        w1, b1, w2 = self._weights64
        self._weights32 = (w1.to(torch.float32), b1.to(torch.float32), w2.to(torch.float32))

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Seeded MLP weights: W1 [dz, H], b1 [H], W2 [H + dz, dim] (ReLU part on top of the skip part)."""
        p, m = self.world.params, self.model
        rng = np.random.Generator(np.random.Philox(key=[p.seed, m.weight_seed]))
        dz, hidden = p.latent_dim, p.hidden
        w1 = rng.standard_normal((dz, hidden)) / np.sqrt(dz)
        b1 = rng.standard_normal(hidden) * 0.5
        # W2 has orthonormal rows, so the embedding is an isometric copy of the features
        # [nl * h / |h|_rms, (1 - nl) * x / |x|_rms]: the skip part is an exact rotation between models
        # and only the ReLU part (different random features per model) resists Procrustes.
        basis, _ = np.linalg.qr(rng.standard_normal((m.dim, hidden + dz)))
        weights = np.concatenate(
            [
                np.full(hidden, m.nonlinearity / np.sqrt(_H_M2 * hidden)),
                np.full(dz, (1.0 - m.nonlinearity) / np.sqrt(dz)),
            ]
        )
        w2 = (basis * weights).T
        # Only directions matter after normalisation: scale the entries to sit well on the weight grid.
        w2 *= _W2_STD / w2.std()

        def q(a: npt.NDArray[np.float64], bits: int, limit: float) -> torch.Tensor:
            """Quantise onto the grid and move to the device."""
            return _quantize(torch.from_numpy(a), bits, limit).to(self._torch_device)

        return (
            q(w1, self._W_BITS, self._W_LIMIT),
            q(b1, self._X_BITS + self._W_BITS, self._X_LIMIT),
            q(w2, self._W_BITS, self._W_LIMIT),
        )

    def _exact_float32(self) -> bool:
        """float32 matmuls are exact here only if nothing downgrades them (bf16 / TF32 modes)."""
        return self._torch_device.type == "cpu" and torch.get_float32_matmul_precision() == "highest"

    @torch.no_grad()
    def _map(self, x_np: npt.NDArray[np.float32], out: Embeddings) -> None:
        """Write the fixed nonlinear map of x [n, dz] into out [n, dim] as unit rows; same bits for any batching."""
        n, dz = x_np.shape
        hidden = self.world.params.hidden
        use32 = self._exact_float32()
        w1, b1, w2 = self._weights32 if use32 else self._weights64
        dtype = torch.float32 if use32 else torch.float64
        # One buffer [h | x] so the second layer is a single GEMM; out= keeps big temporaries (and
        # their page faults) out of the hot loop.
        hx = torch.empty((n, hidden + dz), dtype=dtype, device=self._torch_device)
        x, h = hx[:, hidden:], hx[:, :hidden]
        x.copy_(torch.from_numpy(x_np))
        x.mul_(2.0**self._X_BITS).round_().div_(2.0**self._X_BITS).clamp_(-self._X_LIMIT, self._X_LIMIT)
        torch.addmm(b1, x, w1, out=h).relu_()
        h.mul_(2.0**self._X_BITS).round_().div_(2.0**self._X_BITS).clamp_(max=self._X_LIMIT)
        y = (hx @ w2).mul_(2.0**self._Y_BITS).round_()
        y64 = y.to(torch.float64)
        norm = torch.einsum("ij,ij->i", y64, y64).sqrt_().to(torch.float32).clamp_(min=1.0)
        # (A zero row would need every coordinate to round to 0; the clamp only keeps it finite.)
        if y.dtype != torch.float32 or y.device.type != "cpu":
            y = y.to(torch.float32).cpu()
            norm = norm.cpu()
        torch.div(y, norm.unsqueeze(1), out=torch.from_numpy(out))

    def model_inputs(self, item_ids: IntArray, views: IntArray) -> npt.NDArray[np.float32]:
        """What this model sees of each (item, view): latent + view noise + its own noise [n, dz]."""
        w = self.world
        x = w.latents(item_ids) + w.view_noise(item_ids, views)
        x += np.float32(self.model.model_noise) * w.model_noise(self.model.weight_seed, item_ids, views)
        return x

    def encode_items(self, item_ids: npt.ArrayLike, views: npt.ArrayLike | int = IMAGE_VIEW) -> Embeddings:
        """Bulk API: embed items directly (no strings), chunk by chunk; views is one code or one per item."""
        ids = np.asarray(item_ids, dtype=np.int64).reshape(-1)
        view_arr = np.broadcast_to(np.asarray(views, dtype=np.int64), ids.shape)
        out = np.empty((ids.shape[0], self.dim), dtype=np.float32)
        for start in range(0, ids.shape[0], self.chunk_size):
            stop = start + self.chunk_size
            self._map(self.model_inputs(ids[start:stop], view_arr[start:stop]), out[start:stop])
        return out

    def encode(self, batch: list[str], modality: Modality = Modality.text) -> Embeddings:
        """Return float32 [len(batch), dim] unit rows for inputs naming (item, view)."""
        items, views = parse_inputs(batch, modality)
        return self.encode_items(items, views)

    def warmup(self) -> None:
        """Encode one input so lazy torch initialisation happens now."""
        self.encode([format_item(0, 0)])


class SyntheticOldEncoder(SyntheticEncoder):
    """The simulated OLD model (`synthetic-old`, 512-d, noisier): the gallery is frozen in its space."""

    def __init__(self, device: str = "cpu", world: WorldParams = DEFAULT_WORLD) -> None:
        super().__init__(OLD_MODEL, device=device, world=world)


class SyntheticNewEncoder(SyntheticEncoder):
    """The simulated NEW model (`synthetic-new`, 768-d, less noisy, a different nonlinear map)."""

    def __init__(self, device: str = "cpu", world: WorldParams = DEFAULT_WORLD) -> None:
        super().__init__(NEW_MODEL, device=device, world=world)


def synthetic_encoder(name: str, device: str = "cpu") -> SyntheticEncoder:
    """The simulated model `synthetic-NAME` (old, new or next; the first two are the default roles' models)."""
    return SyntheticEncoder(SYNTHETIC_MODELS[name], device=device)
