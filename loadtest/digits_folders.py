"""Write the digits upgrade's support and test splits as folders the CLI reads (`fit`, `eval`).

    .venv/bin/python loadtest/digits_folders.py --out artifacts/digits [--seed 0]

Writes OUT/instance/{support,test} (noisy view -> clean image, one relevant row per query) and
OUT/class/{support,test} (class-label relevance), built as loadtest/bench_alpha.py builds them from the
two small classifiers of tests/support/digits_models.py (OLD on classes 0-4, NEW on 0-9; about a second).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.bench_alpha import digits_class_splits, digits_splits  # noqa: E402
from service.bulk.support import models_json  # noqa: E402
from service.compat.io import Split  # noqa: E402
from service.encoders.identity import MODELS_JSON, ModelIdentity  # noqa: E402


def write_split(split: Split, out: Path) -> None:
    """The split's arrays under their folder names (new_target.npy only when it has one)."""
    out.mkdir(parents=True, exist_ok=True)
    arrays = {
        "old_query": split.old_query,
        "new_query": split.new_query,
        "old_target": split.old_target,
        "new_target": split.new_target,
        "query_ids": split.query_ids,
        "target_ids": split.target_ids,
    }
    for name, array in arrays.items():
        if array is not None:
            np.save(out / f"{name}.npy", array)
    # The two classifiers as models.json names them (no weights file: they are trained in-process each time).
    old, new = (
        ModelIdentity(f"digits-{side}", f"digits-{side}", None, dim)
        for side, dim in (("old", split.old_dim), ("new", split.new_dim))
    )
    record = models_json(old, new, "image", "image", len(split.old_query), targets=len(split.old_target))
    (out / MODELS_JSON).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    """Build both digits variants and write them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, (support, test) in (
        ("instance", digits_splits(args.seed)),
        ("class", digits_class_splits(args.seed)),
    ):
        write_split(support, args.out / name / "support")
        write_split(test, args.out / name / "test")
        print(f"wrote {args.out / name}: {len(support.old_query)} support pairs, {len(test.old_query)} test queries")


if __name__ == "__main__":
    main()
