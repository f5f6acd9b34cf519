"""The frozen old-model gallery: build (streaming, chunked), load (mmap, read-only, fingerprint), search.

artifact.py  file names, gallery.json, sha256 of index.faiss
params.py    build parameters, their defaults and validation
sources.py   where the vectors come from: the synthetic world, or the user's .npy files
coarse.py    two-level k-means and assignment for large nlist
build.py     train on a sample, add in chunks, write to a temp dir, rename at the end
gallery.py   `Gallery`: load and search (what the service uses)
evaluate.py  IVF-PQ recall against exact search on a sub-gallery, latency per nprobe
base.py      `GalleryBackend`: the interface the pipeline searches, and the query / nprobe checks
factory.py   `create_gallery`: opens the configured backend (faiss | milvus)
milvus.py    `MilvusGallery`: an existing Milvus collection, searched read-only (extra nobackfill[milvus])
milvus_build.py  `gallery build/info --backend milvus`: load .npy rows into a collection, resumable
"""
