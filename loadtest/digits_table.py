"""The digits class-extension table (5 -> 10 classes, PSP against raw features), printed for the docs.

    .venv/bin/python loadtest/digits_table.py [--pairs 5]

Runs tests/system/test_digits_experiment.py's experiment (sklearn's digits, five independently trained
(old, new) model pairs, gallery and queries held-out images of the old classes 0-4) and prints its
summary table: what docs/benchmarks.md quotes.  The tests hold the claims; this only shows the numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.digits_models import format_table, run_experiment, summarise  # noqa: E402


def main() -> None:
    """Run the pairs on one torch thread (tiny models: more threads only spin) and print the table."""
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="Independently trained (old, new) model pairs.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    summaries = summarise([run_experiment(seed)[0] for seed in range(args.pairs)])
    print(f"digits 5 -> 10 classes, {args.pairs} model pairs, gallery/queries = held-out images of classes 0-4")
    print(format_table(summaries))


if __name__ == "__main__":
    main()
