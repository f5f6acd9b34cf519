"""One BLAS thread in a serving process: numpy's and faiss's OpenBLAS, while a Pipeline is up.

A request's products are one query row against a few hundred to a few thousand rows (the head, the
calibration's backgrounds): too small to split across cores, and the service already runs requests
side by side on its search pools.  With its default pool OpenBLAS wakes a thread per core for such a
product and leaves it spinning afterwards, holding a core the next request's thread needs.  Measured
over 10^5 items (loadtest/bench_blas_threads.py, medians of 4 rounds; docs/benchmarks.md, "One BLAS thread
while serving"): p99 of a compatible search 6.96 ms with the default pool against 2.18 with one thread,
hybrid's 20.43 ms against 3.29; p50 rises 6 % and 14 %.

Offline commands (fit, gallery build, eval) keep every thread: only `Pipeline.build` enters this, and
its `aclose` restores the pool sizes found before.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any


def one_blas_thread() -> AbstractContextManager[Any]:
    """A context in which every loaded BLAS library uses one thread (threadpoolctl), restored on exit."""
    from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]  # no stubs shipped

    limits: AbstractContextManager[Any] = threadpool_limits(limits=1, user_api="blas")
    return limits
