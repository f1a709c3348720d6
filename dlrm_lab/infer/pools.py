"""A served model's pool in the server: its queue of queries, its idle instances and its batches in time (`Pool`),
shared by its batcher thread (`infer.server`), the completion thread (`infer.completions`) and the submitters.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from dlrm_lab.config.family import family_of
from dlrm_lab.infer.batching import BatchClock
from dlrm_lab.infer.library import LoadedSamples, PackedLibrary
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.sut import Query


@dataclass
class Pool:
    served: ServedModel
    library: LoadedSamples  # mapped from the snapshot the instances map
    cond: threading.Condition = field(default_factory=threading.Condition)
    waiting: collections.deque = field(default_factory=collections.deque)
    waiting_samples: int = 0
    free: collections.deque = field(default_factory=collections.deque)  # idle instance numbers
    thread: threading.Thread | None = None
    clock: BatchClock = field(init=False)  # its batches in time (infer.batching)
    # history affinity (HSTU with reuse, several instances): this model's instances, a user's home among them
    homes: list[int] = field(default_factory=list)
    one_score_per_sample: bool = field(init=False)  # DLRM; an HSTU request scores each candidate
    rows: list[int] = field(init=False)  # per sparse feature, its table's rows (DLRM): what a sent id may be

    def __post_init__(self) -> None:
        self.clock = BatchClock(self.served.instances)
        self.one_score_per_sample = isinstance(self.library, PackedLibrary)
        self.rows = family_of(self.served.spec).id_rows(self.served.spec)


def drop_expired(pool: Pool, now_ns: int) -> list[Query]:
    """Take the queries at the head of `pool`'s queue whose sender's deadline has passed out of it (the pool's
    lock held): their samples not yet sent are never computed. Returns those with no piece in flight, to be
    finished `expired` now; the others end `expired` with their last piece."""
    out = []
    while pool.waiting and (deadline := pool.waiting[0].deadline_ns) is not None and deadline <= now_ns:
        q = pool.waiting.popleft()
        left = q.size - q.dispatched
        pool.waiting_samples -= left
        q.dispatched = q.size
        q.status, q.error = "expired", f"its deadline passed with {left} of {q.size} samples not begun"
        if q.done_pieces == q.pieces:
            out.append(q)
    return out
