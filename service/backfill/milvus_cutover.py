"""`backfill cutover milvus-collection:NAME`: the alias switch after which the user's application reads the new rows.

    NOBACKFILL_INDEX__MILVUS_COLLECTION is an alias   the application reads that alias: it is switched to NAME
                                                      (alter_alias, atomic), and the application changes nothing
    it is the collection itself                       an alias (--alias, default <collection>_current) is created
                                                      on NAME (or switched, when it exists) for the application to read

One Milvus call either way, printed as the pymilvus line and the REST request; --apply runs it.  The new
collection has the user's key and vector field names (segment/milvus_rows.py), so the application's
`anns_field` and `output_fields` stay; its query vectors must then be the new model's.  Refused below
100 % moved, as the cut-over is; the old collection stays until the operator drops it.  nobackfill
itself follows with NOBACKFILL_OLD__BACKEND=none (it then serves the new collection alone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from service.errors import InputError
from service.segment.in_store import refuse_unless_all_moved
from service.segment.milvus_rows import MilvusNewRows


@dataclass(frozen=True)
class MilvusCutover:
    """What to print, and the one alias call to --apply (None when the alias already reads the new collection)."""

    lines: list[str]
    after: str
    drop_later: str
    call: tuple[str, str, str] | None  # (create_alias | alter_alias, collection, alias)


def alias_target(client: Any, alias: str) -> str | None:
    """The collection `alias` names, or None when it is no alias."""
    from service.index.milvus import milvus_errors

    try:
        return str(client.describe_alias(alias)["collection_name"])
    except milvus_errors():  # "alias not found": Milvus answers a missing one with an error
        return None


def plan_cutover(rows: MilvusNewRows, client: Any, alias: str | None) -> MilvusCutover:
    """The cut-over for `rows`; InputError unless every item of the user's collection has its new row."""
    refuse_unless_all_moved(rows, client, "collection")
    read = alias_target(client, rows.collection)
    now: str | None
    if read is not None:  # the application reads an alias: switch that one
        if alias not in (None, rows.collection):
            raise InputError(f"--alias {alias}: NOBACKFILL_INDEX__MILVUS_COLLECTION={rows.collection} is itself an "
                             f"alias (of {read}); the cut-over switches it")  # fmt: skip
        name, retired, now = rows.collection, read, read
        after = f"the application reads alias {name} as before, now collection {rows.name}"
    else:
        name, retired = alias or f"{rows.collection}_current", rows.collection
        now = alias_target(client, name)
        if now is None and client.has_collection(name):
            raise InputError(f"--alias {name} is a collection, not an alias: name another with --alias")
        after = f"point the application at alias {name} (it reads collection {rows.name})"
    after += (
        "; its query vectors are the new model's from then on; nobackfill follows with NOBACKFILL_OLD__BACKEND=none"
    )
    drop_later = (
        f'client.drop_collection("{retired}") (once the application writes to {rows.name}: fields edited in '
        f"{retired} after an item was copied are not in {rows.name})"
    )
    if now == rows.name:
        return MilvusCutover([f"# alias {name} already reads collection {rows.name}"], after, drop_later, None)
    verb = "alter_alias" if now is not None else "create_alias"
    body = json.dumps({"collectionName": rows.name, "aliasName": name})
    return MilvusCutover(
        lines=[
            f'client.{verb}(collection_name="{rows.name}", alias="{name}")',
            f'# REST: curl -X POST "$MILVUS_URI/v2/vectordb/aliases/{verb.removesuffix("_alias")}" '
            f"-H \"Authorization: Bearer $MILVUS_TOKEN\" -H 'Content-Type: application/json' -d '{body}'",
        ],
        after=after,
        drop_later=drop_later,
        call=(verb, rows.name, name),
    )


def apply_cutover(client: Any, cutover: MilvusCutover) -> None:
    """The alias call (one, atomic); nothing when the alias already reads the new collection."""
    if cutover.call is None:
        return
    verb, collection, alias = cutover.call
    getattr(client, verb)(collection_name=collection, alias=alias)
