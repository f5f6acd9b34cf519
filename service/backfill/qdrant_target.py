"""`backfill run` into Qdrant (segment/qdrant_rows.py), as a BackfillTarget.

    nobackfill backfill run --segment qdrant:embedding_v2 --add-vector ...              a named vector
    nobackfill backfill run --segment qdrant-collection:items_v2 --add-collection ...  a second collection

Each publish is one `update_vectors` (or `upsert`) that sets the new rows of a batch where they are not
set yet (backfill/targets.py's ClientTarget: resumable, idempotent, no lock).  The vector (or collection)
is created only with --add-vector (--add-collection), labelled in the collection's metadata.  Two runs at
once never write a point twice (the first writer's row stays); in local mode the client's own folder
lock already lets one process in.
"""

from __future__ import annotations

from service.backfill.targets import ClientTarget
from service.encoders.identity import ModelIdentity
from service.segment.qdrant_rows import QdrantNewRows


class QdrantVectorTarget(ClientTarget):
    """The new vector (or second collection) the settings name."""

    store = "Qdrant"
    rows: QdrantNewRows

    def refusal(self, model: ModelIdentity) -> str:
        """No vector (or collection): --add-vector (--add-collection) creates it."""
        if self.rows.side:
            return (
                f"{self.where}: no such collection; pass --add-collection to create it "
                f"(a collection of nobackfill's own: vector {self.rows.vector or '(default)'}, dim {model.dim}, Cosine)"
            )
        return (
            f"{self.where}: no such vector; pass --add-vector to add it "
            f"(create_vector_name {self.rows.name}: dim {model.dim}, Cosine; Qdrant >= 1.18, else "
            "--segment qdrant-collection:NAME --add-collection)"
        )
