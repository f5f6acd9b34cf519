"""The short versions of `make backfill-faults`: a run, or two parallel parts, killed and resumed ends like one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_backfill_killed_three_times_and_resumed_equals_an_uninterrupted_one() -> None:
    done = subprocess.run(
        [sys.executable, "loadtest/backfill_faults.py", "--kills", "3", "--items", "3000", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["kills"] == 3
    # Each kill landed while the run was moving items, not before it started or after it ended.
    assert all(0 <= moved < 3000 for moved in result["moved_at_each_kill"])
    assert result["identical"] and result["ids_covered"] and not result["hidden_leftovers"]


def test_two_parallel_parts_killed_four_times_and_resumed_equal_an_uninterrupted_run() -> None:
    done = subprocess.run(
        [sys.executable, "loadtest/backfill_faults.py", "--kills", "4", "--items", "3000", "--parts", "2", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["parts"] == 2 and result["kills"] == 4
    assert all(0 <= moved < 3000 for moved in result["moved_at_each_kill"])
    assert result["identical"] and result["ids_covered"] and not result["hidden_leftovers"]
