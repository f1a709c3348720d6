"""Whether a machine profile can be trusted: what else the machine did while it was probed, and whether
the profile still agrees with the machine now.

A probe taken while other work ran stored a 2-thread fp32 GEMM peak of 2.2 GFLOP/s on a machine that
does 197, and every later precision choice, roofline fraction and latency floor read it. So:

- `metrics.cpu.LoadWatch` measures, around a probe, the CPU time of every other process (cores' worth), the host's
  steal and the spread of the probe's own GEMM repeats; `judge` says whether the probe can be trusted
  (`OTHER_CORES_LIMIT`, `STEAL_LIMIT`, `SPREAD_LIMIT`), recorded in the profile's `load`;
- `quick_check` times one small fp32 GEMM now (tens of ms), through each product the peak is the better of, and
  compares it with the profile's one-thread peak: beyond `AGREEMENT_MARGIN` either way, one warning line (a spoiled
  profile, or a busy machine now).

Hand-written: no library judges a benchmark's own host while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from dlrm_lab.config.values import JsonObject, Log

OTHER_CORES_LIMIT = 0.25  # other processes' CPU time while probing, in cores: beyond it the probe competed
STEAL_LIMIT = 0.05  # the hypervisor's share of the cores' time taken for other guests
SPREAD_LIMIT = 1.5  # slowest over fastest repeat of a GEMM peak: beyond it the repeats were disturbed
AGREEMENT_MARGIN = 2.0  # profile vs a GEMM timed now: a factor beyond this either way is warned of
CHECK_SIZE = 512  # the quick check's GEMM (fp32, one thread; ~1.5 ms a product at 180 GFLOP/s)


@dataclass
class Load:
    """What else the machine did during a probe, and the verdict."""

    seconds: float
    other_cores: float  # other processes' CPU seconds per second of the probe
    steal_share: float  # of all cores' time
    gemm_spread: float  # the worst slowest/fastest repeat ratio among the GEMM peaks
    trusted: bool
    why: str

    def to_dict(self) -> dict[str, float | bool | str]:
        return asdict(self)


def judge(seconds: float, other_cores: float, steal_share: float, gemm_spread: float) -> Load:
    """The verdict on a probe from what it saw."""
    problems = []
    if other_cores > OTHER_CORES_LIMIT:
        problems.append(f"other processes used {other_cores:.2f} cores (limit {OTHER_CORES_LIMIT:g})")
    if steal_share > STEAL_LIMIT:
        problems.append(f"the host stole {steal_share:.0%} of the cores' time (limit {STEAL_LIMIT:.0%})")
    if gemm_spread > SPREAD_LIMIT:
        problems.append(f"GEMM repeats differed {gemm_spread:.2f}x (limit {SPREAD_LIMIT:g}x)")
    why = "; ".join(problems) or (
        f"quiet: other processes {other_cores:.2f} cores, steal {steal_share:.1%}, GEMM repeats within "
        f"{gemm_spread:.2f}x"
    )
    return Load(seconds, other_cores, steal_share, gemm_spread, not problems, why)


def quick_gemm_flops(threads: int = 1, size: int = CHECK_SIZE, repeats: int = 7) -> float:
    """The best fp32 FLOP/s of a few `size`-square products on `threads` threads (tens of ms), through each product
    the profile's fp32 peak is the better of (`fp32_cpu_products`): timed through torch's `mm` alone, an AMD EPYC's
    quiet machine read 2.1x "busy" against a peak that oneDNN's product set."""
    import torch

    from dlrm_lab.metrics.device_peaks import fp32_cpu_products

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for product, ready in fp32_cpu_products().values():
            a = ready(torch.randn(size, size))
            product(a, a)
            for _ in range(repeats):
                t0 = time.perf_counter()
                product(a, a)
                best = max(best, 2 * size**3 / max(time.perf_counter() - t0, 1e-9))
        return best
    finally:
        torch.set_num_threads(saved)


def quick_check(profile: JsonObject | None, measure: Callable[[], float] = quick_gemm_flops) -> str | None:
    """One warning line when the profile's one-thread fp32 GEMM peak and one timed now differ by more than
    AGREEMENT_MARGIN (None when they agree, or there is no CPU peak to compare)."""
    read: Any = profile  # as read from disk: a step missing, or None, or of another type, is caught below
    try:
        stored = float(read["devices"]["cpu"]["threads"]["1"]["gemm_flops_per_s"]["fp32"])
    except (KeyError, TypeError, ValueError):
        return None
    now = measure()
    if stored <= 0 or now <= 0:
        return None
    when = profile.get("probed_at") if profile else None
    if stored * AGREEMENT_MARGIN < now:
        return (
            f"warning: the machine profile's fp32 GEMM peak ({stored / 1e9:,.1f} GFLOP/s, probed {when}) is "
            f"{now / stored:.1f}x below what this machine does now ({now / 1e9:,.1f} GFLOP/s): it was probed "
            "under load; every floor and roof reads it: run 'dlrm-lab machine probe --force' on an idle "
            "machine"
        )
    if now * AGREEMENT_MARGIN < stored:
        return (
            f"warning: this machine does {now / 1e9:,.1f} GFLOP/s of fp32 GEMM now, {stored / now:.1f}x below "
            f"its profile ({stored / 1e9:,.1f} GFLOP/s, probed {when}): it is busy with other work, so this "
            "run's figures describe a shared machine"
        )
    return None


def check_stored_profile(log: Log | None) -> str | None:
    """`quick_check` of this machine's stored profile (none stored: nothing to check), said in `log`."""
    from dlrm_lab.metrics.roofline import load_profile

    warning = quick_check(load_profile())
    if warning and log:
        log(warning)
    return warning
