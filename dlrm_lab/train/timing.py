"""Per-step phase timers that do not lie about asynchronous devices.

On CPU every operator is synchronous, so host timestamps at phase boundaries measure
the phases. On CUDA, kernels run after the host has moved on; there the boundaries are
CUDA events on the current stream and the step's phases are read once its last event
has completed. A phase marked several times in a step (the dense forward runs before
and after the embeddings) accumulates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypedDict

import torch


class _HookState(TypedDict):
    """What an embedding collection's hooks share within a step."""

    first: bool  # the next lookup is the step's first (its input distribution ends there)
    pending: int  # output distributions whose backward has started and not yet ended


class StepTimer:
    """Mark the end of each phase; `phases_ms()` gives the time of each in ms.

    Example::

        timer = StepTimer(device)
        timer.start()
        batch = next(it);            timer.mark("data_wait")
        loss = model(batch);         timer.mark("dense_forward")
        phases = timer.phases_ms()   # {"data_wait": 1.2, "dense_forward": 30.5}
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []
        self._spans: list[tuple[str, object, object]] = []  # parts timed inside a phase (not in the phases' sum)
        self._open: dict[str, object] = {}

    def _stamp(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("start", self._stamp())]
        self._spans, self._open = [], {}

    def mark(self, phase: str) -> None:
        if self._marks:  # marks outside a step (evaluation) are ignored
            self._marks.append((phase, self._stamp()))

    def begin(self, part: str) -> None:
        """A part inside a phase starts (the tables' update inside backward): timed apart by `parts_ms`."""
        if self._marks:
            self._open[part] = self._stamp()

    def end(self, part: str) -> None:
        if self._marks and (begun := self._open.pop(part, None)) is not None:
            self._spans.append((part, begun, self._stamp()))

    def stop(self) -> None:
        """End the step: marks until the next `start()` are ignored."""
        self._marks = []

    def phases_ms(self) -> dict[str, float]:
        if self.cuda:
            last = self._marks[-1][1]
            last.synchronize()  # type: ignore[attr-defined]
        out: dict[str, float] = {}
        for (_, before), (name, after) in zip(self._marks, self._marks[1:], strict=False):
            if self.cuda:
                ms = before.elapsed_time(after)  # type: ignore[attr-defined]
            else:
                ms = (after - before) * 1000.0  # type: ignore[operator]
            out[name] = out.get(name, 0.0) + ms
        return out

    def parts_ms(self) -> dict[str, float]:
        """Each part's time in the step (ms), summed over its spans; read after `phases_ms()`."""
        out: dict[str, float] = {}
        for name, before, after in self._spans:
            ms = before.elapsed_time(after) if self.cuda else (after - before) * 1000.0  # type: ignore[attr-defined,operator]
            out[name] = out.get(name, 0.0) + ms
        return out


def on_table_update(
    tables: list[Any], before: Callable[[Any, tuple[Any, ...]], None], after: Callable[[Any], None] | None = None
) -> list[Any]:
    """Call `before(group, gradients)` as each fused table group's backward-and-update starts, and `after(group)` as
    it ends: on each group's lookup, the autograd node that makes its output runs the update (fbgemm's fused
    backward, or the lab's batched one), and hooks go before and after that node. Returns the hook handles."""

    def on_lookup(module: Any, args: Any, out: Any) -> None:
        node = getattr(out, "grad_fn", None)
        if node is None or not torch.is_grad_enabled():
            return

        def prehook(grads: tuple[Any, ...]) -> None:  # returns None: the gradients pass on as they are
            before(module, grads)

        node.register_prehook(prehook)
        if after is not None:
            node.register_hook(lambda grads_in, grads_out: after(module))

    return [tbe.register_forward_hook(on_lookup) for tbe in tables]


def instrument_table_update(tables: list[Any], timer: StepTimer) -> list[Any]:
    """Time the tables' backward-and-update (`table_update`, a part of the backward phase) apart
    (`on_table_update`). Returns the hook handles."""
    return on_table_update(
        tables, lambda _group, _grads: timer.begin("table_update"), lambda _group: timer.end("table_update")
    )


def instrument_embedding_phases(model: torch.nn.Module, timer: StepTimer) -> list[Any]:
    """Split the forward pass at the sharded embedding collection's boundaries (a DLRM's pooled
    bags, or the HSTU ranker's sequence tables).

    TorchRec's sharded collection runs: input distribution (ids to the ranks owning their
    rows, an all-to-all), then per sharding group a lookup and the launch of the pooled
    output's distribution; the output is awaited where the sparse arch first uses it.
    Forward hooks mark those boundaries, so time before the collection and after the
    wait is dense forward; inside backward, tensor hooks mark the output distribution's backward
    (`embedding_all_to_all_backward`). Returns the hook handles.
    """
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    handles: list[Any] = []
    for parent in model.modules():
        ebc = getattr(parent, "embedding_bag_collection", None)
        if not isinstance(ebc, ShardedEmbeddingBagCollection):
            ebc = getattr(parent, "tables", None)  # the HSTU ranker's sequence tables
            if not isinstance(ebc, ShardedEmbeddingCollection):
                continue
        state: _HookState = {"first": True, "pending": 0}

        def ebc_pre(module: Any, args: Any, state: _HookState = state) -> None:
            state["first"], state["pending"] = True, 0
            timer.mark("dense_forward")

        def lookup_pre(module: Any, args: Any, state: _HookState = state) -> None:
            timer.mark("input_dist" if state["first"] else "embedding_all_to_all")
            state["first"] = False

        handles.append(ebc.register_forward_pre_hook(ebc_pre))
        for lookup in ebc._lookups:  # noqa: SLF001 - TorchRec exposes no public hook point here
            handles.append(lookup.register_forward_pre_hook(lookup_pre))
            handles.append(lookup.register_forward_hook(lambda *a: timer.mark("embedding_lookup")))
        handles.append(ebc.register_forward_hook(lambda *a: timer.mark("embedding_all_to_all")))
        if isinstance(ebc, ShardedEmbeddingBagCollection):  # the sparse arch ends where the pooled output is awaited
            handles.append(parent.register_forward_hook(lambda *a: timer.mark("embedding_all_to_all")))
        # (the ranker awaits its sequence embeddings at their first use, counted as dense forward)
        handles += _instrument_output_dist_backward(ebc, timer, state)
    return handles


def _instrument_output_dist_backward(ebc: Any, timer: StepTimer, state: _HookState) -> list[Any]:
    """Split backward at the output distribution's backward (`embedding_all_to_all_backward`).

    Inside `loss.backward()` no phase timer runs, and TorchRec's backward of the pooled all-to-all
    (its recat of the gradient, the collective, the wait) was the largest unnamed part of a 2-rank
    kaggle step (3.1-3.4 ms of 46, timed by hand: docs/benchmarks-history.md, issue 18). Tensor hooks mark its
    two ends: the gradient of an output distribution's result arrives (the phase starts: backward
    until then) and the gradient of its input, the lookup's output, is complete (it ends). Where
    the distribution passes its input through (data-parallel tables, one rank) both hooks sit on
    one tensor, the end first: it is ignored, so the phase is 0 there."""
    if not getattr(ebc, "_output_dists", None):
        return []

    def grad_out_ready(grad: torch.Tensor) -> None:
        state["pending"] += 1
        timer.mark("backward")

    def grad_in_ready(grad: torch.Tensor) -> None:
        if state["pending"] > 0:
            state["pending"] -= 1
            timer.mark("embedding_all_to_all_backward")

    def on_result(result: Any) -> Any:
        if isinstance(result, torch.Tensor) and result.requires_grad:
            result.register_hook(grad_out_ready)
        return result

    def dist_pre(module: Any, args: Any) -> None:
        local = args[0] if args else None
        if isinstance(local, torch.Tensor) and local.requires_grad:
            local.register_hook(grad_in_ready)

    def dist_post(module: Any, args: Any, awaitable: Any) -> None:
        callbacks = getattr(awaitable, "callbacks", None)
        if callbacks is not None and torch.is_grad_enabled():
            callbacks.append(on_result)

    handles = []
    for dist in ebc._output_dists:  # noqa: SLF001 - as above
        handles.append(dist.register_forward_pre_hook(dist_pre))
        handles.append(dist.register_forward_hook(dist_post))
    return handles
