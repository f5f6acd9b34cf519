"""`nobackfill serve` (uvicorn) and `nobackfill demo` (build a small synthetic world, serve it with the /ui page)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import typer

from service.commands.invocation import cli_invocation
from service.configured_paths import refuse_missing
from service.settings import CompatSettings, IndexSettings, Settings, env_name

# Same string as service.metrics.MULTIPROC_ENV: importing that module here would load prometheus-client
# in the supervisor, which then writes its own metric files into the folder (or fails before it exists).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

DEMO_DIR = Path("artifacts/demo")
DEMO_GALLERY_SIZE = 50_000
DEMO_SUPPORT_SIZE = 10_000
# The eval the operator page shows: captions of 500 of the first 5,000 items, ~10 s once (a test split's
# targets are its own, not the gallery: more of them would only cost time).
DEMO_TEST_SIZE = 500
DEMO_TEST_TARGETS = 5_000

CURL_EXAMPLE = """\
curl -s http://{host}:{port}/v1/search -H 'content-type: application/json' \\
  -d '{{"queries": [{{"text": "item-0000000042 caption-1"}}], "k": 5, "debug": true}}'"""
UI_LINE = "or open the operator page (old and new answers side by side): http://{host}:{port}/ui/"


# The docstring is `serve --help`: typer keeps its line breaks, so its lines stay under 78 characters.
def serve(
    host: str | None = typer.Option(None, help="Bind address (default: settings api.host)."),
    port: int | None = typer.Option(None, help="Port (default: settings api.port)."),
    workers: int | None = typer.Option(None, help="Worker processes (default: settings api.workers)."),
) -> None:
    """Run the HTTP service with the configured encoders, gallery and profile.

    Everything else is a NOBACKFILL_* setting: an environment variable, or a key
    of the YAML file named by NOBACKFILL_CONFIG_FILE.  `nobackfill settings`
    lists every one with its type and default (the same: docs/settings.md).

    The migration's settings:
    NOBACKFILL_INDEX__SEGMENT_DIR=SEGMENT   hybrid: the backfilled segment too
    NOBACKFILL_INDEX__ITEM_STORE=ITEMS      the re-rank cascade (hybrid re-ranks)
    NOBACKFILL_OLD__BACKEND=none            the cut-over: the new model alone
    """
    settings = Settings()
    refuse_missing(settings)  # one `error:` line and exit 2, before uvicorn or any model starts
    _run(settings, host or settings.api.host, port or settings.api.port, workers or settings.api.workers)


def _run(settings: Settings, host: str, port: int, workers: int) -> None:
    """Start uvicorn; several workers each build their own app from the environment."""
    import uvicorn

    if workers > 1:
        created = _multiprocess_metrics_dir()
        try:
            uvicorn.run(
                "service.api.app:create_app",
                factory=True,
                host=host,
                port=port,
                workers=workers,
                access_log=False,  # the app writes its own access line, with the request id
                timeout_graceful_shutdown=settings.api.shutdown_grace_s,
            )
        finally:
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
        return
    from service.api.app import create_app

    # access_log: the app writes its own access line, with the request id (api.access_log).
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        access_log=False,
        # On SIGTERM uvicorn stops accepting, answers what it holds, and gives up after this long.
        timeout_graceful_shutdown=settings.api.shutdown_grace_s,
    )


def _multiprocess_metrics_dir() -> Path | None:
    """Point the workers' metrics at a clean folder: PROMETHEUS_MULTIPROC_DIR, or a new temporary one.

    Returns the folder when it was created here (to remove on exit).  Set before any worker starts:
    each worker is a fresh interpreter whose prometheus-client reads it at import.
    """
    given = os.environ.get(MULTIPROC_ENV)
    folder = Path(given) if given else Path(tempfile.mkdtemp(prefix="nobackfill-metrics-"))
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):  # samples of an earlier run would be added to this one's
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(folder)
    return None if given else folder


def _cli(*args: str) -> None:
    """Run one `nobackfill` subcommand as a user would, stopping the demo if it fails."""
    done = subprocess.run([sys.executable, "-m", "service.cli", *args], check=False)
    if done.returncode != 0:
        raise typer.Exit(done.returncode)


@dataclass(frozen=True)
class DemoArtifacts:
    """What the synthetic demo serves, each built if missing (`demo --prepare-only` builds them and stops)."""

    gallery: Path
    profile: Path
    items: Path
    saved_eval: Path


def demo(
    # None, not 8000: a typer default would always win over NOBACKFILL_API__PORT (`make demo PORT=...` passes --port).
    port: int | None = typer.Option(None, help="Port for the demo service (default: settings api.port, 8000)."),
    gallery_size: int = typer.Option(DEMO_GALLERY_SIZE, help="Items in the demo gallery (synthetic world)."),
    prepare_only: bool = typer.Option(False, help="Build the artifacts, then exit without serving."),
    real: bool = typer.Option(
        False, "--real", help="Real models and data instead: static model2vec -> MiniLM on docstring pairs."
    ),
    pgvector: bool = typer.Option(
        False, "--pgvector", help="Serve the demo gallery from a PostgreSQL + pgvector table (embedded, or the DSN's)."
    ),
) -> None:
    """Build a small synthetic gallery and profile if missing (or, with --real, a real upgrade), then serve."""
    if real:
        _real_demo(port, prepare_only)
        return
    artifacts = _prepare_demo(gallery_size)
    if pgvector:
        _pgvector_demo(artifacts, port, prepare_only)
        return
    if prepare_only:
        typer.echo(f"the demo's artifacts are ready in {DEMO_DIR}/: `make serve` serves them (or `nobackfill demo`)")
        return
    settings = Settings(
        index=IndexSettings(gallery_dir=artifacts.gallery, item_store=artifacts.items),
        compat=CompatSettings(profile_dir=artifacts.profile),
    )
    _serve_demo(settings, artifacts, port)


def _prepare_demo(gallery_size: int) -> DemoArtifacts:
    """The synthetic world's gallery, profile, saved eval and item store under DEMO_DIR, each built unless found."""
    gallery_dir, profile_dir, support_dir = DEMO_DIR / "gallery", DEMO_DIR / "profile", DEMO_DIR / "support"
    if not (gallery_dir / "gallery.json").exists():
        typer.echo(f"building a {gallery_size:,}-item synthetic gallery in {gallery_dir}")
        _cli("gallery", "build", "--size", str(gallery_size), "--out", str(gallery_dir), "--force")
    else:
        _found("gallery", gallery_dir)
    fitted = not (profile_dir / "profile.json").exists()
    if fitted:
        if not (support_dir / "old_query.npy").exists():
            _cli("synth", "support", "--n", str(DEMO_SUPPORT_SIZE), "--out", str(support_dir))
        _cli("fit", str(support_dir), "--out", str(profile_dir), "--force")
    else:
        _found("profile", profile_dir)
    saved_eval = _demo_eval(profile_dir, again=fitted)
    items_dir = DEMO_DIR / "items"
    if not (items_dir / "items.json").exists():  # the operator page shows the items' texts from it
        ntotal = json.loads((gallery_dir / "gallery.json").read_text())["ntotal"]
        _cli("synth", "items", "--size", str(ntotal), "--out", str(items_dir), "--force")
    else:
        _found("item store", items_dir)
    return DemoArtifacts(gallery_dir, profile_dir, items_dir, saved_eval)


