"""nobackfill: serve a new embedding model against a gallery frozen in the old model's space."""

__version__ = "0.1.0"
