"""The new-model segment beside the frozen gallery: layout and shard writing (layout.py), reader (reader.py)."""
