"""The session's synthetic world (gallery + support set + profile, built through the CLI) and the real one's size."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.encoders.synthetic import IMAGE_VIEW, format_item
from service.items.store import write_item_store
from service.settings import CacheSettings, CompatSettings, EncoderSettings, IndexSettings, Settings
from service.vocabulary import Modality
from tests.support.cli import run_cli

WORLD_GALLERY_SIZE = 20_000
WORLD_SUPPORT_SIZE = 4_000
CAPTION = "item-{:010d} caption-1"  # the text query of world item i: CAPTION.format(i)
REAL_VOCAB_LIMIT = 3000  # ~2,000 frequent words and the single characters: distils in a few seconds


@dataclass(frozen=True)
class World:
    """Artifacts of a small synthetic upgrade: gallery, support set, profile."""

    gallery_dir: Path
    support_dir: Path
    profile_dir: Path


def build_world(root: Path) -> World:
    """A 20k-item gallery and a profile fitted on a disjoint 4k support set, under `root` (reused if complete)."""
    world = World(root / "gallery", root / "support", root / "profile")
    if (world.profile_dir / "profile.json").exists():
        return world
    run_cli("gallery", "build", "--size", WORLD_GALLERY_SIZE, "--out", world.gallery_dir, "--nlist", 64)
    run_cli("synth", "support", "--n", WORLD_SUPPORT_SIZE, "--out", world.support_dir)
    run_cli("fit", world.support_dir, "--out", world.profile_dir, "--folds", 3)
    return world


def write_world_items(out: Path, size: int, source: str) -> Path:
    """Items 0..size-1 of the synthetic world as an item store at `out`, each item's text its image view (what
    `synth items` writes), written in this process: no CLI run for a test that needs only the store."""
    write_item_store(out, ((i, format_item(i, IMAGE_VIEW)) for i in range(size)), Modality.text, source)
    return out


def make_settings(world: World, **overrides: Any) -> Settings:
    """Settings that point at the world (nprobe 16), with other sections overridden."""
    return Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=16),
        compat=CompatSettings(profile_dir=world.profile_dir),
        **overrides,
    )


def isolated_settings(world: World, isolation: str = "process", **overrides: Any) -> Settings:
    """The world served with both synthetic encoders under `isolation` (in-process, thread or process), nprobe 8,
    no cache, other sections overridden: what the encoder-isolation and unwinding tests start."""
    return Settings(
        old=EncoderSettings(backend="synthetic-old", device="cpu", isolation=isolation),
        new=EncoderSettings(backend="synthetic-new", device="cpu", isolation=isolation),
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=8),
        compat=CompatSettings(profile_dir=world.profile_dir),
        cache=CacheSettings(lru_size=0),
        **overrides,
    )


def digest(rows: npt.NDArray[np.float32]) -> str:
    """sha256 of the raw float32 bytes: equal digests mean bit-identical embeddings."""
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=np.float32).tobytes()).hexdigest()
