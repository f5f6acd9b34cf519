"""Compatibility layer: Procrustes map, query blending heads, alpha selection, metrics, profile artifact.

Pure numpy / torch; nothing here imports fastapi (DESIGN.md section 2).
"""
