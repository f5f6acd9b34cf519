"""`nobackfill` from a test: in this process (same parsing, exit code, error line) or as a subprocess; and any
other command (a loadtest script, Locust) as a subprocess that must succeed."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

NOBACKFILL = [sys.executable, "-m", "service.cli"]


@dataclass(frozen=True)
class Done:
    """Exit code and output of one in-process `nobackfill` run."""

    returncode: int
    stdout: str
    stderr: str


def cli(*args: str | int | Path) -> Done:
    """Run `nobackfill ARGS` in this process through service.cli.main (exit code 2 on our errors)."""
    from service.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    argv = sys.argv
    sys.argv = ["nobackfill", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli_main()
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = argv
    return Done(code if isinstance(code, int) else 1, out.getvalue(), err.getvalue())


def cli_checked(*args: str | int | Path) -> Done:
    """`nobackfill ARGS` in this process (cli), failing the test with its output unless it exits 0: for a fixture
    that builds artifacts with the CLI, without a process start that imports torch again (about 6 s on 2 cores)."""
    done = cli(*args)
    if done.returncode != 0:
        pytest.fail(f"nobackfill {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


def run_cli(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `nobackfill ARGS` as a user would; fail the test with its output if `check` and it fails."""
    done = subprocess.run([*NOBACKFILL, *map(str, args)], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        pytest.fail(f"nobackfill {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


def run_checked(
    command: list[str], timeout: float, cwd: Path | None = None, tail: int = 2000
) -> subprocess.CompletedProcess[str]:
    """Run `command` with its output captured as text; assert it exited 0, the last `tail` characters of its stderr
    as the message (a script's traceback is at the end of a long log)."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-tail:]
    return done


def write_pairs(path: Path, rows: list[dict[str, Any] | str]) -> Path:
    """A pairs JSONL file; strings are written verbatim."""
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path
