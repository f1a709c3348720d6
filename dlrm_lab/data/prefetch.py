"""Background prefetching: the next batches are made while the current step computes."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from torchrec.datasets.utils import Batch

from dlrm_lab.config.values import JsonObject

_DONE = object()


class Prefetcher:
    """Iterate `source` on a daemon thread, `depth` batches ahead.

    numpy and pyarrow release the GIL in their kernels, so generation and Parquet
    decoding overlap the training step. With `pin_memory` (CUDA runs) batches are pinned
    on the thread, so the host-to-device copy in the loop can be asynchronous. An
    exception in the thread is re-raised in the consumer at the batch where it happened.
    """

    def __init__(self, source: Iterable[Batch], depth: int = 2, pin_memory: bool = False) -> None:
        self.source = source
        self.depth = depth
        self.pin_memory = pin_memory
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="dlrm-lab-prefetch", daemon=True)
        self._thread.start()

    def describe(self) -> JsonObject:
        inner = self.source.describe() if hasattr(self.source, "describe") else {}
        return {**inner, "prefetch_depth": self.depth, "pin_memory": self.pin_memory}

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        try:
            for batch in self.source:
                if self.pin_memory:
                    batch = batch.pin_memory()
                if not self._put(batch):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(exc)
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
