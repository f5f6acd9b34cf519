"""Compatibility layer: Procrustes map, query blending heads, alpha selection, metrics, profile artifact.

Pure numpy / torch; nothing here imports fastapi or the settings (the layers of docs/architecture.md).
"""
