"""Dense precision chosen by measurement (`--precision auto`).

Which precision is fast is a property of the machine, not of the code: bf16 GEMMs ran 43x
slower than fp32 on an AVX2-only EPYC and 2-7x faster on CPUs with AVX-512 bf16 or AMX.
So the lab times the matrix products of the model being run (its MLP and cross layers, at
the batch rows and thread count it will use) in every candidate precision and picks a
lower one only where it is measurably faster than fp32:

- candidates: the precisions the command accepts (training fp32/bf16, inference also fp16);
- rule: the fastest candidate whose rate is at least `MARGIN` x the fp32 rate, else fp32
  (a tie goes to fp32: same speed, better numerics);
- the rates are cached in this machine's profile (`dlrm-lab machine probe`) under the
  shapes, thread count and device, so they are measured once per machine and model shape;
  a machine never seen before gets a quick probe first (a few seconds), so that every run
  is also placed on the roofline.

An explicit lower precision that the rates say is slower still runs; `choose_precision`
returns a warning line with both rates for the caller to print. The choice, the rates and
where they came from go into the run's manifest (`PrecisionChoice.to_dict`).

Hand-written: no library measures this on the model's own shapes.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Required, TypedDict, cast

import torch

from dlrm_lab.config.family import family_of
from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import FieldError

AUTO = "auto"
MARGIN = 1.15  # a lower precision must be this much faster than fp32 to be chosen (beyond timing noise)
MAX_ROWS = 512  # GEMM rows timed: a larger batch runs at the same rate per FLOP
# Below this much fp32 GEMM time per forward pass the products are too small for their
# precision to matter (call overheads decide, and the rates are noise): fp32 it is.
NEGLIGIBLE_S = 100e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Shape = tuple[int, int, int]  # rows x in x out of one product
Measure = Callable[[Sequence[Shape], Sequence[str], torch.device, int], dict[str, float]]


def gflops(flops_per_s: float) -> str:
    """A rate in GFLOP/s to 0.1, and to three significant figures below 1 (a tiny model's 0.042 is not 0.0)."""
    g = flops_per_s / 1e9
    return f"{g:,.1f}" if g >= 1 else f"{g:.3g}"


def model_gemm_shapes(spec: Any, rows: int) -> list[Shape]:
    """The dense matrix products of one forward pass: (rows, in, out) per layer, as the spec's family has them."""
    return family_of(spec).gemm_shapes(spec, rows, MAX_ROWS)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_shape_rates(
    shapes: Sequence[Shape], precisions: Sequence[str], device: torch.device, threads: int, repeats: int = 5
) -> dict[str, float]:
    """FLOP/s of the products `shapes` in each precision, at `threads` CPU threads: the
    median of `repeats` timings taken in turn. A precision whose first pass is already 4x
    slower than fp32's is timed once: it has lost, and repeating a slow kernel only costs time."""
    saved = torch.get_num_threads()
    flops = sum(2 * m * k * n for m, k, n in shapes)
    generator = torch.Generator().manual_seed(0)
    try:
        if device.type == "cpu":
            torch.set_num_threads(max(1, threads))
        passes: dict[str, Callable[[], float]] = {}
        first: dict[str, float] = {}
        for name in sorted(precisions, key=lambda p: p != "fp32"):
            dtype = DTYPES[name]
            pairs = [
                (
                    torch.randn(m, k, generator=generator).to(device=device, dtype=dtype),
                    torch.randn(k, n, generator=generator).to(device=device, dtype=dtype),
                )
                for m, k, n in shapes
            ]

            def one_pass(pairs: list[tuple[torch.Tensor, torch.Tensor]] = pairs) -> float:
                t0 = time.perf_counter()
                for a, b in pairs:
                    torch.mm(a, b)
                _sync(device)
                return time.perf_counter() - t0

            one_pass()  # warm-up: kernel selection, caches
            passes[name], first[name] = one_pass, one_pass()
        # those already 4x slower than fp32 have lost: their one pass stands
        timed: dict[str, list[float]] = {p: [] for p in passes if p == "fp32" or first[p] <= 4 * first["fp32"]}
        inner = {p: max(1, int(0.02 / max(first[p], 1e-6))) for p in timed}  # ~20 ms of work a timing
        for _ in range(repeats):  # in turn, so that drift hits every precision alike
            for p, samples in timed.items():
                samples.append(sum(passes[p]() for _ in range(inner[p])) / inner[p])
        seconds = {p: statistics.median(timed[p]) if p in timed else first[p] for p in passes}
    finally:
        torch.set_num_threads(saved)
    return {p: flops / seconds[p] for p in passes}


@dataclass(frozen=True)
class PrecisionChoice:
    """What ran, what was asked, and the measurements behind it."""

    requested: str
    precision: str
    reason: str
    rates_flops_per_s: dict[str, float] = field(default_factory=dict)
    source: str = ""
    warning: str | None = None
    shapes: tuple[Shape, ...] = ()
    threads: int = 1
    device: str = "cpu"
    negligible: bool = False  # the GEMMs take too little time for precision to matter

    @property
    def line(self) -> str:
        """What to tell the user: the warning if there is one, else what runs and why."""
        return f"warning: {self.warning}" if self.warning else f"precision {self.precision}: {self.reason}"

    def to_dict(self) -> JsonObject:
        return {
            "requested": self.requested,
            "precision": self.precision,
            "reason": self.reason,
            "gemm_gflops_per_s": {k: round(v / 1e9, 3) for k, v in self.rates_flops_per_s.items()},
            "source": self.source,
            "margin": MARGIN,
            "warning": self.warning,
            "shapes_rows_in_out": [list(s) for s in self.shapes],
            "threads": self.threads,
            "device": self.device,
            "negligible": self.negligible,
        }


class _Shared(TypedDict, total=False):
    """What the precision choices of one `choose_precision` share: the request, then the rates it was made from."""

    requested: Required[str]
    threads: Required[int]
    device: Required[str]
    rates_flops_per_s: dict[str, float]
    source: str
    shapes: tuple[Shape, ...]


def _rate_key(device: torch.device, threads: int, shapes: Sequence[Shape]) -> str:
    digest = hashlib.sha1(repr(list(shapes)).encode()).hexdigest()[:12]
    where = f"cpu/{threads}t" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
    return f"{where}/{shapes[0][0]}rows/{digest}"


def _ensure_profile(device: torch.device, log: Log | None) -> JsonObject:
    """This machine's profile; a quick probe (stored) when the machine was never seen."""
    from dlrm_lab.metrics.probe import probe_machine
    from dlrm_lab.metrics.roofline import ProfileNotStored, load_profile, save_profile

    profile = load_profile()
    if profile is not None:
        return profile
    if log:
        log("machine not seen before: quick probe of its peaks (seconds; 'dlrm-lab machine probe' for the full one)")
    devices = ["cpu", "cuda"] if device.type == "cuda" else ["cpu"]
    probed = probe_machine(quick=True, devices=devices, comms=False)  # under a launcher rank 0 alone is here
    try:
        save_profile(probed)
    except ProfileNotStored as exc:  # the run goes on with the peaks just measured
        if log:
            log(f"warning: {exc}")
    return cast(JsonObject, probed)  # a JSON object, passed on as load_profile passes one


def gemm_rates(
    spec: Any,
    precisions: Sequence[str],
    *,
    device: torch.device,
    threads: int,
    rows: int,
    probe: bool = True,
    measure: Measure | None = None,
    log: Log | None = None,
) -> tuple[dict[str, float], str, tuple[Shape, ...]]:
    """FLOP/s of the model's products in each precision, from this machine's profile (measured
    and stored there on first use); with where they came from, and the shapes."""
    from dlrm_lab.metrics.measured import measured_choice
    from dlrm_lab.metrics.roofline import load_profile

    shapes = tuple(model_gemm_shapes(spec, rows))
    profile = _ensure_profile(device, log) if probe else load_profile()

    def read(cached: JsonObject) -> dict[str, float] | None:
        # a cached entry's flops_per_s is a table (`measured.cached_problem` checked it)
        stored = cached["flops_per_s"]
        return dict(stored) if isinstance(stored, dict) and all(p in stored for p in precisions) else None

    rates, source = measured_choice(
        profile,
        "precision_rates",
        _rate_key(device, threads, shapes),
        read=read,
        measure=lambda: (measure or measure_shape_rates)(shapes, list(precisions), device, threads),
        entry=lambda rates, _: {"flops_per_s": rates, "shapes": [list(s) for s in shapes]},
        log=log,
    )
    return rates, source, shapes


def choose_precision(
    requested: str,
    spec: Any,
    *,
    allowed: Sequence[str],
    device: torch.device | str = "cpu",
    threads: int | None = None,
    rows: int = MAX_ROWS,
    measure: Measure | None = None,
    log: Log | None = None,
) -> PrecisionChoice:
    """Resolve `requested` (auto or one of `allowed`) into the precision to run.

    auto: measured (see the module docstring). An explicit fp32 is taken as it is, without
    measuring. An explicit lower precision is taken too, but its rate is compared with
    fp32's (measured if not cached) and a warning returned when it is slower.
    """
    device = torch.device(device)
    if requested != AUTO and requested not in allowed:
        raise FieldError("precision", f"{requested!r}: allowed: auto, {', '.join(allowed)}")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        allowed = [p for p in allowed if p != "bf16"]  # pre-Ampere GPUs emulate it
    threads = threads or torch.get_num_threads()
    common: _Shared = {"requested": requested, "threads": threads, "device": str(device)}
    if requested == "fp32":
        return PrecisionChoice(precision="fp32", reason="asked for (--precision fp32); not measured", **common)
    if requested != AUTO and requested not in allowed:
        raise FieldError("precision", f"{requested}: this {device.type} device has no fast {requested} GEMMs")
    candidates = list(dict.fromkeys(["fp32", *(allowed if requested == AUTO else [requested])]))
    rates, source, shapes = gemm_rates(
        spec, candidates, device=device, threads=threads, rows=rows, probe=requested == AUTO, measure=measure, log=log
    )
    fp32 = rates["fp32"]
    common.update({"rates_flops_per_s": rates, "source": source, "shapes": shapes})

    def vs(p: str) -> str:
        return f"{p} {gflops(rates[p])} GFLOP/s vs fp32 {gflops(fp32)} GFLOP/s"

    if requested != AUTO:
        warning = None
        if rates[requested] < fp32:
            warning = (
                f"--precision {requested} is slower than fp32 on this machine for {spec.name}'s GEMMs "
                f"({vs(requested)}, {threads} thread{'s' if threads != 1 else ''}); running {requested} as asked "
                "(--precision auto picks the faster)"
            )
        return PrecisionChoice(precision=requested, reason=f"asked for ({vs(requested)})", warning=warning, **common)
    fp32_pass_s = sum(2 * m * k * n for m, k, n in shapes) / fp32
    if fp32_pass_s < NEGLIGIBLE_S:
        reason = (
            f"auto: the model's GEMMs take {fp32_pass_s * 1e6:.0f} us a pass in fp32: too little for precision to "
            "matter, so fp32"
        )
        return PrecisionChoice(precision="fp32", reason=reason, negligible=True, **common)
    faster = [p for p in candidates if p != "fp32" and rates[p] >= MARGIN * fp32]
    if faster:
        best = max(faster, key=lambda p: rates[p])
        reason = f"auto: {best} is {rates[best] / fp32:.2f}x fp32 ({vs(best)}) on the model's GEMMs"
        return PrecisionChoice(precision=best, reason=reason, **common)
    others = ", ".join(f"{p} {rates[p] / 1e9:,.1f}" for p in candidates if p != "fp32")
    reason = (
        f"auto: fp32 {fp32 / 1e9:,.1f} GFLOP/s on the model's GEMMs; no lower precision is {MARGIN:g}x faster "
        f"({others} GFLOP/s)"
    )
    return PrecisionChoice(precision="fp32", reason=reason, **common)


def contenders(choice: PrecisionChoice, share: float = 1 / MARGIN) -> list[str]:
    """Precisions worth searching over: those within `share` of the fastest measured rate
    (a clear loser cannot win a latency-bounded search, a near tie can). The chosen
    precision alone when nothing was measured."""
    rates = choice.rates_flops_per_s
    if not rates or choice.negligible:
        return [choice.precision]
    best = max(rates.values())
    return [p for p in rates if rates[p] >= share * best]
