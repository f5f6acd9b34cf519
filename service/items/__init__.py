"""The raw items behind the gallery ids (store.py): what backfill and the re-rank cascade re-encode."""
