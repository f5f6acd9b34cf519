"""Write the image's pip requirement files from pyproject.toml alone (the Dockerfile's `requirements` stage).

base.txt: the dependencies; models.txt, milvus.txt, pgvector.txt, qdrant.txt, gpu.txt: those extras; base-gpu.txt: base.txt
without faiss-cpu, because faiss-cpu and faiss-gpu both install the `faiss` package and the CUDA image takes
faiss-gpu alone.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def write_requirements(pyproject: Path, out: Path) -> list[Path]:
    """Write the seven files into `out`; return their paths."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    lists = {
        "base.txt": project["dependencies"],
        "models.txt": extras["models"],
        "milvus.txt": extras["milvus"],
        "pgvector.txt": extras["pgvector"],  # psycopg: NOBACKFILL_INDEX__BACKEND=pgvector, `demo --pgvector`
        "qdrant.txt": extras["qdrant"],  # qdrant-client: NOBACKFILL_INDEX__BACKEND=qdrant (docker-compose.qdrant.yml)
        "gpu.txt": extras["gpu"],
        "base-gpu.txt": [req for req in project["dependencies"] if not req.startswith("faiss-cpu")],
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, requirements in lists.items():
        (out / name).write_text("\n".join(requirements) + "\n")
    return [out / name for name in lists]


if __name__ == "__main__":
    write_requirements(Path(sys.argv[1]), Path(sys.argv[2]))