def _serve_demo(settings: Settings, artifacts: DemoArtifacts, given_port: int | None) -> None:
    """Serve the demo's settings with the operator page on 127.0.0.1, after the lines that say how to try it."""
    settings = _with_ui(settings, ui_eval=artifacts.saved_eval)
    port = _demo_port(given_port, settings)
    cache = settings.cache.redis_url or "in-process LRU (set NOBACKFILL_CACHE__REDIS_URL for Redis)"
    typer.echo(f"serving on http://127.0.0.1:{port} (cache: {cache}); try:")
    typer.echo(CURL_EXAMPLE.format(host="127.0.0.1", port=port))
    typer.echo(UI_LINE.format(host="127.0.0.1", port=port))
    _run(settings, "127.0.0.1", port, 1)


def pgvector_serve_settings(settings: Settings) -> str:
    """The settings, as NOBACKFILL_* variables to paste, under which `nobackfill serve` serves what the pgvector
    demo serves (its table, profile and item store)."""
    index = settings.index
    dsn = index.pgvector_dsn.get_secret_value() if index.pgvector_dsn else ""
    return (f"NOBACKFILL_INDEX__BACKEND=pgvector NOBACKFILL_INDEX__PGVECTOR_TABLE={index.pgvector_table} "
            f"NOBACKFILL_INDEX__PGVECTOR_DSN='{dsn}' NOBACKFILL_COMPAT__PROFILE_DIR={settings.compat.profile_dir} "
            f"NOBACKFILL_INDEX__ITEM_STORE={index.item_store}")  # fmt: skip


