"""`create_gallery`: open the configured gallery backend (a FAISS folder, built or adopted, or a Milvus collection)."""

from __future__ import annotations

from service.index.base import GalleryBackend
from service.settings import IndexSettings


def create_gallery(index: IndexSettings) -> GalleryBackend:
    """Open the configured backend read-only; ArtifactError / GalleryUnavailable (one line) when it cannot serve."""
    if index.backend == "milvus":
        from service.index.milvus import MilvusGallery  # optional extra: nobackfill[milvus]

        return MilvusGallery.open(index)
    if index.backend == "qdrant":
        from service.index.qdrant import QdrantGallery  # optional extra: nobackfill[qdrant]

        return QdrantGallery.open(index)
    if index.backend == "pgvector":
        from service.index.pgvector import PgvectorGallery  # optional extra: nobackfill[pgvector]

        return PgvectorGallery.open(index)
    from service.index.adopted import AdoptedGallery, is_adopted
    from service.index.gallery import Gallery

    if is_adopted(index.gallery_dir):  # a FAISS index file the user built (`gallery adopt`)
        return AdoptedGallery.load(index.gallery_dir, ef_search=index.adopted_ef_search)
    return Gallery.load(index.gallery_dir, coarse=index.coarse, graph_ef=index.coarse_ef)
