"""The real upgrade's data and models: a docstring corpus and two real text encoders, all built offline.

    docstrings.py  one installed package's sources -> (summary, description) pairs, read with `ast`
    corpus.py      the fixed package list -> filtered, de-duplicated pairs -> support / test / gallery split
    layout.py      the corpus folder on disk (support.jsonl, test.jsonl, gallery.*, corpus.json), atomically
    models.py      the packaged all-MiniLM-L6-v2 (new) and a static model2vec model distilled from it (old)

`nobackfill realworld corpus|models` (service/commands/realworld.py) drives them.
"""
