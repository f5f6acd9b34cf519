"""The Milvus servers the tests run against (milvus-lite's `server` command, or a real Milvus standalone), and a
user's collection in one."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from tests.support.servers import ServerProcess, free_port


class MilvusLite(ServerProcess):
    """A `milvus-lite server` process on a fixed port that a test may stop, freeze, resume and restart."""

    reloads_after_restart = False  # a restarted milvus-lite holds every collection released
    has_pq_indexes = False

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()

    @property
    def uri(self) -> str:
        """http://127.0.0.1:PORT"""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again) on the same port and data folder; wait until it answers."""
        args = [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(self.data_dir)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--max-workers", "4"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_answering(self.uri, self.process, "milvus-lite", timeout_s=30)


def _wait_answering(uri: str, process: subprocess.Popen[bytes], name: str, timeout_s: float) -> None:
    """Return once a client lists the server's collections; raise if the process exits or the time runs out."""
    import pymilvus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited {process.returncode}")
        try:
            client = pymilvus.MilvusClient(uri=uri, timeout=1)
            client.list_collections()
            client.close()
            return
        except Exception:  # noqa: BLE001 (not up yet: connection refused or not serving)
            time.sleep(0.05)
    raise TimeoutError(f"{name} did not answer at {uri} within {timeout_s:.0f} s")


class MilvusStandalone(ServerProcess):
    """A real Milvus server: the `milvus` wheel's Milvus 2.3.5 standalone (the Go binary with its embedded etcd
    and local storage, the server a docker-compose Milvus runs, minus MinIO), reached by pymilvus over gRPC.

    `make test-milvus-server` runs the Milvus tests against it instead of milvus-lite (NOBACKFILL_TEST_MILVUS).
    Unlike milvus-lite, a restarted server loads again what was loaded before (its state is in etcd).
    """

    reloads_after_restart = True
    has_pq_indexes = True

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        # Its own etcd ports: the embedded etcd's peer port is fixed at 2380 unless a config file says
        # otherwise, and two servers side by side (a test's private one) would share or fight over it.
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()

    @property
    def uri(self) -> str:
        """http://127.0.0.1:PORT"""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again) on the same ports and data folder; wait until it answers (a first start takes ~15 s)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        binaries = _unpacked_milvus_binaries()
        if not (self.data_dir / "bin").exists():
            (self.data_dir / "bin").symlink_to(binaries, target_is_directory=True)
        etcd = self.data_dir / "embed-etcd.yaml"
        etcd.write_text(
            f"listen-client-urls: http://127.0.0.1:{self.etcd_port}\n"
            f"advertise-client-urls: http://127.0.0.1:{self.etcd_port}\n"
            f"listen-peer-urls: http://127.0.0.1:{self.etcd_peer_port}\n"
        )
        args = [str(Path(sys.executable).with_name("milvus-server")), "--data", str(self.data_dir)]
        args += ["--proxy-port", str(self.port), "--etcd-port", str(self.etcd_port)]
        # One start at a time on the machine: the wrapper picks each internal port (root coordinator, nodes,
        # metrics) as the first free one from Milvus's default, so two servers starting at once (two test
        # workers) chose the same and one died.  Once a server answers, its ports are taken.
        with FileLock(Path(tempfile.gettempdir()) / "nobackfill-milvus-start.lock"):
            self.process = subprocess.Popen(
                args,
                env={**os.environ, **self._environment(etcd)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # the wrapper and the binary it starts: stopped, frozen and killed together
            )
            try:
                _wait_answering(self.uri, self.process, "Milvus standalone", timeout_s=120)
            except BaseException:
                self.stop()  # no half-started server left holding its ports and etcd
                raise

    def _environment(self, etcd_config: Path) -> dict[str, str]:
        """Milvus settings that win over the config file the wrapper writes.

        The wrapper checks each port by binding it without SO_REUSEADDR; right after a kill the port still has
        connections in TIME_WAIT, so it would write the next free port, and a restarted server would listen
        where the service is not looking.  Milvus itself binds with SO_REUSEADDR.
        """
        return {
            "PROXY_PORT": str(self.port),
            "ETCD_ENDPOINTS": f"127.0.0.1:{self.etcd_port}",
            "ETCD_CONFIG_PATH": str(etcd_config),
        }

    def stop(self) -> None:
        """Kill the wrapper and the server binary, as an outage would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)  # a paused server cannot die otherwise
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        """Freeze the server: connections still open, nothing answers."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze it."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)


