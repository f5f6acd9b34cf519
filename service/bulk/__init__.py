"""Offline bulk encoding behind `nobackfill encode` and `nobackfill support build`.

    inputs.py      read and validate input files (text lines, JSONL, image folders / lists, pairs)
    atomic.py      hidden temporary siblings and the renames that publish them
    npy_writer.py  one streamed, memory-mapped float32 .npy, published atomically
    encode.py      run an encoder over validated inputs, chunk by chunk, checking what it returns
    support.py     a support folder (old/new x query/target + ids + models.json) from a pairs file

The encoders are the service's own (`service.encoders.registry.create_encoder`), so the embeddings
written here are the ones the service would compute for the same inputs and settings.
"""
