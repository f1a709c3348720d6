"""The width a whole-batch package gives each GEMM's input, chosen in the serving process by timing the model's own
layer shapes at the batches it will serve.

A GEMM kernel reads K in blocks (AMX's tile row is 64 bytes: 32 bf16 values; AVX-512's vector 16 fp32 values), and a K
that is not a whole number of blocks runs its tail through slower code: kaggle's first top layer (K = 367 = 16 + 351
pairs), bf16, AMX, 256 samples, one thread, took 140 us unpadded and 97 us with K = 384 (eager `F.linear`; oneDNN's
frozen kernel 197 and 150, the C++ template's 207 and 163), more work done faster. Which width is fastest depends on
the CPU and the kernel, so no width is ruled in: each layer of a K that is not a multiple of the widest candidate block
is timed at its own K and at K rounded up to each candidate block, and a wider input is kept only where it is MARGIN
faster over the served batches. The pad is a zero input column per extra width and a zero weight column to meet it
(`PaddedK`): the same scores. Chosen before the packages are made, from timings kept in the machine's profile by the
layers' shapes; the packages' cache key says which widths they compute at.
"""

from __future__ import annotations

import copy
import time
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.metrics.interleaved import medians_by_size
from dlrm_lab.model.interaction import DotInteractionArch

BLOCKS = (16, 32, 64)  # candidate K blocks: a 64-byte line of fp32, of 16-bit values, two lines of 16-bit values
MARGIN = 1.05  # a wider input serves where the layer's own K takes at least this much longer over the served batches
REPEATS = 5  # timings of each width at each size, interleaved, after one warm-up round
CALLS_PER_SIZE = 512  # rows a timing covers (at least 4 calls)
Timings = dict[str, dict[str, dict[int, float]]]  # ms: layer -> width -> batch size


class PaddedK(nn.Module):
    """A `Linear` computed over `width` >= its inputs: the input gains zero columns and the weight zero columns to
    meet them, so the outputs are the same. The pad fuses into the kernel that makes the input where Inductor
    compiles that kernel (a cast, the interaction's gather); the lab's interaction kernel writes its output this
    wide itself (`padded`), and an input already `width` wide is taken as it is."""

    def __init__(self, linear: nn.Linear, width: int) -> None:
        super().__init__()
        if width < linear.in_features:
            raise ValueError(f"a width of {width} is narrower than the layer's {linear.in_features} inputs")
        self.width, self.pad = width, width - linear.in_features
        self.weight = nn.Parameter(F.pad(linear.weight.detach(), (0, self.pad)), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x if x.shape[-1] == self.width else F.pad(x, (0, self.pad)), self.weight, self.bias)


def padded(dense_part: nn.Module, widths: dict[str, int], *, even: bool = False) -> nn.Module:
    """A copy of `dense_part` with each `Linear` named in `widths` computed at that width (`PaddedK`), and with
    `even` every remaining odd width made even (Inductor's C++ GEMM template takes its AMX micro-kernel only where
    K is a whole number of VNNI pairs, `check_amx_extra`); the original untouched. `dense_part` itself where
    nothing widens."""
    targets = {}
    for name, layer in dense_part.named_modules():
        if isinstance(layer, nn.Linear):
            width = max(widths.get(name, layer.in_features), layer.in_features)
            width += width % 2 if even else 0
            if width != layer.in_features:
                targets[name] = width
    if not targets:
        return dense_part
    wide = copy.deepcopy(dense_part)
    for name, width in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = wide.get_submodule(parent_name)
        setattr(parent, child, PaddedK(getattr(parent, child), width))
    _interaction_writes_width(wide)
    return wide


def _interaction_writes_width(dense_part: nn.Module) -> None:
    """Where the lab's interaction kernel feeds a widened first top layer, the kernel writes the zero columns as it
    writes its output: after a fallback op Inductor's pad is a copy of its own (kaggle, 256 samples, bf16, AMX: 85 us
    of masked vector code, as long as the wider K saved)."""
    inter, over = getattr(dense_part, "inter_arch", None), getattr(dense_part, "over_arch", None)
    if not isinstance(inter, DotInteractionArch) or not inter.native or over is None:
        return
    first = next((m for m in over.modules() if isinstance(m, (nn.Linear, PaddedK))), None)
    if isinstance(first, PaddedK):
        inter.out_width = first.width


