"""`create_gallery`: open the configured gallery backend (a FAISS folder or a Milvus collection), read-only."""

from __future__ import annotations

from service.index.base import GalleryBackend
from service.settings import IndexSettings


def create_gallery(index: IndexSettings) -> GalleryBackend:
    """Open the configured backend read-only; ArtifactError / GalleryUnavailable (one line) when it cannot serve."""
    if index.backend == "milvus":
        from service.index.milvus import MilvusGallery  # optional extra: nobackfill[milvus]

        return MilvusGallery.open(index)
    from service.index.gallery import Gallery

    return Gallery.load(index.gallery_dir, coarse=index.coarse, graph_ef=index.coarse_ef)
