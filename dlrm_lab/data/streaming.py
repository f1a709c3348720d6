"""The streaming protocol (`--protocol streaming`, MLPerf Training DLRMv4's): `Stream` walks the windows (one time
step each) in time order: train on window T's requests, then evaluate on window T+1's (`StreamSource`,
`NextWindowSource`), so nothing a model is scored on precedes anything it has trained on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

from dlrm_lab.config.family import ModelFamily, SpecIn, SpecT
from dlrm_lab.config.sequence_spec import SequenceSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.data import BatchSource
from dlrm_lab.data.request_batches import RequestBatch
from dlrm_lab.data.sequences import SequenceGenerator
from dlrm_lab.errors import FieldError


@dataclass(frozen=True)
class Stream:
    """`--protocol streaming` (MLPerf Training DLRMv4's): the windows, one time step each, walked in time order.
    Windows [warmup_timestamps, train_timestamps) are trained on in turn; after every step the model is
    evaluated on the window after the one it is training on, so nothing it is scored on precedes anything it
    has trained on, and every window but the first is scored before it is trained on. A window's requests
    (its `active_users`) are cut into whole global batches: a step never spans two windows, and the
    remainder of each window (fewer than one global batch) is left out, as `skipped_per_window` says."""

    spec: SequenceSpec
    global_batch: int

    def __post_init__(self) -> None:
        if self.per_window < 1:
            raise FieldError(
                "protocol",
                f"streaming: a window holds {self.spec.active_users} requests, fewer than one "
                f"global batch of {self.global_batch} (lower {{batch_size}})",
                "batch_size",
            )

    @property
    def windows(self) -> tuple[int, int]:
        """The time steps trained on, [first, stop); each is evaluated on the next, the last on `stop`."""
        return self.spec.warmup_timestamps, self.spec.train_timestamps

    @property
    def per_window(self) -> int:
        return self.spec.active_users // self.global_batch

    @property
    def skipped_per_window(self) -> int:
        return self.spec.active_users - self.per_window * self.global_batch

    @property
    def steps(self) -> int:
        first, stop = self.windows
        return (stop - first) * self.per_window

    def window_of(self, step: int) -> int:
        """The window (time step) that training step `step` trains on."""
        return self.windows[0] + step // self.per_window

    def eval_every(self, share: float) -> int:
        """Steps between evaluations for one every `share` of the stream's steps (the reference rounds the
        same way: round(share x steps), at least 1)."""
        return max(1, round(share * self.steps))

    def describe(self) -> JsonObject:
        first, stop = self.windows
        return {
            "protocol": "streaming",
            "train_windows": [first, stop],
            "eval_windows": [first + 1, stop + 1],
            "steps": self.steps,
            "steps_per_window": self.per_window,
            "global_batch": self.global_batch,
            "requests_per_window": self.spec.active_users,
            "requests_skipped_per_window": self.skipped_per_window,
        }


def _rank_batch(source: Any, window: int, j: int) -> RequestBatch:
    """`source`'s rank's contiguous slice of global batch j of window `window` (a StreamSource or NextWindowSource)."""
    start = j * source.stream.global_batch + source.rank * source.batch_size
    return RequestBatch.from_block(source.generator.step_requests(window, start, start + source.batch_size))


@dataclass
class StreamSource:
    """This rank's training batches of a `Stream`, in time order: step s trains on window `window_of(s)`, its
    global batch the window's requests [j G, (j + 1) G) for j = s mod steps_per_window, rank r the r-th
    contiguous slice. Ends with the stream."""

    generator: SequenceGenerator
    stream: Stream
    batch_size: int
    rank: int = 0
    world_size: int = 1
    start_batch: int = 0

    def batch(self, k: int) -> RequestBatch:
        step = self.start_batch + k
        return _rank_batch(self, self.stream.window_of(step), step % self.stream.per_window)

    def __iter__(self) -> Iterator[RequestBatch]:
        for k in range(self.stream.steps - self.start_batch):
            yield self.batch(k)

    def describe(self) -> JsonObject:
        return {
            **self.generator.describe(),
            "window": "stream",
            **self.stream.describe(),
            "batch_size_per_rank": self.batch_size,
            "world_size": self.world_size,
        }


@dataclass
class WindowBatches:
    """One evaluation of the stream: this rank's batches of window `eval_window`, after training on `train_window`."""

    source: NextWindowSource
    train_window: int
    eval_window: int
    num_batches: int

    @property
    def columns(self) -> dict[str, int]:
        """What the evaluation's row records beside its AUC."""
        return {"train_window": self.train_window, "eval_window": self.eval_window}

    def __iter__(self) -> Iterator[RequestBatch]:
        for j in range(self.num_batches):
            yield _rank_batch(self.source, self.eval_window, j)


@dataclass
class NextWindowSource:
    """The stream's held-out batches: after training step s, the window after the one s trained on, its first
    `num_batches` global batches (at most the window's whole batches), each rank its slice. The loop asks
    `after_step(s)` at every evaluation."""

    generator: SequenceGenerator
    stream: Stream
    batch_size: int
    rank: int = 0
    world_size: int = 1
    num_batches: int = 8

    def after_step(self, step: int) -> WindowBatches:
        window = self.stream.window_of(step)
        return WindowBatches(self, window, window + 1, min(self.num_batches, self.stream.per_window))

    def describe(self) -> JsonObject:
        return {
            **self.generator.describe(),
            "window": "next",
            **self.stream.describe(),
            "batches_per_evaluation": min(self.num_batches, self.stream.per_window),
            "batch_size_per_rank": self.batch_size,
            "world_size": self.world_size,
        }


@runtime_checkable
class StreamingParts(Protocol[SpecIn]):
    """`--protocol streaming` (MLPerf Training's DLRMv4): a family whose samples are windows in time order has this
    role of `config.family`'s families; `streaming_of(family)` asks, and a family without it is one line."""

    def stream(self, spec: SpecIn, global_batch: int) -> Stream:
        """The walk through the windows, checked."""
        ...

    def open_stream(
        self,
        spec: SpecIn,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        eval_batches: int,
        seed: int,
        start_batch: int,
    ) -> tuple[BatchSource, BatchSource]:
        """The windows in time order, and after each step the next window."""
        ...


def streaming_of(family: ModelFamily[SpecT], model: str = "") -> StreamingParts[SpecT]:
    """`family`'s streaming role; one line naming the model (`model`) and its family where it has none."""
    if not isinstance(family, StreamingParts):
        raise FieldError(
            "protocol",
            f"streaming: {model or family.label} ({family.called}) has no time windows to stream (allowed: holdout)",
        )
    return cast("StreamingParts[SpecT]", family)
