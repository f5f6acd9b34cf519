"""Keep what a process built at startup out of the garbage collector's full passes.

A full (generation 2) collection walks every tracked object.  With torch, faiss and the models
loaded, each one took 130-150 ms of the service's event loop, every ~7.5 s under a 4x burst, and every
request in flight waited it out: the slowest 1 % of the fast 503 refusals took 90-150 ms instead of a
millisecond (docs/reliability.md).  What startup built lives until shutdown, so walking it again and
again finds nothing: `gc.freeze` moves it to a generation no collection walks, and a collection then
walks only what requests made since.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect once, then freeze every object alive now (call when startup is done)."""
    gc.collect()
    gc.freeze()
