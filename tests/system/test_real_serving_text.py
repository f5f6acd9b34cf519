"""A real text upgrade served over HTTP: static model2vec (old) -> the packaged MiniLM (new), real Redis.

Every artifact is made with the CLI as a user would (`realworld models/corpus`, `support build`,
`fit`, `encode`, `gallery build`), on numpy's docstring pairs; the service runs as `nobackfill serve`
with backend sentence-transformers on both sides and the shared test Redis as its cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.commands.real_demo import OLD_MODEL, RealDeployment, curl_example
from service.compat.heads import transform
from service.compat.profile import load_profile
from service.index.gallery import Gallery
from tests.support.cli import NOBACKFILL, cli_checked
from tests.support.servers import free_port, serve_process
from tests.support.tiny_models import tiny_static
from tests.support.world import World

SUPPORT, TEST = 200, 60  # numpy gives ~500 pairs: the other ~240 are the gallery's distractors
NPROBE = 4
BACKEND = "sentence-transformers"


@dataclass(frozen=True)
class TextUpgrade:
    """The artifacts of the small real upgrade, in the folders `demo --real` uses, and the settings that serve it."""

    world: World
    real: RealDeployment  # its models: the distilled static one (256-d, old) and the packaged MiniLM (384-d, new)
    queries: list[str]
    relevant: list[int]

    def env(self, **overrides: str) -> dict[str, str]:
        """Environment of `nobackfill serve` for this upgrade."""
        return {
            "NOBACKFILL_OLD__BACKEND": BACKEND,
            "NOBACKFILL_OLD__PATH": str(self.real.old_model),
            "NOBACKFILL_NEW__BACKEND": BACKEND,
            "NOBACKFILL_NEW__PATH": str(self.real.new_model),
            "NOBACKFILL_INDEX__NPROBE": str(NPROBE),
            **overrides,
        }


@pytest.fixture(scope="module")
def upgrade(real_models: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> TextUpgrade:
    """Corpus, support set, profile and old-model gallery of static -> MiniLM, all through the CLI."""
    real = RealDeployment(tmp_path_factory.mktemp("text-upgrade"))
    # The session's models (distilled once), where the demo keeps its own: real.old_model and real.new_model.
    (real.root / "models").symlink_to(real_models[0], target_is_directory=True)
    corpus, support = real.corpus, real.root / "support"
    cli_checked(
        "realworld", "corpus", "--out", corpus, "--packages", "numpy", "--support", SUPPORT, "--test", TEST,
    )  # fmt: skip
    cli_checked(
        "support", "build", "--pairs", corpus / "support.jsonl", "--out", support,
        "--old-backend", BACKEND, "--old-path", real.old_model, "--new-backend", BACKEND, "--new-path", real.new_model,
    )  # fmt: skip
    cli_checked("fit", support, "--out", real.profile, "--folds", "3")
    embeddings = real.root / "g.npy"
    cli_checked(
        "encode", "--backend", BACKEND, "--path", real.old_model, "--input", corpus / "gallery.txt",
        "--out", embeddings,
    )  # fmt: skip
    cli_checked(
        "gallery", "build", "--from-npy", embeddings, "--ids", corpus / "gallery_ids.npy", "--out", real.gallery,
        "--nlist", "8", "--pq-m", "32",
    )  # fmt: skip
    tests = [json.loads(line) for line in (corpus / "test.jsonl").read_text().splitlines()]
    return TextUpgrade(
        World(real.gallery, support, real.profile),
        real,
        [row["query"] for row in tests],
        [row["target_id"] for row in tests],
    )


@pytest.fixture(scope="module")
def served(upgrade: TextUpgrade) -> Iterator[str]:
    """`nobackfill serve` on the upgrade, old embeddings cached in the test Redis under a fresh namespace."""
    redis_url = os.environ.get("NOBACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    env = upgrade.env(NOBACKFILL_CACHE__REDIS_URL=redis_url, NOBACKFILL_CACHE__NAMESPACE=f"real-{uuid.uuid4().hex}")
    with serve_process(upgrade.world, env=env) as base:
        yield base


def search(base: str, texts: list[str], **body: object) -> list[dict[str, object]]:
    """POST /v1/search with text queries; the results, after checking the status."""
    response = httpx.post(f"{base}/v1/search", json={"queries": [{"text": t} for t in texts], **body}, timeout=60)
    assert response.status_code == 200, response.text
    results: list[dict[str, object]] = response.json()["results"]
    return results


def test_text_in_ids_out_and_the_repeat_is_a_redis_hit(served: str, upgrade: TextUpgrade) -> None:
    first = search(served, upgrade.queries[:1], k=5)[0]
    again = search(served, upgrade.queries[:1], k=5)[0]
    gallery_ids = set(np.load(upgrade.real.corpus / "gallery_ids.npy").tolist())
    assert len(first["ids"]) == 5 and set(first["ids"]) <= gallery_ids  # type: ignore[arg-type]
    assert (first["mode"], first["cache"], again["cache"]) == ("slerp", "miss", "hit")
    assert again["ids"] == first["ids"]
    info = httpx.get(f"{served}/v1/info", timeout=10).json()
    assert info["cache"]["kind"] == "redis"
    assert (info["old_model"]["id"], info["old_model"]["dim"], info["new_model"]["dim"]) == (
        "minilm-static-256",
        256,
        384,
    )
    assert info["new_model"]["max_seq_length"] == 256 and info["old_model"]["max_seq_length"] is None
    # `auto` runs both sentence-transformers models in child processes of their own.
    assert info["new_model"]["isolation"] == info["old_model"]["isolation"] == "process"


def test_served_answers_are_the_offline_pipeline(served: str, upgrade: TextUpgrade, tmp_path: Path) -> None:
    # The same queries through `nobackfill encode` (the same backend code) and the profile offline.
    texts = tmp_path / "queries.txt"
    texts.write_text("\n".join(upgrade.queries) + "\n")
    rows = {}
    for name, model in (("old", upgrade.real.old_model), ("new", upgrade.real.new_model)):
        cli_checked(
            "encode", "--backend", BACKEND, "--path", model, "--input", texts, "--out", tmp_path / f"{name}.npy"
        )
        rows[name] = np.load(tmp_path / f"{name}.npy")
    profile = load_profile(upgrade.world.profile_dir)
    offline = transform(profile, "slerp", rows["old"], rows["new"], "text").queries
    _, expected = Gallery.load(upgrade.world.gallery_dir).search(offline, 10, NPROBE)
    served_ids = [r["ids"] for start in range(0, TEST, 20) for r in search(served, upgrade.queries[start : start + 20])]
    overlap = [len(set(a) & set(b.tolist())) / 10 for a, b in zip(served_ids, expected, strict=True)]  # type: ignore[arg-type]
    # Batch composition changes MiniLM's float rounding a little, so a near-tie may swap places at rank 10.
    assert np.mean(overlap) > 0.95, overlap
    hits = np.mean([rel in ids for rel, ids in zip(upgrade.relevant, served_ids, strict=True)])  # type: ignore[operator]
    assert hits > 0.3, hits  # chance is 10 in ~300; a broken model or map lands near it


def refused_start(upgrade: TextUpgrade, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `nobackfill serve` expecting it to refuse; its output and status."""
    full = {
        **os.environ,
        "NOBACKFILL_INDEX__GALLERY_DIR": str(upgrade.world.gallery_dir),
        "NOBACKFILL_COMPAT__PROFILE_DIR": str(upgrade.world.profile_dir),
        "NOBACKFILL_API__PORT": str(free_port()),
        **upgrade.env(**env),
    }
    return subprocess.run([*NOBACKFILL, "serve"], env=full, capture_output=True, text=True, timeout=120, check=False)


