"""Progress for long commands: a tqdm bar on a terminal, a plain line now and then in a file or pipe."""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm  # type: ignore[import-untyped]

# In a log file or a CI pipe a redrawn bar is thousands of carriage returns: one line this often instead.
PLAIN_INTERVAL_S = 10.0


class PlainLines(tqdm):  # type: ignore[misc]
    """A tqdm that writes whole lines (no carriage return, no redraw): at the start, every interval, at the end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("mininterval", PLAIN_INTERVAL_S)
        kwargs["maxinterval"] = max(kwargs["mininterval"], PLAIN_INTERVAL_S)
        kwargs["ascii"] = True
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> None:  # noqa: ARG002 (tqdm's signature)
        """One line per refresh: the line break goes before it, as tqdm's close ends the last one itself."""
        text = msg if msg is not None else self.__str__()
        if text:
            self.fp.write(("\n" if getattr(self, "_wrote", False) else "") + text)
            self._wrote = True
            self.fp.flush()

    def close(self) -> None:
        """End the last line when tqdm does not (leave=False)."""
        unended = getattr(self, "_wrote", False) and not self.leave and not self.disable
        super().close()
        if unended:
            self.fp.write("\n")
            self.fp.flush()


def progress_bar(
    *, total: int | float | None, desc: str, unit: str, enabled: bool = True, file: IO[str] | None = None, **kw: Any
) -> tqdm:
    """A bar on a terminal, PlainLines elsewhere, nothing when not `enabled`."""
    stream = file if file is not None else sys.stderr
    if not enabled:
        return tqdm(total=total, disable=True)
    kind = tqdm if _is_terminal(stream) else PlainLines
    return kind(total=total, desc=desc, unit=unit, file=stream, **kw)


def _is_terminal(stream: IO[str]) -> bool:
    """Whether the stream is a terminal (a closed or odd stream counts as not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
