"""Model identity end to end: encoders, profile and gallery that disagree are refused at startup and reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import World, cli

from service.errors import ArtifactError
from service.pipeline import Pipeline
from service.settings import CompatSettings, IndexSettings, Settings


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
