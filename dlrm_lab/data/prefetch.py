"""Background prefetching: the next batches are made while the current step computes."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
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


class _BatchesOf(torch.utils.data.IterableDataset):
    """Batch k of a random-access source (`batch(k)`, `num_batches`) for k = worker, worker + workers, ...:
    torch's DataLoader takes its workers' batches in turn, so they arrive in k's order."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        k = worker
        while self.source.num_batches is None or k < self.source.num_batches:
            yield self.source.batch(k)
            k += workers


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # a worker makes one batch at a time; its numpy and torch ops need no pool


class WorkerPrefetcher:
    """A random-access source's batches made by `workers` processes, `depth` each ahead, in order (pinned with
    `pin_memory`). A thread is not enough where the step is fast: one host thread makes about 97k multi-hot samples a
    second (dcnv2, 6,912 a batch, on the H200 host), which held that GPU's training to 85% data wait, and a second
    thread gains 1.11x (the generator holds the GIL for most of its work). torch's DataLoader runs the workers, moves
    their batches through shared memory and pins them on its own thread."""

    def __init__(self, source: Any, workers: int, depth: int = 2, pin_memory: bool = False) -> None:
        self.source, self.workers, self.depth, self.pin_memory = source, workers, depth, pin_memory
        loader = torch.utils.data.DataLoader(
            _BatchesOf(source),
            batch_size=None,
            num_workers=workers,
            prefetch_factor=depth,
            pin_memory=pin_memory,
            worker_init_fn=_one_thread,
        )
        self._batches: Iterator[Batch] | None = iter(loader)

    def describe(self) -> JsonObject:
        inner = self.source.describe() if hasattr(self.source, "describe") else {}
        return {**inner, "prefetch_depth": self.depth, "data_workers": self.workers, "pin_memory": self.pin_memory}

    def __iter__(self) -> Iterator[Batch]:
        if self._batches is None:
            return
        yield from self._batches

    def close(self) -> None:
        """The workers stopped (the DataLoader's iterator ends them when it goes)."""
        batches, self._batches = self._batches, None
        if batches is not None and hasattr(batches, "_shutdown_workers"):
            batches._shutdown_workers()
