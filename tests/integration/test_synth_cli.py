"""The synthetic models across processes, and `nobackfill synth` as a user runs it (subprocesses).

The encoders themselves, the regime and the registry: tests/unit/test_synthetic.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.encoders.synthetic import SyntheticNewEncoder, SyntheticOldEncoder
from tests.support.cli import NOBACKFILL
from tests.support.world import digest

Rows = npt.NDArray[np.float32]


def test_bit_identical_across_processes(old: SyntheticOldEncoder, new: SyntheticNewEncoder) -> None:
    code = (
        "import service, hashlib, numpy as np, torch; torch.set_num_threads(1)\n"
        "from service.encoders.synthetic import SyntheticOldEncoder, SyntheticNewEncoder\n"
        "ids = np.arange(10**9, 10**9 + 300)\n"
        "for enc in (SyntheticOldEncoder(), SyntheticNewEncoder()):\n"
        "    print(hashlib.sha256(enc.encode_items(ids[::-1], 4)[::-1].tobytes()).hexdigest())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    ids = np.arange(10**9, 10**9 + 300)
    assert done.stdout.split() == [digest(old.encode_items(ids, 4)), digest(new.encode_items(ids, 4))]


# --------------------------------------------------------------------------- synth CLI


def synth(*args: str | int | Path) -> subprocess.CompletedProcess[str]:
    """Run `nobackfill synth ARGS`."""
    return subprocess.run(
        [*NOBACKFILL, "synth", *map(str, args)], capture_output=True, text=True, timeout=300, check=False
    )


def test_synth_support_and_test_write_fit_eval_folders(tmp_path: Path, old: SyntheticOldEncoder) -> None:
    sup, test = tmp_path / "support", tmp_path / "test"
    assert synth("support", "--n", 300, "--out", sup).returncode == 0
    assert synth("test", "--n", 200, "--gallery-size", 1000, "--out", test).returncode == 0
    for folder, nq, nt in ((sup, 300, 300), (test, 200, 1000)):
        shapes = {p.name: np.load(p).shape for p in folder.glob("*.npy")}
        assert shapes == {
            "old_query.npy": (nq, 512),
            "new_query.npy": (nq, 768),
            "old_target.npy": (nt, 512),
            "new_target.npy": (nt, 768),
            "query_ids.npy": (nq,),
            "target_ids.npy": (nt,),
        }
        assert np.load(folder / "old_query.npy").dtype == np.float32
        assert np.load(folder / "query_ids.npy").dtype == np.int64
        assert np.isin(np.load(folder / "query_ids.npy"), np.load(folder / "target_ids.npy")).all()
    # Support items never overlap gallery / test items, and targets are the old model's image views.
    assert np.load(sup / "target_ids.npy").min() > np.load(test / "target_ids.npy").max()
    assert np.array_equal(np.load(test / "target_ids.npy"), np.arange(1000))
    assert np.array_equal(np.load(test / "old_target.npy")[:50], old.encode_items(np.arange(50)))


def test_synth_refuses_bad_input(tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    for args in (
        ["support", "--n", 10, "--out", full],
        ["test", "--n", 50, "--gallery-size", 10, "--out", tmp_path / "t"],
    ):
        done = synth(*args)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("error: "), done.stderr
    assert synth("support", "--n", 0, "--out", tmp_path / "z").returncode == 2
