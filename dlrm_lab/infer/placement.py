"""Where each instance of the served models runs: its number, its cores and its device.

Policy beside the serving plan (`infer.plan`): the server (`infer.server.InferenceServer.start`) spawns
the instances where this says, and chooses nothing itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dlrm_lab.infer.served import ServedModel


@dataclass(frozen=True)
class Placement:
    index: int  # the instance's number within the whole server
    cores: tuple[int, ...]  # the cores its threads are pinned to (empty: not pinned)
    device: str  # "cpu" or "cuda:N"


def place_instances(
    models: Iterable[ServedModel],
    device: str,
    pin_cores: bool,
    cores: Sequence[int] | None = None,
    gpus: int | None = None,
) -> dict[str, list[Placement]]:
    """Per model, its instances' placements, numbered over the models in order. On CPU with `pin_cores`,
    each instance takes the next `threads` of `cores` (default: this process's affinity), wrapping around;
    on CUDA the instances go round-robin over the `gpus` visible (default: torch's count).

    >>> from dlrm_lab.config import load_preset
    >>> tiny = ServedModel("tiny", load_preset("tiny"), instances=2, threads=2)
    >>> [p.cores for p in place_instances([tiny], "cpu", True, cores=[0, 1, 2])["tiny"]]
    [(0, 1), (2, 0)]
    """
    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if device == "cuda" and gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    places: dict[str, list[Placement]] = {}
    index, next_core = 0, 0
    for m in models:
        places[m.name] = []
        for _ in range(m.instances):
            mine: tuple[int, ...] = ()
            if pin_cores and cores and device == "cpu":
                mine = tuple(cores[(next_core + k) % len(cores)] for k in range(m.threads))
                next_core += m.threads
            where = f"cuda:{index % gpus}" if device == "cuda" and gpus else device
            places[m.name].append(Placement(index, mine, where))
            index += 1
    return places


def spare_cores(places: dict[str, list[Placement]], cores: Sequence[int] | None = None) -> tuple[int, ...]:
    """This process's cores (`cores`, default its affinity) that no instance of `places` is pinned to: where the
    serving process's own threads (load, batchers, completions, tables) run without preempting an instance. Empty
    when the instances take them all, or when any instance is not pinned (it may run anywhere).

    >>> one = {"m": [Placement(0, (0,), "cpu")]}
    >>> spare_cores(one, cores=[0, 1]), spare_cores(one, cores=[0])
    ((1,), ())
    """
    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    placed = [p for ps in places.values() for p in ps]
    if not placed or any(not p.cores for p in placed):
        return ()
    taken = {c for p in placed for c in p.cores}
    return tuple(c for c in cores if c not in taken)


def pin_threads(cores: Sequence[int]) -> dict[int, set[int]]:
    """Pin every thread of this process to `cores` (Linux: affinity is per thread; threads started later inherit
    their starter's). Returns each thread's affinity before, for `unpin_threads`; nothing where not supported."""
    if not cores or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return {}
    before: dict[int, set[int]] = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
        except OSError:  # ended meanwhile
            before.pop(tid, None)
    return before


def unpin_threads(before: dict[int, set[int]]) -> None:
    """Give the threads `pin_threads` pinned their affinity back (those still running); threads started since get
    the widest of those."""
    widest = max(before.values(), key=len, default=None)
    if widest is None:
        return
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            os.sched_setaffinity(tid, before.get(tid, widest))
        except OSError:
            pass
