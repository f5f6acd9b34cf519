"""Model identity end to end: encoders, profile and gallery that disagree are refused at startup and reload."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from service.compat.io import load_query_pairs
from service.encoders.identity import MODELS_JSON, read_models_json
from service.errors import ArtifactError
from service.pipeline import Pipeline
from service.settings import CompatSettings, IndexSettings, Settings
from tests.support.cli import cli
from tests.support.world import World


def settings_for(world: World, profile_dir: Path) -> Settings:
    """The synthetic world's settings with another profile."""
    return Settings(
        index=IndexSettings(gallery_dir=world.gallery_dir, nprobe=8),
        compat=CompatSettings(profile_dir=profile_dir),
    )


@pytest.fixture(scope="module")
def other_old_profile(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A profile fitted on the world's support set but recorded for another old model."""
    out = tmp_path_factory.mktemp("identity") / "profile"
    done = cli("fit", world.support_dir, "--out", out, "--folds", 2, "--old-model-id", "lexical-v1")
    assert done.returncode == 0, done.stderr
    return out


def _assert_names_every_artifact(message: str, world: World, profile_dir: Path) -> None:
    assert "\n" not in message
    for part in (
        "old encoder 'synthetic-old' (NOBACKFILL_OLD__BACKEND=synthetic-old)",
        f"NOBACKFILL_COMPAT__PROFILE_DIR={profile_dir}",
        f"NOBACKFILL_INDEX__GALLERY_DIR={world.gallery_dir}",
        "where it was made by 'lexical-v1'",  # what the profile says, against the encoder
        "fitted for old model 'lexical-v1' where the gallery was made by 'synthetic-old'",  # profile vs gallery
    ):
        assert part in message, message


async def test_startup_refuses_a_profile_made_for_another_old_model(world: World, other_old_profile: Path) -> None:
    with pytest.raises(ArtifactError) as refused:
        await Pipeline.build(settings_for(world, other_old_profile))
    _assert_names_every_artifact(str(refused.value), world, other_old_profile)


async def test_reload_refuses_it_and_keeps_serving_the_current_profile(world: World, other_old_profile: Path) -> None:
    pipeline = await Pipeline.build(settings_for(world, world.profile_dir))
    try:
        current = pipeline.profile
        with pytest.raises(ArtifactError) as refused:
            await pipeline.reload_profile(other_old_profile)
        assert "NOBACKFILL_INDEX__GALLERY_DIR" in str(refused.value) and "lexical-v1" in str(refused.value)
        assert pipeline.profile is current
        assert (await pipeline.reload_profile(world.profile_dir)).profile_id == current.profile_id
    finally:
        await pipeline.aclose()


def test_synthetic_support_records_the_synthetic_identities(world: World) -> None:
    # The synthetic world writes its own models.json, so its profile names the synthetic encoders.
    meta = json.loads((world.profile_dir / "profile.json").read_text())
    assert (meta["old_model_id"], meta["new_model_id"]) == ("synthetic-old", "synthetic-new")
    assert meta["models"]["old"]["backend"] == "synthetic-old"


IDENTITY = {"backend": "synthetic-old", "model_id": "synthetic-old", "fingerprint": None, "dim": 512}


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ({"new": IDENTITY}, "no 'old' key (the old model's identity: backend, model_id, fingerprint, dim)"),
        ({"old": IDENTITY}, "no 'new' key (the new model's identity: backend, model_id, fingerprint, dim)"),
        ({"old": [IDENTITY], "new": IDENTITY}, "'old' is an array, not an object (the old model's identity)"),
        ({"old": IDENTITY, "new": None}, "'new' is null, not an object (the new model's identity)"),
        ({"old": IDENTITY, "new": "synthetic-new"}, "'new' is a string, not an object (the new model's identity)"),
    ],
)
def test_a_models_json_without_an_identity_block_names_the_key_and_the_file(
    tmp_path: Path, content: dict[str, Any], says: str
) -> None:
    (tmp_path / MODELS_JSON).write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(ArtifactError) as refused:
        read_models_json(tmp_path)
    assert refused.value.message == f"{tmp_path / MODELS_JSON}: {says}"


def test_an_identity_block_without_a_key_names_the_key(tmp_path: Path) -> None:
    block = {key: value for key, value in IDENTITY.items() if key != "dim"}
    (tmp_path / MODELS_JSON).write_text(json.dumps({"old": IDENTITY, "new": block}), encoding="utf-8")
    with pytest.raises(ArtifactError) as refused:
        read_models_json(tmp_path)
    assert refused.value.message == f"{tmp_path / MODELS_JSON} (new): the model identity has no 'dim'"


def test_fit_and_the_traffic_reader_refuse_a_models_json_without_old_in_one_line(world: World, tmp_path: Path) -> None:
    support = tmp_path / "support"
    shutil.copytree(world.support_dir, support)
    models = json.loads((support / MODELS_JSON).read_text(encoding="utf-8"))
    del models["old"]
    (support / MODELS_JSON).write_text(json.dumps(models), encoding="utf-8")
    says = f"{support / MODELS_JSON}: no 'old' key"
    done = cli("fit", support, "--out", tmp_path / "profile", "--folds", 2)
    assert done.returncode == 2 and done.stderr.startswith(f"error: {says}")
    assert done.stderr.count("\n") == 1 and "NoneType" not in done.stderr
    pairs = tmp_path / "pairs"  # an exported traffic folder: the same models.json beside its two files
    pairs.mkdir()
    for name in (MODELS_JSON, "old_query.npy", "new_query.npy"):
        shutil.copy(support / name, pairs / name)
    with pytest.raises(ArtifactError, match=f"^{re.escape(str(pairs / MODELS_JSON))}: no 'old' key"):
        load_query_pairs(pairs)
