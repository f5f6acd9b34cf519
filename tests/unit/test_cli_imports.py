"""The CLI answers --help and argument errors without loading the model libraries (issue 48: 2 s -> under 0.5 s).

Timed with `/usr/bin/time` in docs/benchmarks.md; here the cause is checked, not a clock: which heavy
modules `import service.cli` pulls in.
"""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "faiss", "transformers", "sentence_transformers", "sklearn", "scipy")


def test_importing_the_cli_loads_no_model_library() -> None:
    probe = f"import sys, service.cli; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
