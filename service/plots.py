"""Matplotlib without a display: the pyplot module, and a drawn figure as PNG bytes (then closed)."""

from __future__ import annotations

import io
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed); imported on first use only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_of(fig: Any) -> bytes:
    """The figure laid out tightly, as PNG bytes; the figure is closed either way."""
    try:
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()
    finally:
        pyplot().close(fig)
