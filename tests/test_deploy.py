"""Static checks of the Dockerfile, compose file, Kubernetes manifests and Prometheus config.

No Docker engine runs here, so these check what can be checked: the files parse, every
NOBACKFILL_ variable they set is a real setting, and every path they probe is a real route.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.api.app import create_app
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def load_all(path: Path) -> list[dict[str, Any]]:
    """Every YAML document in a file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def app_paths() -> set[str]:
    """The routes the app serves."""
    return set(create_app(Settings()).openapi()["paths"])


def assert_real_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each NOBACKFILL_ variable must change the settings it names."""
    for name, value in env.items():
        if not name.startswith("NOBACKFILL_"):
            continue
        section, _, key = name.removeprefix("NOBACKFILL_").lower().partition("__")
        assert section in Settings.model_fields, f"{name}: no settings section {section!r}"
        assert key in type(getattr(Settings(), section)).model_fields, f"{name}: no setting {key!r}"
        monkeypatch.setenv(name, value)
    Settings()  # the values parse


def test_compose_services_and_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nobackfill", "redis", "prometheus", "grafana", "locust"} <= set(services)
    assert_real_settings(services["nobackfill"]["environment"], monkeypatch)
    for volume in services["prometheus"]["volumes"]:
        assert (ROOT / volume.split(":")[0]).exists(), volume


def test_kubernetes_manifests(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = {doc["kind"]: doc for doc in load_all(ROOT / "deploy/k8s/nobackfill.yaml")}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= set(docs)
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    plain_env = {item["name"]: item.get("value", "x") for item in container["env"]}
    assert_real_settings({k: v for k, v in plain_env.items() if "REDIS_URL" not in k}, monkeypatch)
    paths = app_paths()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] in paths
    assert docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == docs["Deployment"]["metadata"]["name"]
    selector = docs["Service"]["spec"]["selector"]
    assert selector.items() <= docs["Deployment"]["spec"]["template"]["metadata"]["labels"].items()


def test_prometheus_scrapes_the_metrics_route() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] in app_paths()
    assert job["static_configs"][0]["targets"] == ["nobackfill:8000"]


def test_dockerfile_runs_the_console_script_on_the_default_port(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "Dockerfile").read_text()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    cmd = re.search(r'^CMD \["([^"]+)"', text, re.MULTILINE)
    assert cmd and cmd.group(1) in scripts
    assert f"EXPOSE {Settings().api.port}" in text
    env = dict(re.findall(r"(NOBACKFILL_\w+)=(\S+)", text))
    assert env
    assert_real_settings(env, monkeypatch)