def candidates(k: int) -> list[int]:
    """The widths a layer of `k` inputs is timed at: its own, then `k` rounded up to each block."""
    return sorted({k} | {-(-k // b) * b for b in BLOCKS})


def _timer(layer: nn.Linear, dtype: torch.dtype, size: int) -> Any:
    """ms a GEMM of `layer`'s shape takes over `size` rows at each width (timed by its name, a string)."""
    weights = {}
    for width in candidates(layer.in_features):
        weights[str(width)] = (
            torch.randn(size, width, dtype=dtype),
            torch.randn(layer.out_features, width, dtype=dtype),
            None if layer.bias is None else torch.randn(layer.out_features, dtype=dtype),
        )
    calls = max(4, CALLS_PER_SIZE // size)

    def timed(width: str) -> float:
        x, w, b = weights[width]
        start = time.perf_counter()
        for _ in range(calls):
            F.linear(x, w, b)
        return (time.perf_counter() - start) * 1e3 / calls

    return timed


def _time_layers(layers: dict[str, nn.Linear], dtype: torch.dtype, sizes: list[int], threads: int) -> Timings:
    """ms of a GEMM of each layer's shape at each candidate width and batch size (medians of interleaved rounds)."""
    with torch.inference_mode():
        return {
            name: medians_by_size(
                [str(w) for w in candidates(layer.in_features)],
                partial(_timer, layer, dtype),
                sizes,
                REPEATS,
                threads=threads,
            )
            for name, layer in layers.items()
        }


def choose_widths(module: Any, *, sizes: list[int], threads: int, log: Log | None = None) -> JsonObject:
    """Time each `Linear` of `module.dense` (a FusedDLRM's dense part, in its served dtype) whose K is not a whole
    number of the widest block at its own K and at each wider candidate, over batches of `sizes` rows on `threads`
    threads, and set the widths that are MARGIN faster as its packages' (`module.gemm_widths`); the record. The
    timings are kept in the machine's profile by the layers' shapes (a choice flipping between runs would make each
    run compile its packages anew): a later run reads them."""
    from dlrm_lab.metrics.measured import measured_choice
    from dlrm_lab.metrics.roofline import load_profile

    layers = {
        name: layer
        for name, layer in module.dense.named_modules()
        if isinstance(layer, nn.Linear) and len(candidates(layer.in_features)) > 1
    }
    shapes = sorted((name, layer.in_features, layer.out_features) for name, layer in layers.items())
    key = repr((module.precision, threads, list(sizes), shapes))
    timings, source = (
        measured_choice(
            load_profile(),
            "gemm_widths",
            key,
            read=lambda cached: _read(cached, layers, sizes),
            # chosen from the figures as stored: a later run reading them chooses the same (a ratio at the margin
            # flipped on the rounding once)
            measure=lambda: _rounded(_time_layers(layers, module.dtype, sizes, threads)),
            entry=lambda figures, _cached: {"ms": _stored(figures)},
            log=log,
        )
        if layers  # nothing to time: no entry (an empty one is a damaged one to the profile's check)
        else ({}, "nothing timed")
    )
    chosen: dict[str, int] = {}
    reasons = []
    for name, layer in layers.items():
        total = {w: sum(by.values()) for w, by in timings[name].items()}
        own, fastest = str(layer.in_features), min(total, key=lambda w: total[w])
        keep = fastest if total[own] >= MARGIN * total[fastest] else own
        if keep != own:
            chosen[name] = int(keep)
        reasons.append(
            f"{name} ({layer.in_features} -> {layer.out_features}) at {keep}: {total[own]:.4f} ms at its own K, "
            f"{total[fastest]:.4f} at {fastest}"
        )
    module.gemm_widths = chosen
    record: JsonObject = {
        "widths": dict(chosen),
        "margin": MARGIN,
        "reason": (
            f"each GEMM's K against K rounded up to {', '.join(map(str, BLOCKS))}, {module.precision}, {threads} "
            f"thread(s), summed over batches of {', '.join(map(str, sizes))} (medians of {REPEATS} interleaved; "
            f"{source}): " + ("; ".join(reasons) if reasons else "every layer's K is a whole number of blocks")
        ),
        "ms": _stored(timings),
    }
    if log is not None:
        log(f"GEMM widths {chosen or 'as the model has them'}: {record['reason']}")
    return record


def _rounded(timings: Timings) -> Timings:
    return {
        name: {w: {n: round(ms, 5) for n, ms in by.items()} for w, by in ws.items()} for name, ws in timings.items()
    }


def _stored(timings: Timings) -> JsonObject:
    return {
        name: {w: {str(n): ms for n, ms in by.items()} for w, by in ws.items()}
        for name, ws in _rounded(timings).items()
    }


def _read(cached: JsonObject, layers: dict[str, nn.Linear], sizes: list[int]) -> Timings | None:
    """The timings of a profile's entry (`metrics.measured.cached_problem` checked its numbers), None where a layer,
    width or size is missing."""
    stored = cast(dict[str, Any], cached["ms"])  # a table of tables of numbers (`cached_problem` checked it)
    timings: Timings = {}
    for name, layer in layers.items():
        widths = stored.get(name)
        want = [str(w) for w in candidates(layer.in_features)]
        if not isinstance(widths, dict) or any(not isinstance(widths.get(w), dict) for w in want):
            return None
        if any(str(n) not in widths[w] for w in want for n in sizes):
            return None
        timings[name] = {w: {n: float(widths[w][str(n)]) for n in sizes} for w in want}
    return timings
