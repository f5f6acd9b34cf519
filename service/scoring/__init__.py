"""Offline scoring: what an upgrade, a bridge, a migration or a gallery would give, measured on held-out sets."""
