"""The short version of `make chaos`: every fault scenario of loadtest/chaos.py for a few seconds each.

Real service processes, a real redis-server and Locust; the assertions are about what failed and how
(never about how long anything took: those figures belong in docs/reliability.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.world import World


@pytest.fixture(scope="module")
def results(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One short run of every scenario on the session's synthetic world."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtest"))
    import chaos

    out = tmp_path_factory.mktemp("chaos")
    runs = chaos.main(["--short", "--world", str(world.profile_dir.parent), "--out", str(out)])
    return {run["scenario"]: run for run in runs}


@pytest.mark.redis
def test_redis_killed_and_restarted_under_locust_fails_nothing(results: dict[str, dict[str, Any]]) -> None:
    run = results["redis-kill"]
    assert run["requests"] > 0 and run["failed"] == 0, run


@pytest.mark.redis
def test_redis_paused_under_load_fails_nothing(results: dict[str, dict[str, Any]]) -> None:
    run = results["redis-pause"]
    assert run["paused_requests"] > 0 and run["failed"] == 0, run
    # Searches shed by admission when this box's cores are taken (503 + Retry-After) are not Redis faults;
    # most of those sent while Redis was frozen must still be answered.
    assert run["paused_answered"] >= run["paused_requests"] / 2, run


def test_a_burst_is_refused_with_retry_after_and_recovers(results: dict[str, dict[str, Any]]) -> None:
    run = results["burst"]
    assert run["accepted"] > 0 and run["other_failures"] == 0, run
    assert run["refused_with_retry_after"] == run["refused_503"], run
    # After the burst the service answers again: nothing fails, though a box busier than when its rate was
    # measured may still shed some of the recovery's searches (503 overloaded with Retry-After).
    assert run["recovery_answered"] > 0 and run["recovery_failures"] == 0, run


def test_encoder_faults_fail_only_the_affected_requests(results: dict[str, dict[str, Any]]) -> None:
    by_input = results["encoder-faults"]["by_input"]
    for tag in ("raise", "nan"):
        assert set(by_input[tag]["answers"]) <= {"500 encoder_failed"}, by_input
    # A hanging input times out alone, or is refused at once when it hung lately (the hot set repeats).
    assert set(by_input["hang"]["answers"]) <= {"504 encoder_timeout", "422 poison_input"}, by_input
    # A clean input is re-run without a hung batch-mate; it can still wait in vain while every replica is
    # stuck (refused or timed out), never fail otherwise.
    assert set(by_input["clean"]["answers"]) <= {"200", "503 overloaded", "504 encoder_timeout"}, by_input
    assert by_input["clean"]["answers"].get("200", 0) > 0
    # A probe hangs alone, then it and every input that hung are sent again: each refused at once.
    assert by_input["hang_probe"]["answers"] == {"504 encoder_timeout": 1}, by_input
    repeated = by_input["hang_repeated"]
    assert repeated["answers"] == {"422 poison_input": repeated["requests"]}, by_input


def test_sigterm_answers_every_accepted_request(results: dict[str, dict[str, Any]]) -> None:
    run = results["sigterm"]
    assert run["sent_before_signal"] > 0 and run["accepted_but_unanswered"] == 0, run
    # Every answer is a 200, or a search shed by admission (503 + Retry-After) when this box's cores are taken.
    assert run["answered_non_200"] == run["shed"] and run["exit_seconds"] is not None, run


def test_the_gallery_bytes_never_change(results: dict[str, dict[str, Any]]) -> None:
    run = results["gallery-bytes"]
    assert run["identical"] and run["reloads"] == [200, 200] and run["failed"] == 0, run
