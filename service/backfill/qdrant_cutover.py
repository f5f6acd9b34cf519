"""`backfill cutover qdrant:VECTOR | qdrant-collection:NAME`: what makes the user's application read the new rows.

    qdrant:VECTOR             a named vector: the application queries `using` the new vector's name.  Nothing
                              changes in Qdrant, so there is nothing to --apply: the switch is the query's.
    qdrant-collection:NAME    a second collection: one alias operation.  When NOBACKFILL_INDEX__QDRANT_COLLECTION
                              is itself an alias (the application reads the alias), it is switched to NAME
                              atomically, and the application changes nothing; otherwise an alias (--alias,
                              default <collection>_current) is created on NAME for the application to read.
                              --apply runs it (one `update_collection_aliases` call: all or nothing).

Both are refused below 100 % moved, as the cut-over is; the old vector (collection) stays until the operator
deletes it.  nobackfill itself follows with NOBACKFILL_OLD__BACKEND=none (it then serves the new rows alone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from service.errors import InputError
from service.segment.in_store import refuse_unless_all_moved
from service.segment.qdrant_rows import QdrantNewRows


@dataclass(frozen=True)
class QdrantCutover:
    """What to print: the lines (a query or a pasteable REST call), the alias operations to --apply, what after."""

    lines: list[str]
    after: str
    drop_later: str
    actions: list[dict[str, Any]] = field(default_factory=list)  # the REST body's actions; [] for a named vector


def plan_cutover(rows: QdrantNewRows, client: Any, alias: str | None) -> QdrantCutover:
    """The cut-over for `rows`; InputError unless every point of the collection has its new row."""
    refuse_unless_all_moved(rows, client, "collection" if rows.side else "vector", "points")
    if not rows.side:
        if alias is not None:
            raise InputError("--alias is for a second collection (qdrant-collection:NAME); a named vector is queried")
        query = {"query": "<the new model's query vector>", "using": rows.name, "limit": 10}
        return QdrantCutover(
            lines=[
                f"# every point of {rows.collection} has vector {rows.name}: the application queries it by name",
                f'client.query_points("{rows.collection}", query=new_query, using="{rows.name}", limit=k)',
                f"# REST: POST /collections/{rows.collection}/points/query {json.dumps(query)}",
            ],
            after=(
                f"nothing changes in Qdrant (no --apply needed): the application's queries use {rows.name}; "
                "nobackfill follows with NOBACKFILL_OLD__BACKEND=none"
            ),
            drop_later=f'client.delete_vector_name("{rows.collection}", "{rows.old_vector or ""}")',
        )
    current = {a.alias_name: a.collection_name for a in client.get_aliases().aliases}
    if rows.collection in current:  # the application reads an alias: switch it
        name = rows.collection
        retired = current[name]
        actions: list[dict[str, Any]] = [{"delete_alias": {"alias_name": name}}]
        after = f"the application reads alias {name} as before, now collection {rows.name} (the new model's rows)"
    else:
        name = alias or f"{rows.collection}_current"[:255]
        retired = rows.collection
        actions = [{"delete_alias": {"alias_name": name}}] if name in current else []
        after = f"point the application at alias {name} (it reads collection {rows.name}: the new model's rows)"
    actions.append({"create_alias": {"collection_name": rows.name, "alias_name": name}})
    body = json.dumps({"actions": actions})
    return QdrantCutover(
        lines=[
            f"curl -X POST \"$QDRANT_URL/collections/aliases\" -H 'Content-Type: application/json' "
            f"-H \"api-key: $QDRANT_API_KEY\" -d '{body}'"
        ],
        after=after + "; nobackfill follows with NOBACKFILL_OLD__BACKEND=none",
        drop_later=(
            f'curl -X DELETE "$QDRANT_URL/collections/{retired}" (once the application writes to {rows.name}: '
            "payloads edited in the old collection after a point was copied are not in the new one)"
        ),
        actions=actions,
    )


def apply_cutover(client: Any, cutover: QdrantCutover) -> None:
    """The alias operations in one call (all or nothing); nothing for a named vector."""
    from qdrant_client import models

    if not cutover.actions:
        return
    operations: list[Any] = []
    for action in cutover.actions:
        if "delete_alias" in action:
            operations.append(models.DeleteAliasOperation(delete_alias=models.DeleteAlias(**action["delete_alias"])))
        else:
            operations.append(models.CreateAliasOperation(create_alias=models.CreateAlias(**action["create_alias"])))
    client.update_collection_aliases(change_aliases_operations=operations)
