"""Ways of doing one thing timed against each other on a host whose speed drifts (these guests' drift up to 2x in
an hour): each way timed in rounds, the ways interleaved and their order reversed every other round, so that a
drift falls on all of them alike; the medians compared. Every choice the lab makes by timing ways in one process
(kernels, builds' lookups, training's ways, the probe's pages) takes its figures from here.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def interleaved_medians(
    ways: Sequence[str], timed: Callable[[str], float], repeats: int, *, warm_up: bool = True
) -> dict[str, float]:
    """Each way's median of `repeats` readings of `timed(way)`, the ways in the given order on even rounds and
    reversed on odd ones; with `warm_up`, one more round first whose readings are dropped."""
    readings: dict[str, list[float]] = {way: [] for way in ways}
    first = 1 if warm_up else 0
    for k in range(repeats + first):
        for way in ways if k % 2 == 0 else ways[::-1]:
            took = timed(way)
            if k >= first:
                readings[way].append(took)
    return {way: statistics.median(r) for way, r in readings.items()}


def medians_by_size(
    ways: Sequence[str],
    timer_at: Callable[[int], Callable[[str], float]],
    sizes: Sequence[int],
    repeats: int,
    *,
    threads: int,
) -> dict[str, dict[int, float]]:
    """`interleaved_medians` at each batch size of `sizes` (`timer_at(size)`: the ways' timing at that size), on
    `threads` of torch's threads (put back after): way -> size -> median."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        by_size = {size: interleaved_medians(ways, timer_at(size), repeats) for size in sizes}
    finally:
        torch.set_num_threads(before)
    return {way: {size: by_size[size][way] for size in sizes} for way in ways}
