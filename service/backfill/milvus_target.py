"""`backfill run` into a second Milvus collection (segment/milvus_rows.py), as a BackfillTarget.

    nobackfill backfill run --segment milvus-collection:items_v2 --add-collection ...

Each publish is one `upsert` of the batch's rows whose keys are not there yet (backfill/targets.py's
ClientTarget: resumable, idempotent, no lock).  The collection is created only with --add-collection,
labelled with the new model in its properties.  Two runs at once never hold a key twice: an upsert
replaces it.
"""

from __future__ import annotations

from service.backfill.targets import ClientTarget
from service.encoders.identity import ModelIdentity
from service.segment.milvus_rows import MilvusNewRows


class MilvusCollectionTarget(ClientTarget):
    """The second collection the settings and --segment name."""

    store = "Milvus"
    rows: MilvusNewRows

    def refusal(self, model: ModelIdentity) -> str:
        """No collection: --add-collection creates it."""
        return (
            f"{self.where}: no such collection; pass --add-collection to create it (nobackfill's own: the "
            f"keys and field names of {self.rows.collection}, dim {model.dim}, its index type and metric)"
        )
