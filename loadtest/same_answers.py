"""Do two checkouts of nobackfill answer alike?  Serves each on the same artifacts, asks every mode, compares.

    .venv/bin/python loadtest/same_answers.py --before /work/wt-before --segment artifacts/demo/segment

A refactor that promises "behaviour unchanged" is checked here as a user sees it: `nobackfill serve`
from each checkout (its own code, this virtualenv's libraries), the same gallery, profile and segment
(no item store: the cascade would write into the segment while the two are asked), the same queries in
every mode of the API.  An answer is its HTTP status and, per query, the ids, scores (to the byte),
mode and alpha; an error's code.  Fields a later version adds, and cache hit or miss, are not compared.
Where a mode differs: in how many queries, and R@1 on each side (a caption's item is its target).
Exit 0 when every mode answers alike, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from benchlib import free_port, wait_ready  # loadtest/benchlib.py

ROOT = Path(__file__).resolve().parents[1]
MODES = (
    "old", "aligned", "slerp", "nlerp", "adaptive", "adapter", "adapter+slerp", "psp", "lsp", "compare", "hybrid",
    "new", "cascade",
)  # fmt: skip
ANSWER = ("ids", "scores", "mode", "alpha")  # what a result answers; cache hit or miss depends on history
READY_S = 180.0  # a server's start on a busy box (models, gallery, segment); polled, never a fixed sleep


@contextmanager
def served(checkout: Path, env: dict[str, str], log: Path) -> Iterator[str]:
    """`nobackfill serve` from `checkout` (its code first on the path), until /readyz answers 200; its base URL."""
    port = free_port()
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=checkout, env={**os.environ, **env, "PYTHONPATH": str(checkout)}, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            if not wait_ready(f"{base}/readyz", READY_S, server, request_timeout_s=2):
                if server.poll() is not None:
                    raise SystemExit(f"{checkout}: the server exited ({server.returncode}); see {log}")
                raise SystemExit(f"{checkout}: not ready in {READY_S:.0f} s; see {log}")
            yield base
        finally:
            server.terminate()
            server.wait(timeout=30)


def answer(base: str, mode: str, texts: list[str], k: int) -> tuple[int, str]:
    """(status, the comparable part of the body): results for a 200, the error's code for anything else."""
    response = httpx.post(
        f"{base}/v1/search", json={"queries": [{"text": t} for t in texts], "k": k, "mode": mode}, timeout=60
    )
    body = response.json()
    if response.status_code == 200:  # fields a later version adds (score_scale) are no change of answer
        kept: object = [{key: result.get(key) for key in ANSWER} for result in body["results"]]
    else:
        kept = body.get("error", {}).get("code", body)
    return response.status_code, json.dumps(kept, sort_keys=True)


def recall_at_1(answers: list[tuple[int, str]], targets: list[int]) -> float:
    """Share of queries whose first id is the item the caption describes (the synthetic world's truth)."""
    firsts = [result["ids"][0] if result["ids"] else -1 for _, body in answers for result in json.loads(body)]
    return sum(first == target for first, target in zip(firsts, targets, strict=True)) / len(targets)


def difference(before: list[tuple[int, str]], after: list[tuple[int, str]]) -> str:
    """How two modes' answers differ: queries whose ids differ (as sets, or only in order), the largest score gap."""
    ids_differ = order_only = 0
    gap = 0.0
    for (status_a, body_a), (status_b, body_b) in zip(before, after, strict=True):
        if status_a != status_b or status_a != 200:
            return f"status {status_a} against {status_b}"
        for a, b in zip(json.loads(body_a), json.loads(body_b), strict=True):
            if a["ids"] != b["ids"]:
                ids_differ += 1
                order_only += set(a["ids"]) == set(b["ids"])
            elif a["scores"] != b["scores"]:
                gap = max(gap, max(abs(x - y) for x, y in zip(a["scores"], b["scores"], strict=True)))
    return f"ids differ in {ids_differ} queries ({order_only} in order only); same ids, largest score gap {gap:.2e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="The other checkout (a git worktree).")
    parser.add_argument("--after", type=Path, default=ROOT, help="This checkout (default).")
    parser.add_argument("--gallery", type=Path, default=ROOT / "artifacts/demo/gallery")
    parser.add_argument("--profile", type=Path, default=ROOT / "artifacts/demo/profile")
    parser.add_argument("--segment", type=Path, help="A segment folder (hybrid, new and cascade need one).")
    parser.add_argument("--queries", type=int, default=200, help="Query texts, item-N caption-1 over the gallery.")
    parser.add_argument("--items", type=int, default=50_000, help="Items in the gallery (the query ids' range).")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--logs", type=Path, default=ROOT / "artifacts/bench/same_answers")
    args = parser.parse_args()

    env = {
        "NOBACKFILL_INDEX__GALLERY_DIR": str(args.gallery.resolve()),
        "NOBACKFILL_COMPAT__PROFILE_DIR": str(args.profile.resolve()),
    }
    if args.segment is not None:
        env["NOBACKFILL_INDEX__SEGMENT_DIR"] = str(args.segment.resolve())
    step = max(1, args.items // args.queries)
    targets = [i * step for i in range(args.queries)]
    texts = [f"item-{i:010d} caption-1" for i in targets]
    args.logs.mkdir(parents=True, exist_ok=True)
    answers: dict[str, dict[str, list[tuple[int, str]]]] = {}
    with ExitStack() as stack:
        bases = {
            name: stack.enter_context(served(path.resolve(), env, args.logs / f"{name}.log"))
            for name, path in (("before", args.before), ("after", args.after))
        }
        for name, base in bases.items():
            # 20 queries a request: the batch path, as a client sending a page of queries would.
            pages = [texts[i : i + 20] for i in range(0, len(texts), 20)]
            answers[name] = {mode: [answer(base, mode, page, args.k) for page in pages] for mode in MODES}
    differ = 0
    for mode in MODES:
        before, after = answers["before"][mode], answers["after"][mode]
        statuses = sorted({status for status, _ in before})
        same = before == after
        differ += not same
        verdict = "identical" if same else f"DIFFERENT: {difference(before, after)}"
        if not same and all(status == 200 for status, _ in before + after):
            verdict += f"; R@1 {recall_at_1(before, targets):.3f} -> {recall_at_1(after, targets):.3f}"
        print(f"{mode:14s} status {','.join(map(str, statuses)):8s} {verdict}")
    print(f"{len(MODES) - differ} of {len(MODES)} modes answer alike over {args.queries} queries (k {args.k})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
