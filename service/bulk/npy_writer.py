"""One .npy of known shape, filled in order chunk by chunk through a memory map, in a hidden temporary.

    writer = NpyWriter(final, (rows, dim), np.float32)   # header written, space reserved
    writer.append(block) ...                              # rows land at the fill mark, in order
    tmp = writer.close()                                  # every row written, flushed, unmapped
    atomic.publish_files([(tmp, final), ...])             # the caller renames when all are done
    writer.discard()                                      # on any failure instead

The whole file is reserved up front (posix_fallocate): a memory-mapped write into a sparse file on a
full disk is a SIGBUS that kills the process mid-run, while a failed reservation is a clean error
before any encoding starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.bulk.atomic import discard, temp_file
from service.errors import InputError


class NpyWriter:
    """A `shape`-shaped .npy of `dtype` written in row order into a hidden sibling of `final`."""

    def __init__(self, final: Path, shape: tuple[int, ...], dtype: type[np.generic]) -> None:
        self.final = final
        self.shape = shape
        self.tmp = temp_file(final)
        self.filled = 0
        try:
            self._array: np.memmap[Any, Any] | None = np.lib.format.open_memmap(
                self.tmp, mode="w+", dtype=dtype, shape=shape
            )
            with self.tmp.open("r+b") as f:
                os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as exc:
            self.discard()
            raise InputError(f"cannot write {final} ({shape}, {np.dtype(dtype)}): {exc.strerror or exc}") from exc
        except BaseException:
            self.discard()
            raise

    def append(self, block: npt.NDArray[Any]) -> None:
        """Write `block` (rows of the file's trailing shape) at the fill mark."""
        assert self._array is not None, "append after close"
        stop = self.filled + block.shape[0]
        assert block.shape[1:] == self.shape[1:] and stop <= self.shape[0], (block.shape, self.filled, self.shape)
        self._array[self.filled : stop] = block
        self.filled = stop

    def close(self) -> Path:
        """Flush and unmap the finished file; returns the temporary path to publish."""
        assert self._array is not None, "close twice"
        assert self.filled == self.shape[0], f"{self.filled} of {self.shape[0]} rows written"
        self._array.flush()
        self._array = None  # drop the map before the file is renamed or read
        return self.tmp

    def discard(self) -> None:
        """Drop the map and delete the temporary file."""
        self._array = None
        discard(self.tmp)
