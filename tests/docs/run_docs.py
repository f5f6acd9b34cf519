"""Run the shell blocks of README.md and docs/real-models.md from a fresh clone, as a newcomer pasting them would.

Every ```bash block of a checked document carries a mark on the line above it:

    <!-- docs: run -->              every command of the block runs, in order, as one bash script
    <!-- docs: skip: REASON -->     nothing runs; the reason is printed
    <!-- docs: run; serve "make demo" until http://127.0.0.1:8000/readyz; skip "make test": REASON -->
    <!-- docs: run; stop the server -->    the server an earlier block started is stopped before this one runs

`serve "PREFIX" ... until URL`: a command that starts with PREFIX is a server, which never returns: it
runs in the background, the block goes on once URL answers 200, and it is stopped (its whole process
group) before the next server starts, before a block marked `stop the server` (a newcomer's Ctrl-C: a
block that starts what it needs unless something already answers), and at the end of its document.
`skip "PREFIX" ...: REASON`: a command that starts with PREFIX is not run.  A command is a line with its
`\\` continuation lines.

Each document starts in a shell of its own, at the clone's root, with no virtualenv active: exported
variables carry from one block to the next, as in one terminal.  curl runs with --fail (a .curlrc),
so an HTTP error fails its block.  The first block that fails stops its document and prints
its log's tail.  Standard library only: the clone builds its own .venv, as the README tells a newcomer.

    python3 tests/docs/run_docs.py [--only README.md] [--in CHECKOUT] [--keep]     (make test-docs)
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/real-models.md")
SHELL_FENCES = {"bash", "sh", "shell"}
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARK = re.compile(r"^\s*<!--\s*docs:\s*(.*?)\s*-->\s*$")
SERVE_RULE = re.compile(r'^serve\s+((?:"[^"]+"\s*)+)until\s+(http://127\.0\.0\.1:\d+/\S*)$')
STOP_RULE = "stop the server"
SKIP_RULE = re.compile(r'^skip\s+((?:"[^"]+"\s*)+):\s*(\S.*)$')
BLOCK_TIMEOUT_S = float(os.environ.get("DOCS_BLOCK_TIMEOUT_S", "2400"))
READY_TIMEOUT_S = float(os.environ.get("DOCS_READY_TIMEOUT_S", "1200"))
LOG_TAIL_LINES = 40


class MarkError(ValueError):
    """A shell block without a mark, or a mark that does not parse (FILE:LINE and what is wrong)."""


@dataclass(frozen=True)
class Rule:
    """What to do with the commands of a block that start with one of `prefixes`."""

    kind: str  # "serve", "skip" or "stop" (the earlier block's server, before this block: no prefixes)
    prefixes: tuple[str, ...]
    until: str = ""  # serve: the URL that answers 200 once it is up
    reason: str = ""  # skip: why it is not run

    def matches(self, command: str) -> bool:
        """True when `command` starts with one of the prefixes, as whole words."""
        text = command.lstrip()
        return any(text == p or (text.startswith(p) and text[len(p)].isspace()) for p in self.prefixes)


@dataclass
class Block:
    """One fenced shell block and its mark."""

    path: str
    line: int  # of the opening fence, 1-based
    text: str  # dedented
    run: bool
    reason: str = ""  # why a skipped block is not run
    rules: list[Rule] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse_mark(mark: str, where: str) -> tuple[bool, str, list[Rule]]:
    """(runs, reason when skipped, rules) of a mark's text, e.g. `run; skip "make test": CI runs it`."""
    first, *rest = [clause.strip() for clause in mark.split(";")]
    if first.startswith("skip:") and not rest:
        reason = first.removeprefix("skip:").strip()
        if not reason:
            raise MarkError(f"{where}: `docs: skip:` needs a reason")
        return False, reason, []
    if first != "run":
        raise MarkError(f"{where}: a mark starts with `run` or `skip: REASON`, not {first!r}")
    rules = []
    for clause in rest:
        if clause == STOP_RULE:
            rules.append(Rule("stop", ()))
        elif served := SERVE_RULE.match(clause):
            rules.append(Rule("serve", _quoted(served.group(1)), until=served.group(2)))
        elif skipped := SKIP_RULE.match(clause):
            rules.append(Rule("skip", _quoted(skipped.group(1)), reason=skipped.group(2)))
        else:
            raise MarkError(
                f'{where}: {clause!r} is neither `serve "PREFIX" until http://127.0.0.1:PORT/PATH`, '
                f'`skip "PREFIX": REASON` nor `{STOP_RULE}`'
            )
    return True, "", rules