def _unpacked_milvus_binaries() -> Path:
    """The wheel's server binary and libraries, unpacked once per machine (246 MB) and shared by every data folder.

    The wheel unpacks them into each data folder it starts in; a `bin` link to this folder, which holds the
    wheel's checksum files, makes it skip that.  Unpacked beside, then renamed: two workers may race here.
    """
    import milvus

    shared = Path(tempfile.gettempdir()) / f"nobackfill-milvus-{milvus.__version__}-bin"
    if not shared.is_dir():
        scratch = Path(tempfile.mkdtemp(prefix="nobackfill-milvus-"))
        milvus._initialize_data_files(str(scratch))  # the wheel's own unpacking (pinned version)
        try:
            (scratch / "bin").rename(shared)
        except OSError:  # another worker renamed its copy first
            shutil.rmtree(scratch / "bin")
        scratch.rmdir()
    return shared


MilvusServer = MilvusLite | MilvusStandalone
KINDS = ("lite", "standalone")


def _chosen_kind() -> str | None:
    kind = os.environ.get("NOBACKFILL_TEST_MILVUS")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"NOBACKFILL_TEST_MILVUS must be one of {KINDS}, got {kind!r}")
    return kind


def milvus_server(data_dir: Path, kind: str | None = None) -> MilvusServer:
    """A server of `kind`; unnamed, NOBACKFILL_TEST_MILVUS's (`make test-milvus-server`: standalone) or milvus-lite."""
    kind = kind or _chosen_kind() or "lite"
    return MilvusStandalone(data_dir) if kind == "standalone" else MilvusLite(data_dir)


def both_kinds() -> list[Any]:
    """pytest params for a module run on milvus-lite and on a real Milvus (skipped where the `milvus` wheel, x86-64
    Linux only, is not installed); only NOBACKFILL_TEST_MILVUS's kind when it is set."""
    import pytest

    chosen = _chosen_kind()
    if chosen is not None:
        return [chosen]
    missing = importlib.util.find_spec("milvus") is None
    real = pytest.param("standalone", marks=pytest.mark.skipif(missing, reason="no `milvus` wheel: .[milvus-server]"))
    return ["lite", real]


def user_collection(client: Any, name: str, rows: np.ndarray, *, primary: str, field: str, model: str = "") -> None:
    """A collection as a user made it by hand: keys 0..n-1 under `primary`, the old rows under `field`, a title
    per item, a FLAT index by inner product (exact search), loaded; the model's id in nobackfill's property
    when `model` is given."""
    import pymilvus

    schema = pymilvus.MilvusClient.create_schema(auto_id=False)
    schema.add_field(primary, pymilvus.DataType.INT64, is_primary=True)
    schema.add_field(field, pymilvus.DataType.FLOAT_VECTOR, dim=rows.shape[1])
    schema.add_field("title", pymilvus.DataType.VARCHAR, max_length=64)
    properties = {"nobackfill.gallery": json.dumps({"d": rows.shape[1], "old_model_id": model})} if model else {}
    client.create_collection(name, schema=schema, properties=properties)
    client.insert(name, [{primary: i, field: row.tolist(), "title": f"item {i}"} for i, row in enumerate(rows)])
    client.flush(name)
    index = client.prepare_index_params()
    index.add_index(field_name=field, index_type="FLAT", metric_type="IP")
    client.create_index(name, index)
    client.load_collection(name)
