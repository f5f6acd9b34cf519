"""The short versions of `make backfill-faults`: a run, or two parallel parts, killed and resumed ends like one run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_checked

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("parts", "kills"), [(1, 3), (2, 4)], ids=["one-run", "two-parallel-parts"])
def test_a_backfill_killed_and_resumed_equals_an_uninterrupted_run(parts: int, kills: int) -> None:
    done = run_checked(
        [sys.executable, "loadtest/backfill_faults.py", "--kills", str(kills), "--items", "3000",
         "--parts", str(parts), "--json"],
        timeout=300,
        cwd=ROOT,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["parts"] == parts and result["kills"] == kills
    # Each kill landed while a run was moving items, not before it started or after it ended.
    assert all(0 <= moved < 3000 for moved in result["moved_at_each_kill"])
    assert result["identical"] and result["ids_covered"] and not result["hidden_leftovers"]
