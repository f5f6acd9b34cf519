"""Keep the model libraries' chatter out of what the user reads: their load reports are not our problems."""

from __future__ import annotations


def quiet_transformers() -> None:
    """Keep transformers' per-load reports (the LOAD REPORT of unexpected keys) and its bars out of the output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
