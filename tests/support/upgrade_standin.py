"""A small stand-in for the synthetic upgrade world, used by the compat tests and the fit benchmark.

Items have clustered latents z; a query and its target are two noisy views of the same z.  The old
model is a noisy linear map of the view, the new model a less noisy nonlinear (random MLP) map, so
new->new beats old->old, the two spaces are not a rotation of each other, and Procrustes + SLERP has
something to recover.  Rows are written unnormalised on purpose (the loaders must normalise).

    python -m tests.support.upgrade_standin OUT_DIR --n 100000 --d-old 512 --d-new 768
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.bulk.support import models_json
from service.encoders.identity import MODELS_JSON, ModelIdentity

Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class World:
    """Fixed random encoders of one stand-in upgrade."""

    a_old: Array
    w1_new: Array
    w2_new: Array
    centers: Array
    noise_old: float
    noise_new: float
    view_noise: float


def make_world(d_old: int = 32, d_new: int = 48, dz: int = 24, seed: int = 0, view_noise: float = 0.35) -> World:
    """Draw the old linear encoder, the new MLP encoder and the latent cluster centres."""
    rng = np.random.default_rng(seed)
    hidden = 2 * dz
    return World(
        a_old=(rng.standard_normal((dz, d_old)) / np.sqrt(dz)).astype(np.float32),
        w1_new=(rng.standard_normal((dz, hidden)) / np.sqrt(dz)).astype(np.float32),
        w2_new=(rng.standard_normal((hidden, d_new)) / np.sqrt(hidden)).astype(np.float32),
        centers=rng.standard_normal((16, dz)).astype(np.float32),
        noise_old=0.55,
        noise_new=0.25,
        view_noise=view_noise,
    )


def _latents(world: World, n: int, rng: np.random.Generator) -> Array:
    """Clustered latents: a centre plus a spread comparable to the distance between centres."""
    dz = world.centers.shape[1]
    c = world.centers[rng.integers(0, len(world.centers), n)]
    return (c + 1.0 * rng.standard_normal((n, dz), dtype=np.float32)).astype(np.float32)


def encode_old(world: World, x: Array, rng: np.random.Generator) -> Array:
    """Old model: linear map plus a lot of noise (unnormalised rows)."""
    y = x @ world.a_old
    scale = np.linalg.norm(y, axis=1, keepdims=True) / np.sqrt(y.shape[1])
    return (y + world.noise_old * scale * rng.standard_normal(y.shape, dtype=np.float32)).astype(np.float32)


def encode_new(world: World, x: Array, rng: np.random.Generator) -> Array:
    """New model: a random tanh MLP plus less noise (unnormalised rows)."""
    y = np.tanh(x @ world.w1_new) @ world.w2_new + 0.5 * (x @ world.w1_new) @ world.w2_new
    scale = np.linalg.norm(y, axis=1, keepdims=True) / np.sqrt(y.shape[1])
    return (y + world.noise_new * scale * rng.standard_normal(y.shape, dtype=np.float32)).astype(np.float32)


def write_split(
    out: Path | str,
    n: int,
    world: World,
    seed: int,
    *,
    new_target: bool = True,
    chunk: int = 20000,
    model_ids: tuple[str, str] = ("standin-old", "standin-new"),
) -> Path:
    """Write old/new query and target .npy files for n items (query row i relevant to target row i).

    models.json names the stand-in models (backend `standin`, no weights) so `fit` records them.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    parts: dict[str, list[Array]] = {"old_query": [], "new_query": [], "old_target": [], "new_target": []}
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        z = _latents(world, m, rng)
        xq = z + world.view_noise * rng.standard_normal(z.shape, dtype=np.float32)
        xt = z + world.view_noise * rng.standard_normal(z.shape, dtype=np.float32)
        parts["old_query"].append(encode_old(world, xq, rng))
        parts["new_query"].append(encode_new(world, xq, rng))
        parts["old_target"].append(encode_old(world, xt, rng))
        parts["new_target"].append(encode_new(world, xt, rng))
    for name, blocks in parts.items():
        if name == "new_target" and not new_target:
            continue
        np.save(out / f"{name}.npy", np.concatenate(blocks))
    old = ModelIdentity("standin", model_ids[0], None, world.a_old.shape[1])
    new = ModelIdentity("standin", model_ids[1], None, world.w2_new.shape[1])
    (out / MODELS_JSON).write_text(json.dumps(models_json(old, new, "text", "text", n)))
    return out


def main() -> None:
    """Write one split from the command line (used by the fit benchmark)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--d-old", type=int, default=512)
    parser.add_argument("--d-new", type=int, default=768)
    parser.add_argument("--dz", type=int, default=64)
    parser.add_argument("--view-noise", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    world = make_world(args.d_old, args.d_new, args.dz, seed=0, view_noise=args.view_noise)
    write_split(args.out, args.n, world, args.seed)


if __name__ == "__main__":
    main()
