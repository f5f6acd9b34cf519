"""A real milvus-lite server for the tests (the milvus-lite wheel's `server` command), and a user's collection in it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.servers import ServerProcess, free_port


class MilvusLite(ServerProcess):
    """A `milvus-lite server` process on a fixed port that a test may stop, freeze, resume and restart."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()

    @property
    def uri(self) -> str:
        """http://127.0.0.1:PORT"""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again) on the same port and data folder; wait until it answers."""
        import pymilvus

        args = [sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(self.data_dir)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--max-workers", "4"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"milvus-lite server exited {self.process.returncode}")
            try:
                client = pymilvus.MilvusClient(uri=self.uri, timeout=1)
                client.list_collections()
                client.close()
                return
            except Exception:  # noqa: BLE001 (not up yet: connection refused or not serving)
                time.sleep(0.05)
        raise TimeoutError(f"milvus-lite did not answer on port {self.port}")


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