def _pgvector_demo(artifacts: DemoArtifacts, given_port: int | None, prepare_only: bool) -> None:
    """`demo --pgvector`: the gallery's old rows in a PostgreSQL table (pgvector_demo.py), served from there.

    NOBACKFILL_INDEX__PGVECTOR_DSN, when set, names the PostgreSQL to load (the compose override's);
    otherwise an embedded one runs in DEMO_DIR/pgvector for as long as the demo does.
    """
    from service.commands.pgvector_demo import DEMO_TABLE, demo_database, load_demo_table, sigterm_unwinds

    given_dsn = Settings().index.pgvector_dsn
    try:
        with sigterm_unwinds(), ExitStack() as stack:
            if given_dsn is not None:
                dsn = given_dsn.get_secret_value()
                typer.echo(f"the demo table goes into the PostgreSQL of {env_name('index', 'pgvector_dsn')}")
            else:
                typer.echo(f"starting the demo's PostgreSQL (embedded, with pgvector) in {DEMO_DIR / 'pgvector'}")
                dsn = stack.enter_context(demo_database(DEMO_DIR / "pgvector"))
            typer.echo(load_demo_table(dsn, artifacts.gallery, log=typer.echo).line())
            if prepare_only:
                typer.echo(f"the demo's table {DEMO_TABLE} is ready: `make demo-pgvector` serves it")
                return
            index = IndexSettings(backend="pgvector", pgvector_dsn=dsn, pgvector_table=DEMO_TABLE,
                                  item_store=artifacts.items)  # fmt: skip
            settings = Settings(index=index, compat=CompatSettings(profile_dir=artifacts.profile))
            if given_dsn is None:  # a socket path and no password: nothing secret to print
                typer.echo(f"the gallery is that table; while the demo runs, `{cli_invocation()} serve` serves it with "
                           f"{pgvector_serve_settings(settings)} (and another NOBACKFILL_API__PORT)")  # fmt: skip
            _serve_demo(settings, artifacts, given_port)
    except KeyboardInterrupt:  # Ctrl-C while loading (uvicorn takes it over once it serves)
        typer.echo("interrupted" + ("" if given_dsn else "; the demo's PostgreSQL is stopped"), err=True)
        raise typer.Exit(130) from None


def _demo_port(given: int | None, settings: Settings) -> int:
    """--port when given, else the settings' api.port (NOBACKFILL_API__PORT, a YAML file, or 8000)."""
    return given if given is not None else settings.api.port


def _found(what: str, folder: Path) -> None:
    """Say that an artifact the demo would build is already there (delete the folder to rebuild it)."""
    typer.echo(f"found the demo's {what} in {folder} (delete it to rebuild)")


def _demo_eval(profile_dir: Path, again: bool) -> Path:
    """The demo profile's eval on a synthetic test split, saved for the operator page (again after a new fit)."""
    test_dir, saved = DEMO_DIR / "test", DEMO_DIR / "eval.json"
    if again or not saved.exists():
        if not (test_dir / "old_query.npy").exists():
            _cli("synth", "test", "--n", str(DEMO_TEST_SIZE), "--gallery-size", str(DEMO_TEST_TARGETS),
                 "--out", str(test_dir), "--force")  # fmt: skip
        _cli("eval", str(profile_dir), str(test_dir), "--json-out", str(saved))
    else:
        _found("saved eval", saved)
    return saved


def _with_ui(settings: Settings, ui_eval: Path | None = None) -> Settings:
    """The same settings with the operator page on (the demos always show it; `serve` only with NOBACKFILL_API__UI)."""
    given = {"ui_eval": ui_eval} if ui_eval is not None else {}  # else NOBACKFILL_API__UI_EVAL's, if any
    return settings.model_copy(update={"api": settings.api.model_copy(update={"ui": True, **given})})


def _real_demo(given_port: int | None, prepare_only: bool) -> None:
    """`demo --real`: build the real upgrade's artifacts if missing (real_demo.py), then serve them."""
    from service.commands.real_demo import REAL_DIR, RealDeployment, curl_example, prepare

    deployment = RealDeployment(REAL_DIR)
    prepare(deployment, _cli)
    if prepare_only:
        return
    settings = _with_ui(deployment.settings(), deployment.saved_eval)
    port = _demo_port(given_port, settings)
    typer.echo(f"serving the real upgrade on http://127.0.0.1:{port}; the same with `{cli_invocation()} serve`:")
    typer.echo(deployment.environment())
    typer.echo("ask it a real question (the texts of the hits come from the corpus):")
    typer.echo(curl_example(deployment, "127.0.0.1", port))
    typer.echo(UI_LINE.format(host="127.0.0.1", port=port))
    typer.echo(deployment.onnx_hint())
    _run(settings, "127.0.0.1", port, 1)