def _quoted(text: str) -> tuple[str, ...]:
    """The double-quoted prefixes of a rule, in order."""
    return tuple(re.findall(r'"([^"]+)"', text))


def _slug(path: str) -> str:
    """A document's path as one file-name part (logs, state folders)."""
    return path.replace("/", "_")


def blocks(path: str, text: str) -> list[Block]:
    """The shell blocks of a Markdown text, each with its parsed mark; MarkError for one unmarked."""
    lines = text.splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        language = opening.group(2)
        end = next((j for j in range(index + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise MarkError(f"{path}:{index + 1}: a fence that is never closed")
        if language in SHELL_FENCES:
            where = f"{path}:{index + 1}"
            mark = MARK.match(lines[index - 1]) if index > 0 else None
            if mark is None:
                raise MarkError(f"{where}: a {language} block without a `<!-- docs: ... -->` mark on the line above")
            run, reason, rules = parse_mark(mark.group(1), where)
            body = textwrap.dedent("\n".join(lines[index + 1 : end]))
            for rule in rules:
                if rule.prefixes and not any(rule.matches(command) for command in commands(body)):
                    raise MarkError(f"{where}: no command of the block starts with {' or '.join(rule.prefixes)!r}")
            found.append(Block(path, index + 1, body, run, reason, rules))
        index = end + 1
    return found


def commands(text: str) -> list[str]:
    """The block's lines grouped into commands: a line ending in a backslash continues on the next."""
    grouped: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        current.append(line)
        if not line.rstrip().endswith("\\"):
            grouped.append("\n".join(current))
            current = []
    if current:
        grouped.append("\n".join(current))
    return grouped


def script(block: Block, number: int) -> str:
    """The bash script that runs a block: servers in the background, skipped commands echoed."""
    parts = [
        'source "$DOCS_STATE/prelude.sh"',
        f"# {block.where}",
    ]
    if any(rule.kind == "stop" for rule in block.rules):
        parts.append("docs_stop_server")
    for index, command in enumerate(commands(block.text)):
        rule = next((rule for rule in block.rules if rule.matches(command)), None)
        if rule is None:
            parts.append(command)
        elif rule.kind == "skip":
            parts.append(f"echo {shlex.quote(f'docs: not run ({rule.reason}): {command.strip()}')}")
        else:
            log = f"$DOCS_LOGS/{_slug(block.path)}-{number:02d}-serve-{index}.log"
            parts += [
                f"docs_before_serve {shlex.quote(rule.until)}",
                "set -m  # the server gets a process group of its own, stopped as one",
                f'{{\n{command}\n}} > "{log}" 2>&1 &',
                "set +m",
                f'docs_wait_ready {shlex.quote(rule.until)} $! "{log}"',
            ]
    parts.append("docs_save_env")
    return "\n".join(parts) + "\n"


PRELUDE = r"""
set -eo pipefail
cd "$DOCS_ROOT"
[ -f "$DOCS_STATE/env.sh" ] && source "$DOCS_STATE/env.sh"

docs_stop_server() {
  [ -f "$DOCS_STATE/server.pid" ] || return 0
  local pid; pid=$(cat "$DOCS_STATE/server.pid"); rm -f "$DOCS_STATE/server.pid"
  kill -TERM -- "-$pid" 2>/dev/null || return 0
  for _ in $(seq 120); do kill -0 -- "-$pid" 2>/dev/null || return 0; sleep 0.5; done
  echo "docs: the server (process group $pid) outlived SIGTERM by 60 s; killing it" >&2
  kill -KILL -- "-$pid" 2>/dev/null || true
}

docs_before_serve() {
  docs_stop_server
  if [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1")" != 000 ]; then
    echo "docs: something already answers $1; stop it first" >&2; return 1
  fi
}

docs_wait_ready() {
  local url=$1 pid=$2 log=$3 start=$SECONDS
  echo "$pid" > "$DOCS_STATE/server.pid"
  until [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url")" = 200 ]; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "docs: the server exited before $url answered; its log ends:" >&2; tail -n 30 "$log" >&2; return 1
    fi
    if (( SECONDS - start > DOCS_READY_TIMEOUT_S )); then
      echo "docs: $url did not answer 200 within $DOCS_READY_TIMEOUT_S s" >&2; tail -n 30 "$log" >&2; return 1
    fi
    sleep 1
  done
  echo "docs: serving ($url answered after $(( SECONDS - start )) s; log $log)"
}

docs_save_env() {
  export -p | grep -v -E '^declare -x (PWD|OLDPWD|SHLVL|_)=' > "$DOCS_STATE/env.sh"
}
"""


def newcomer_env(state: Path, root: Path, logs: Path) -> dict[str, str]:
    """This process's environment without an active virtualenv or NOBACKFILL_* settings, plus the runner's own."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("NOBACKFILL_", "DOCS_"))}
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(key, None)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in p + "/")
    curl_home = state / "curl"
    curl_home.mkdir(exist_ok=True)
    (curl_home / ".curlrc").write_text("fail\n")  # as -f: a script's own -f or -sf stays valid
    env.update(
        CURL_HOME=str(curl_home),
        DOCS_ROOT=str(root),
        DOCS_STATE=str(state),
        DOCS_LOGS=str(logs),
        DOCS_READY_TIMEOUT_S=str(int(READY_TIMEOUT_S)),
    )
    return env


def stop_server(env: dict[str, str]) -> None:
    """Stop the document's server, if one runs."""
    subprocess.run(
        ["bash", "-c", 'source "$DOCS_STATE/prelude.sh"; docs_stop_server'], env=env, cwd=env["DOCS_ROOT"], check=False
    )


def run_document(path: str, root: Path, work: Path) -> bool:
    """Run every marked block of one document in order; False at the first that fails."""
    state = work / "state" / _slug(path)
    logs = work / "logs"
    if state.exists():
        shutil.rmtree(state)
    state.mkdir(parents=True)
    logs.mkdir(exist_ok=True)
    env = newcomer_env(state, root, logs)
    (state / "prelude.sh").write_text(PRELUDE)
    print(f"== {path}", flush=True)
    try:
        for number, block in enumerate(blocks(path, (root / path).read_text()), start=1):
            if not block.run:
                print(f"   {block.where:28} skipped  ({block.reason})", flush=True)
                continue
            script_path = state / f"{number:02d}.sh"
            script_path.write_text(script(block, number))
            log = logs / f"{_slug(path)}-{number:02d}-line{block.line}.log"
            started = time.monotonic()
            with log.open("w") as out:
                process = subprocess.Popen(
                    ["bash", str(script_path)],
                    cwd=root,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    code = process.wait(BLOCK_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    code = process.wait()
                    out.write(f"\ndocs: the block ran past {BLOCK_TIMEOUT_S:g} s and was killed\n")
            took = time.monotonic() - started
            verdict = "ok" if code == 0 else f"FAILED (exit {code})"
            print(f"   {block.where:28} {verdict:8} {took:7.1f} s   log {log}", flush=True)
            if code != 0:
                tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                print(textwrap.indent("\n".join(tail), "   | "), flush=True)
                return False
        return True
    finally:
        stop_server(env)


def fresh_clone(work: Path) -> Path:
    """A clone of this repo's HEAD (what is committed: uncommitted changes are not in it)."""
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True)
    if dirty.stdout.strip():
        print("note: the working tree has uncommitted changes; the clone holds HEAD only", file=sys.stderr)
    clone = work / "nobackfill"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    return clone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=DOCUMENTS, help="run this document only (repeatable)")
    parser.add_argument("--in", dest="checkout", type=Path, help="run in this checkout instead of a fresh clone")
    parser.add_argument("--keep", action="store_true", help="keep the clone and the logs")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="nobackfill-docs-"))
    root = args.checkout.resolve() if args.checkout else fresh_clone(work)
    print(f"running the docs' blocks in {root} (logs in {work / 'logs'})", flush=True)
    started = time.monotonic()
    results = [run_document(path, root, work) for path in (args.only or DOCUMENTS)]  # each, whatever the others did
    passed = all(results)
    print(f"{'every block ran' if passed else 'FAILED'} in {(time.monotonic() - started) / 60:.1f} min", flush=True)
    if passed and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
