"""Keep the model libraries' chatter out of what the user reads: their load reports are not our problems."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr


def quiet_transformers() -> None:
    """Keep transformers' per-load reports (the LOAD REPORT of unexpected keys) and its bars out of the output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


@contextmanager
def no_bars_off_a_terminal() -> Iterator[None]:
    """Within it, what a library writes to stderr (its tqdm bars) is dropped when stderr is a file or pipe.

    Each redraw of a bar is noise there, and the libraries offer no switch (tqdm reads TQDM_DISABLE only at
    import).  Python's own errors still reach the caller as exceptions.
    """
    if sys.stderr.isatty():
        yield
        return
    with open(os.devnull, "w") as sink, redirect_stderr(sink):
        yield
