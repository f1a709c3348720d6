"""Counter-based random numbers: the value for (seed, sample, field) is a pure function.

Hashing counters (splitmix64) instead of drawing from a stateful generator makes every
sample's content independent of batch size, rank count and generation order, so the
shards of R ranks are disjoint, together equal the whole, and any machine produces
identical bytes. numpy has no vectorised counter-based generator with this contract
(Philox/SFC64 streams are sequential), hence these few lines.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def hash_keys(seed: int, *keys: np.ndarray | int) -> np.ndarray:
    """A 64-bit hash of (seed, keys...), broadcasting the keys like numpy does."""
    h = splitmix64(np.asarray(seed, dtype=np.uint64))
    for key in keys:
        h = splitmix64(h ^ np.asarray(key).astype(np.uint64))
    return h


def uniform(bits: np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from 64-bit hashes (top 53 bits)."""
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
