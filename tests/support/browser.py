"""The operator page's test world (an item store with a hostile item, a quarter-moved segment) and Chromium."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from service.encoders.synthetic import IMAGE_VIEW, format_item
from service.items.store import write_item_store
from service.vocabulary import Modality
from tests.support.cli import cli, run_cli
from tests.support.world import WORLD_GALLERY_SIZE, World

CHROMIUM = Path("/usr/bin/chromium")  # Debian's (make browser); Playwright's own download cannot reach the internet
XSS = "<img src=x onerror=alert(1)>"
XSS_ID = 11  # the item whose stored text is XSS: the old model finds it from its caption (and slerp, at rank 1)
API_KEY = "ui-test-key"
ARTEFACTS = Path("artifacts/browser")  # gitignored (/artifacts/): screenshots and the timings of the last run
README_SHOT = ARTEFACTS / "readme.png"  # the search view in 64 colours: docs/ui-search.png is a copy of it


@dataclass(frozen=True)
class OperatorWorld:
    """The session world plus what the page shows beside it."""

    world: World
    items: Path
    segment: Path
    eval: Path
    compare: Path


def build_operator_world(world: World, root: Path) -> OperatorWorld:
    """An item store of the world's gallery (item XSS_ID's text is XSS) and a segment with a quarter of it moved."""
    items, segment = root / "items", root / "segment"
    rows = ((i, XSS if i == XSS_ID else format_item(i, IMAGE_VIEW)) for i in range(WORLD_GALLERY_SIZE))
    write_item_store(items, rows, Modality.text, "the synthetic world, one hostile item")
    run_cli(
        "backfill", "run", "--segment", segment, "--input", items, "--gallery", world.gallery_dir,
        "--backend", "synthetic-new", "--profile", world.profile_dir, "--fraction", "0.25", "--order", "random",
    )  # fmt: skip
    return OperatorWorld(world, items, segment, *save_results(world, root))


def save_results(world: World, root: Path) -> tuple[Path, Path]:
    """`eval --json-out` of the world's profile on a small test split; `profile compare --json-out` of it with itself.

    In this process (no interpreter start): about a second.  Comparing the profile with itself is a
    real verdict (no difference, nothing broken) without fitting a second profile.
    """
    test, saved_eval, saved_compare = root / "test", root / "eval.json", root / "compare.json"
    for args in (
        ("synth", "test", "--n", 300, "--gallery-size", 3000, "--out", test),
        ("eval", world.profile_dir, test, "--json-out", saved_eval),
        ("profile", "compare", world.profile_dir, world.profile_dir, test, "--json-out", saved_compare),
    ):
        done = cli(*args)
        assert done.returncode in (0, 3), f"nobackfill {' '.join(map(str, args))}: {done.stderr}"
    return saved_eval, saved_compare


def save_small(screenshot: Path, out: Path) -> None:
    """A 64-colour copy of a screenshot (a third of the bytes, same pixels to the eye) for the README."""
    with Image.open(screenshot) as image:
        image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
