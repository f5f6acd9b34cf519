"""Saved results of `eval --json-out` and `profile compare --json-out`: what the operator page shows beside a profile.

Each file is one JSON object that says what it is (`kind`, `format_version`) and which profile it
scored (`profile_id`: the evaluated profile, or the current one of a comparison, with the candidate's
beside it), so a service never shows one profile's figures next to another.  The profile folder itself
stays untouched: its manifest refuses extra files.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import service
from service.compat.profile import CompatProfile
from service.errors import ArtifactError
from service.manifest import write_json_durably

EVAL_KIND = "nobackfill-eval"
COMPARE_KIND = "nobackfill-profile-compare"
FORMAT_VERSION = 1
# What the command that writes each kind is called, for the refusal line.
_WRITTEN_BY = {EVAL_KIND: "nobackfill eval ... --json-out", COMPARE_KIND: "nobackfill profile compare ... --json-out"}
# A saved result is a few kB (a comparison with traffic ~10 kB); anything far larger is not one.
MAX_BYTES = 4 * 1024 * 1024


def _stamp() -> dict[str, Any]:
    """The fields every saved result starts with."""
    return {
        "format_version": FORMAT_VERSION,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "nobackfill_version": service.__version__,
    }


def eval_document(
    profile: CompatProfile, test_dir: Path, modality: str, judge: str, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """`eval`'s rows with the identity of what was scored on what."""
    return {
        "kind": EVAL_KIND,
        **_stamp(),
        "profile_id": profile.profile_id,
        "head": profile.head,
        "test": str(test_dir),
        "modality": modality,
        "judged_on": judge,
        "rows": rows,
    }


def compare_document(result: dict[str, Any], current: CompatProfile, candidate: CompatProfile) -> dict[str, Any]:
    """`profile compare`'s result with both profiles' ids (a refused comparison has no per-profile block)."""
    return {
        "kind": COMPARE_KIND,
        **_stamp(),
        "profile_id": current.profile_id,
        "candidate_profile_id": candidate.profile_id,
        **result,
    }


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Write a saved result whole or not at all."""
    write_json_durably(path, document)


def read_document(path: Path, kind: str, profile_id: str | None, setting: str) -> dict[str, Any]:
    """A saved result of `kind` for profile `profile_id`; ArtifactError in one line naming `setting` otherwise."""
    where = f"{setting}={path}"
    expected = f"expected what `{_WRITTEN_BY[kind]}` writes"
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ArtifactError(f"{where}: {size:,} bytes is no saved result ({expected})")
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{where}: no such file ({expected})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{where}: not readable JSON ({exc}; {expected})") from None
    if not isinstance(document, dict):
        what = "a list (what `--json` prints, without the profile's id)" if isinstance(document, list) else "no object"
        raise ArtifactError(f"{where}: {what}, not {kind!r}; {expected}")
    found = document.get("kind")
    if found != kind:
        raise ArtifactError(f"{where}: {f'kind {found!r}' if found else 'no kind'}, not {kind!r}; {expected}")
    if document.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{where}: format_version {document.get('format_version')!r}, not {FORMAT_VERSION}")
    if profile_id is None:
        raise ArtifactError(f"{where}: no profile is served (cut over), so no result of one can be shown")
    if document.get("profile_id") != profile_id:
        raise ArtifactError(
            f"{where}: scores profile {document.get('profile_id')!r}, but this service serves {profile_id!r}"
        )
    if kind == EVAL_KIND and not _rows(document.get("rows")):
        raise ArtifactError(f"{where}: `rows` must be a non-empty list of eval rows")
    if kind == COMPARE_KIND and document.get("outcome") not in ("pass", "fail", "undecided", "refused"):
        raise ArtifactError(f"{where}: `outcome` must be pass, fail, undecided or refused")
    return document


def _rows(rows: Any) -> bool:
    """Whether `rows` looks like eval's rows: objects with a method and R@1."""
    if not isinstance(rows, list) or not rows:
        return False
    return all(isinstance(r, dict) and "method" in r and "recall@1" in r for r in rows)
