"""The corpus folder on disk, written atomically (atomic_dir.staging), corpus.json last:

    support.jsonl     {"query", "target", "query_id", "target_id"} per line: `nobackfill support build --pairs`
    test.jsonl        the same; target_id is the gallery id of the query's relevant text
    gallery.jsonl     {"id", "text", "source"}: every gallery item (test targets and distractors), by id
    gallery.txt       the same texts, one per line, same order: `nobackfill encode --input gallery.txt`
    gallery_ids.npy   int64, same order: `nobackfill gallery build --from-npy EMB.npy --ids gallery_ids.npy`
    corpus.json       packages and versions, per-package counts, rules, seed and sizes

Every text is one non-empty line of valid UTF-8 (docstrings.clean_text guarantees it; checked again
here because a line-oriented file is silently corrupted by a stray line break).
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

import service
from service.atomic_dir import staging
from service.errors import InputError
from service.realdata import corpus, docstrings

CORPUS_JSON = "corpus.json"
CORPUS_WHAT = "a corpus folder"
SUPPORT_JSONL = "support.jsonl"
TEST_JSONL = "test.jsonl"
GALLERY_JSONL = "gallery.jsonl"
GALLERY_TXT = "gallery.txt"
GALLERY_IDS = "gallery_ids.npy"
FORMAT_VERSION = 1


def _one_line(text: str) -> str:
    """`text` itself, after checking it is one non-empty line of encodable UTF-8."""
    if not text or len(text.splitlines()) != 1 or text != text.strip():
        raise RuntimeError(f"internal: not a clean one-line text: {text[:80]!r}")
    text.encode("utf-8")  # raises on lone surrogates
    return text


def _jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line, UTF-8, non-ASCII kept as is."""
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _pair_rows(pairs: list[corpus.Pair]) -> Iterable[dict[str, Any]]:
    """support/test rows: the pair's id names both its query and its target (the target's gallery id)."""
    for p in pairs:
        yield {"query": _one_line(p.query), "target": _one_line(p.target), "query_id": p.id, "target_id": p.id}


def _by_package(pairs: list[corpus.Pair]) -> dict[str, int]:
    """How many of `pairs` each package gave."""
    counts: dict[str, int] = {}
    for p in pairs:
        counts[p.package] = counts.get(p.package, 0) + 1
    return counts


def corpus_meta(
    collected: corpus.Collected, split: corpus.Split, *, seed: int, requested: dict[str, Any]
) -> dict[str, Any]:
    """The corpus.json record: where the pairs came from, the rules that kept them and how they were split."""
    parts = {"support": split.support, "test": split.test, "distractors": split.distractors}
    per_part = {name: _by_package(pairs) for name, pairs in parts.items()}
    packages = {
        name: {
            "version": count.version,
            "found": count.found,
            "kept": count.kept,
            **{part: per_part[part].get(name, 0) for part in parts},
        }
        for name, count in collected.packages.items()
    }
    return {
        "format_version": FORMAT_VERSION,
        "kind": "docstring summary -> description pairs",
        "seed": seed,
        "requested": requested,
        "sizes": {
            "pairs": len(collected.pairs),
            "support": len(split.support),
            "test": len(split.test),
            "distractors": len(split.distractors),
            "gallery": len(split.test) + len(split.distractors),
        },
        "packages": packages,
        "missing_packages": collected.missing,
        "dropped": dict(sorted(collected.dropped.items())),
        "rules": {
            "min_query_words": corpus.MIN_QUERY_WORDS,
            "max_query_words": corpus.MAX_QUERY_WORDS,
            "min_target_words": corpus.MIN_TARGET_WORDS,
            "max_target_chars": docstrings.MAX_TARGET_CHARS,
        },
        "python": platform.python_version(),
        "nobackfill": service.__version__,
    }


def write_corpus(out: Path, split: corpus.Split, meta: dict[str, Any], *, force: bool) -> None:
    """Write the corpus folder atomically; InputError when `out` exists (without force) or is not ours."""
    gallery = split.gallery()
    with staging(out, force=force, marker=CORPUS_JSON, what=CORPUS_WHAT) as tmp:
        _jsonl(tmp / SUPPORT_JSONL, _pair_rows(split.support))
        _jsonl(tmp / TEST_JSONL, _pair_rows(split.test))
        _jsonl(tmp / GALLERY_JSONL, ({"id": p.id, "text": _one_line(p.target), "source": p.source} for p in gallery))
        with (tmp / GALLERY_TXT).open("w", encoding="utf-8", newline="\n") as f:
            f.writelines(p.target + "\n" for p in gallery)
        np.save(tmp / GALLERY_IDS, np.array([p.id for p in gallery], dtype=np.int64))
        (tmp / CORPUS_JSON).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; InputError naming the file and line when one is malformed."""
    rows: list[dict[str, Any]] = []
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise InputError(f"{path}:{number}: expected a JSON object")
                rows.append(row)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: malformed ({exc})") from exc
    return rows
