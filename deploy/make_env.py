"""Write a secrets file from its example, every CHANGE-ME replaced by a fresh random value; never overwrite.

    python3 deploy/make_env.py deploy/compose.env.example .env                            (make deploy-env)
    python3 deploy/make_env.py deploy/k8s/base/secret.env.example deploy/k8s/base/secret.env  (make k8s-secret)

Values are hex (URL-safe: the Redis password goes into a redis:// URL).  Standard library only, so it
runs with any python3, before any virtualenv exists.  Exit 2 with one line when the target exists.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

PLACEHOLDER = "CHANGE-ME"


def fill(example: str) -> str:
    """The example's text with each placeholder (outside comments) replaced by its own 32-hex-digit secret."""
    lines = []
    for line in example.splitlines():
        while PLACEHOLDER in line and not line.lstrip().startswith("#"):
            line = line.replace(PLACEHOLDER, secrets.token_hex(16), 1)
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """Write argv[1] from argv[0]; 0 when written, 2 when the target exists or the example is missing."""
    if len(argv) != 2:
        print("usage: make_env.py EXAMPLE TARGET", file=sys.stderr)
        return 2
    example, target = Path(argv[0]), Path(argv[1])
    if target.exists():
        print(f"{target} exists; left as it is (delete it to make new secrets)", file=sys.stderr)
        return 2
    if not example.is_file():
        print(f"{example} does not exist", file=sys.stderr)
        return 2
    # Created owner-only before anything is written into it: the file holds secrets.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(fill(example.read_text()))
    print(f"wrote {target} (random secrets, mode 600)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
