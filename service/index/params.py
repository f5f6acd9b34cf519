"""IVF-PQ build parameters: defaults that scale with the gallery, and the checks that refuse bad ones.

Defaults (see docs/benchmarks.md "## gallery" for what they cost at 10^7):
- nlist ~ 4 sqrt(N), at most N / 39 (k-means wants >= 39 training points per centroid) and 65536;
- training sample: max(64 nlist, 65536) rows, capped at N and at 1 GiB of float32;
- PQ: M = 64 sub-quantizers of 8 bits (64 bytes per vector), M must divide d;
- coarse training and assignment: plain faiss k-means and exact assignment up to nlist 2048, above
  that two-level k-means and a two-level assignment (see coarse.py), which is what keeps a 10^7 build
  on two CPU cores within minutes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from service.errors import InputError

MAX_NLIST = 65536
MIN_POINTS_PER_CENTROID = 39
TWO_LEVEL_MIN_NLIST = 2049
TRAIN_BYTES_CAP = 1 << 30


@dataclass(frozen=True)
class BuildParams:
    """Resolved parameters of one build (every field concrete)."""

    nlist: int
    pq_m: int
    nbits: int
    opq: bool
    train_size: int
    two_level: bool
    assign_probe: int
    chunk_size: int
    seed: int

    def factory(self) -> str:
        """The faiss index_factory string of this index."""
        prefix = f"OPQ{self.pq_m}," if self.opq else ""
        # `np`: no polysemous training, which index_factory turns on by default for IVF-PQ and which
        # costs minutes of CPU (8x the whole PQ training at M=64) for codes we never compare by Hamming.
        return f"{prefix}IVF{self.nlist},PQ{self.pq_m}x{self.nbits}np"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready copy for gallery.json."""
        return asdict(self)


def default_nlist(n: int) -> int:
    """Round 4 sqrt(n), kept within [1, min(n / 39, 65536)]."""
    return max(1, min(round(4 * math.sqrt(n)), n // MIN_POINTS_PER_CENTROID, MAX_NLIST))


def default_train_size(n: int, nlist: int, d: int) -> int:
    """max(64 nlist, 65536) rows, at most n and at most 1 GiB of float32 vectors."""
    return max(1, min(n, max(64 * nlist, 65536), TRAIN_BYTES_CAP // (4 * d)))


def resolve(
    n: int,
    d: int,
    *,
    nlist: int | None = None,
    pq_m: int = 64,
    nbits: int = 8,
    opq: bool = False,
    train_size: int | None = None,
    two_level: bool | None = None,
    assign_probe: int = 8,
    chunk_size: int = 65536,
    seed: int = 1234,
) -> BuildParams:
    """Fill in defaults for a gallery of n vectors of dim d; InputError on anything faiss would reject."""
    if n <= 0:
        raise InputError(f"gallery size must be positive, got {n}")
    if d <= 0:
        raise InputError(f"vector dimension must be positive, got {d}")
    if not 1 <= nbits <= 16:
        raise InputError(f"--nbits must be in 1..16, got {nbits}")
    if pq_m <= 0 or d % pq_m:
        divisors = [m for m in (8, 16, 32, 48, 64, 96, 128) if d % m == 0]
        raise InputError(f"--pq-m {pq_m} must divide the dimension {d} (e.g. {divisors})")
    nlist = default_nlist(n) if nlist is None else nlist
    if not 1 <= nlist <= MAX_NLIST:
        raise InputError(f"--nlist must be in 1..{MAX_NLIST}, got {nlist}")
    train = default_train_size(n, nlist, d) if train_size is None else train_size
    if train > n:
        raise InputError(f"gallery size {n} is below the training sample ({train} vectors)")
    # k-means needs at least one point per centroid, both for the coarse lists and the PQ codebooks.
    needed = max(nlist, 2**nbits)
    if train < needed:
        what = f"training sample {train}" if train_size is not None else f"gallery size {n}"
        raise InputError(
            f"{what} is below the training minimum {needed} (nlist {nlist}, 2^nbits {2**nbits}); "
            "use a larger gallery or smaller --nlist / --nbits"
        )
    if assign_probe < 1 or chunk_size < 1:
        raise InputError("assign_probe and chunk_size must be positive")
    use_two_level = nlist >= TWO_LEVEL_MIN_NLIST if two_level is None else two_level
    return BuildParams(
        nlist=nlist,
        pq_m=pq_m,
        nbits=nbits,
        opq=opq,
        train_size=train,
        two_level=use_two_level,
        assign_probe=assign_probe,
        chunk_size=chunk_size,
        seed=seed,
    )
