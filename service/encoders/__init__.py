"""Encoders: the `Encoder` protocol, backends, device resolution and per-encoder micro-batching."""