def test_a_model_of_the_wrong_dimension_is_refused_in_one_line(upgrade: TextUpgrade) -> None:
    static = upgrade.real.old_model  # the 256-d model as the new one
    done = refused_start(upgrade, NOBACKFILL_NEW__PATH=str(static))
    assert done.returncode != 0
    refusals = [line for line in done.stderr.splitlines() if "refusing to start" in line]
    assert len(refusals) == 1 and "Traceback" not in done.stderr, done.stderr
    line = refusals[0]
    for part in ("NOBACKFILL_NEW__PATH=" + str(static), "256-d", "384-d", "NOBACKFILL_COMPAT__PROFILE_DIR"):
        assert part in line, line


def test_other_weights_under_the_same_name_are_refused(upgrade: TextUpgrade, tmp_path: Path) -> None:
    # Same folder name (so the same model id) and dim, different weights: only the fingerprint tells.
    impostor = tiny_static(tmp_path / OLD_MODEL, dim=256)
    done = refused_start(upgrade, NOBACKFILL_OLD__PATH=str(impostor))
    line = next(line for line in done.stderr.splitlines() if "refusing to start" in line)
    assert done.returncode != 0 and "weights sha256" in line and "gallery" in line and "profile" in line, line


def test_a_missing_model_folder_is_refused_in_one_line(upgrade: TextUpgrade, tmp_path: Path) -> None:
    done = refused_start(upgrade, NOBACKFILL_OLD__PATH=str(tmp_path / "nowhere"))
    # Refused before uvicorn or any model starts, with the other configured folders checked at once.
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr == f"error: NOBACKFILL_OLD__PATH={tmp_path / 'nowhere'}: no such folder\n"


def test_the_curl_demo_real_prints_works_when_pasted_into_a_shell(served: str, upgrade: TextUpgrade) -> None:
    host, port = served.removeprefix("http://").split(":")
    pasted = curl_example(upgrade.real, host, int(port))
    # A newcomer's shell after `make install`: the virtualenv's bin folder is not on PATH.
    shell_path = ":".join(p for p in os.environ["PATH"].split(":") if not Path(p, "nobackfill").exists())
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        ["bash", "-c", pasted], cwd=repo, env={**os.environ, "PATH": shell_path}, capture_output=True, text=True
    )
    assert done.returncode == 0, f"{pasted}\n{done.stderr}"
    assert pasted.rstrip().split("| ")[-1].startswith((".venv/bin/nobackfill ", "/"))
    assert done.stdout.count("\n") >= 5, done.stdout  # the texts of the 5 hits
