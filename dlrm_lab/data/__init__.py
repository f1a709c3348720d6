"""Data sources: anything iterable over `torchrec.datasets.utils.Batch` with `describe()`.

A batch is dense float32 [B, num_dense], a KeyedJaggedTensor over the preset's feature
names, and float32 labels [B].
"""

from collections.abc import Iterator
from typing import Any, Protocol

from torchrec.datasets.utils import Batch

from dlrm_lab.data.random_source import RandomSource


class BatchSource(Protocol):
    def __iter__(self) -> Iterator[Batch]: ...

    def describe(self) -> dict[str, Any]: ...


__all__ = ["Batch", "BatchSource", "RandomSource"]
