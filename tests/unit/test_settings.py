"""Settings that can never work are refused when Settings() is built, in one line naming the variables.

Env vars and the YAML file (NOBACKFILL_CONFIG_FILE) go through the same checks: a key no section has,
a section that does not exist, a value of the wrong type, and combinations that contradict each other.
That `nobackfill serve` refuses them before anything starts: tests/integration/test_serve_refusal.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.errors import InputError, SettingsError
from service.settings import ApiSettings, EncoderSettings, IndexSettings, Settings, TrafficSettings


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NOBACKFILL_ setting of the test runner's own environment leaks into these tests."""
    for name in list(os.environ):
        if (name.upper().startswith("NOBACKFILL_") and "__" in name) or name == "NOBACKFILL_CONFIG_FILE":
            monkeypatch.delenv(name)


def refusal(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    """The one-line message of the SettingsError that Settings() raises under `env`."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as raised:
        Settings()
    message = raised.value.message
    assert "\n" not in message and message == str(raised.value)
    return message


def test_settings_errors_are_input_errors_of_the_tree() -> None:
    assert issubclass(SettingsError, InputError)
    assert SettingsError("x").code == "bad_settings"


def test_a_mistyped_key_inside_a_section_is_refused_with_the_right_name(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(monkeypatch, NOBACKFILL_INDEX__GALERY_DIR="x")
    assert "NOBACKFILL_INDEX__GALERY_DIR (index.galery_dir) is no setting" in message
    assert "did you mean NOBACKFILL_INDEX__GALLERY_DIR?" in message


def test_a_mistyped_secret_is_refused_without_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(monkeypatch, NOBACKFILL_API__APIKEY="hunter2-secret")
    assert "NOBACKFILL_API__APIKEY" in message and "NOBACKFILL_API__API_KEY" in message
    assert "hunter2" not in message


def test_a_mistyped_section_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(monkeypatch, NOBACKFILL_INDX__NPROBE="3")
    assert "NOBACKFILL_INDX__NPROBE names no settings section 'indx'" in message
    assert "did you mean NOBACKFILL_INDEX__NPROBE?" in message


def test_project_variables_that_are_no_settings_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # The test suite's, the deploy check's, the fuzzer's, locust's and compose's own variables.
    for name in (
        "NOBACKFILL_TEST_REDIS_URL",
        "NOBACKFILL_DEPLOY_CHECK",
        "NOBACKFILL_FUZZ_SEED",
        "NOBACKFILL_FUZZ_EXAMPLES",
        "NOBACKFILL_API_KEY",
        "NOBACKFILL_PORT",
        "NOBACKFILL_GPU_0",
        "NOBACKFILL_TEST_WORLD",
    ):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("NOBACKFILL_INDEX__NPROBE", "9")
    assert Settings().index.nprobe == 9


def test_a_value_of_the_wrong_type_names_the_variable_and_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(monkeypatch, NOBACKFILL_INDEX__NPROBE="sixteen")
    assert message.startswith("invalid settings: NOBACKFILL_INDEX__NPROBE (index.nprobe)='sixteen': ")
    assert "valid integer" in message


def test_an_unknown_default_mode_lists_the_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(monkeypatch, NOBACKFILL_COMPAT__DEFAULT_MODE="slurp")
    assert "NOBACKFILL_COMPAT__DEFAULT_MODE (compat.default_mode)='slurp'" in message
    assert "'slerp'" in message and "'adapter+slerp'" in message


def test_redis_traffic_store_without_a_url_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(monkeypatch, NOBACKFILL_TRAFFIC__STORE="redis")
    assert "NOBACKFILL_TRAFFIC__STORE=redis needs a Redis URL" in message
    assert "NOBACKFILL_TRAFFIC__REDIS_URL" in message and "NOBACKFILL_CACHE__REDIS_URL" in message
    monkeypatch.setenv("NOBACKFILL_CACHE__REDIS_URL", "redis://127.0.0.1:6379/15")
    assert Settings().traffic.store == "redis"  # the cache's URL serves the store too


def test_milvus_without_uri_or_collection_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(monkeypatch, NOBACKFILL_INDEX__BACKEND="milvus")
    assert "NOBACKFILL_INDEX__BACKEND=milvus needs NOBACKFILL_INDEX__MILVUS_URI" in message
    assert "NOBACKFILL_INDEX__MILVUS_COLLECTION" in message
    message = refusal(monkeypatch, NOBACKFILL_INDEX__MILVUS_URI="http://milvus:19530")
    assert "NOBACKFILL_INDEX__MILVUS_URI" not in message and "NOBACKFILL_INDEX__MILVUS_COLLECTION" in message
    monkeypatch.setenv("NOBACKFILL_INDEX__MILVUS_COLLECTION", "gallery_v1")
    assert Settings().index.milvus_collection == "gallery_v1"


@pytest.mark.parametrize("role", ["old", "new"])
def test_an_external_encoder_without_dim_is_refused(monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    prefix = f"NOBACKFILL_{role.upper()}__"
    monkeypatch.setenv(prefix + "MODEL_ID", "my-classifier")
    message = refusal(monkeypatch, **{prefix + "BACKEND": "external"})
    assert f"{prefix}BACKEND=external needs {prefix}DIM " in message
    monkeypatch.setenv(prefix + "DIM", "10")
    assert getattr(Settings(), role).dim == 10


@pytest.mark.parametrize(("role", "backend"), [("old", "sentence-transformers"), ("new", "clip")])
def test_a_model_folder_backend_without_a_path_names_the_path_variable(
    monkeypatch: pytest.MonkeyPatch, role: str, backend: str
) -> None:
    prefix = f"NOBACKFILL_{role.upper()}__"
    message = refusal(monkeypatch, **{prefix + "BACKEND": backend})
    assert f"{prefix}BACKEND={backend} needs {prefix}PATH (its local model folder)" in message
    monkeypatch.setenv(prefix + "PATH", "/models/mine")
    assert getattr(Settings(), role).path == "/models/mine"


def test_a_setting_of_the_wrong_type_is_one_line_naming_variable_value_and_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    message = refusal(monkeypatch, NOBACKFILL_INDEX__NPROBE="abc")
    assert message == (
        "invalid settings: NOBACKFILL_INDEX__NPROBE (index.nprobe)='abc': input should be a valid integer, "
        "unable to parse string as an integer"
    )


def test_more_queries_per_request_than_may_be_in_flight_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refusal(monkeypatch, NOBACKFILL_API__MAX_IN_FLIGHT="8")
    assert "NOBACKFILL_API__MAX_QUERIES=64 is over NOBACKFILL_API__MAX_IN_FLIGHT=8" in message
    monkeypatch.setenv("NOBACKFILL_API__MAX_QUERIES", "8")
    assert Settings().api.max_queries == 8


def test_every_contradiction_is_named_in_the_one_line() -> None:
    with pytest.raises(SettingsError) as raised:
        Settings(
            new=EncoderSettings(backend="external", model_id="m"),
            index=IndexSettings(backend="milvus", milvus_uri="x.db", milvus_collection="c"),
            traffic=TrafficSettings(store="redis"),
            api=ApiSettings(max_in_flight=4),
        )
    message = raised.value.message
    assert "\n" not in message and message.count("; ") == 2
    assert "NOBACKFILL_NEW__DIM" in message and "NOBACKFILL_TRAFFIC__STORE" in message
    assert "NOBACKFILL_API__MAX_IN_FLIGHT=4" in message and "MILVUS" not in message


def test_settings_built_from_kwargs_still_work() -> None:
    settings = Settings(api={"max_in_flight": 8, "max_queries": 8}, index=IndexSettings(nprobe=4))
    assert settings.api.max_in_flight == 8 and settings.index.nprobe == 4


def test_the_yaml_file_refuses_a_typo_inside_a_section_and_a_section(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "nobackfill.yaml"
    config.write_text("index:\n  nprobe: 4\n  galery_dir: /srv/gallery\n")
    message = refusal(monkeypatch, NOBACKFILL_CONFIG_FILE=str(config))
    assert "NOBACKFILL_INDEX__GALERY_DIR (index.galery_dir) is no setting" in message
    config.write_text("indx:\n  nprobe: 4\n")
    message = refusal(monkeypatch)
    assert "NOBACKFILL_INDX (indx) is no settings section; did you mean NOBACKFILL_INDEX?" in message
    config.write_text("index:\n  nprobe: 4\n")
    assert Settings().index.nprobe == 4


def test_the_yaml_file_missing_or_malformed_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "absent.yaml"
    message = refusal(monkeypatch, NOBACKFILL_CONFIG_FILE=str(missing))
    assert message == f"NOBACKFILL_CONFIG_FILE={missing}: no such file (expected a YAML settings file)"
    broken = tmp_path / "broken.yaml"
    broken.write_text("index:\n  nprobe: [4\n")
    message = refusal(monkeypatch, NOBACKFILL_CONFIG_FILE=str(broken))
    assert message.startswith(f"NOBACKFILL_CONFIG_FILE={broken} is not valid YAML: ") and "line 2" in message
