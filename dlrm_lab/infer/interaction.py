"""How a served DLRM's dot interaction runs: torch's ops (a batched GEMM and a gather of the triangle, as every
build compiles them) or the lab's kernel (`model.native`: one op, exported and compiled as one call), chosen in
the serving process by timing both at the batches the model will serve, forward only, in the served precision.

Chosen before the builds are made, so every build the plan times serves the interaction one way, and the packages'
cache key says which. OpenVINO's builds convert torch's ops only: they take torch's way whatever the choice.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.metrics.interleaved import medians_by_size
from dlrm_lab.metrics.precision import DTYPES
from dlrm_lab.model import native
from dlrm_lab.model.interaction import DotInteractionArch

MARGIN = 1.10  # the kernel serves where torch's ops take at least this much longer over the served batches
REPEATS = 5  # timings of each way at each size, interleaved, after one warm-up round
CALLS_PER_SIZE = 2048  # samples a timing covers (at least one call)


def uses_native(model: Any) -> bool:
    """Whether a model (or a build's module) runs the lab's kernel: its process must load it before a package."""
    return isinstance(model, torch.nn.Module) and any(arch.native for arch in DotInteractionArch.within(model))


def put(model: torch.nn.Module, way: str) -> None:
    """Every dot interaction of `model` runs `way` ("native": the lab's kernel, loaded here, before any trace)."""
    if way == "native" and (why := native.load()) is not None:
        raise RuntimeError(why)
    for arch in DotInteractionArch.within(model):
        arch.use(way)


def _timer(arch: DotInteractionArch, width: int, dtype: torch.dtype, size: int) -> Any:
    dense = torch.randn(size, width).to(dtype)
    sparse = torch.randn(size, arch.F, width).to(dtype)
    calls = max(1, CALLS_PER_SIZE // size)

    def timed(way: str) -> float:
        before, arch.native = arch.native, way == "native"
        try:
            with torch.no_grad():
                arch(dense, sparse)
                start = time.perf_counter()
                for _ in range(calls):
                    arch(dense, sparse)
                return (time.perf_counter() - start) * 1e3 / calls
        finally:
            arch.native = before

    return timed


def choose_interaction(
    model: torch.nn.Module, *, precision: str, sizes: list[int], threads: int, device: str | torch.device, log: Log
) -> JsonObject | None:
    """Time the interaction both ways at each of `sizes` on `threads` threads and put the faster in `model` (the
    kernel only where torch's ops take MARGIN longer, summed over the sizes); its record. None: no dot
    interaction."""
    arches = DotInteractionArch.within(model)
    if not arches:
        return None
    record: JsonObject = {"interaction": "torch", "margin": MARGIN}
    if (why := native.unavailable(device)) is not None:
        record["reason"] = why
    else:
        arch, width = arches[0], int(model.spec.embedding_dim)
        dtype = DTYPES[precision]
        med = medians_by_size(
            ("torch", "native"), lambda size: _timer(arch, width, dtype, size), sizes, REPEATS, threads=threads
        )
        total = {way: sum(by.values()) for way, by in med.items()}
        way = "native" if total["torch"] >= MARGIN * total["native"] else "torch"
        at = ", ".join(f"{n}: {med['native'][n]:.3f} against {med['torch'][n]:.3f} ms" for n in sizes)
        record.update(
            interaction=way,
            reason=f"the lab's kernel against torch's ops, forward, {precision}, {threads} thread(s), by batch ({at}; "
            f"medians of {REPEATS} interleaved): "
            + (
                "the kernel serves" if way == "native" else f"the kernel is not {MARGIN:.2f}x faster: torch's ops serve"
            ),
            ms={way: {str(n): round(v, 4) for n, v in by.items()} for way, by in med.items()},
        )
    put(model, str(record["interaction"]))
    log(f"dot interaction {record['interaction']}: {record['reason']}")
    return record
