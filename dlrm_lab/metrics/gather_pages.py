"""Whether this machine's embedding gather runs faster on 2 MiB pages than on 4 KiB ones: the machine probe's
figures (`gather_pages`), read by the choices that put tables on huge pages (training's `--table-pages`, the serving
snapshot's)."""

from __future__ import annotations

from typing import Any, cast

from dlrm_lab.errors import UserError
from dlrm_lab.metrics import device_peaks
from dlrm_lab.metrics.roofline import load_profile

PAGES_MARGIN = 1.05  # huge pages are taken where this machine's gather on them was at least this much faster


def gather_page_rates(threads: int, measure: bool = True) -> tuple[Any, str]:
    """This machine's embedding gather on 4 KiB and on 2 MiB pages at `threads` threads: the probe's figures
    (`metrics.probe`, `gather_pages`), or measured now at the quick probe's sizes where the profile has none (None
    without `measure`, and why)."""
    try:
        profile = load_profile() or {}
    except UserError:
        profile = {}
    devices = cast("dict[str, Any]", profile.get("devices") or {})  # the profile's devices: an object
    by_threads = (devices.get("cpu") or {}).get("threads") or {}
    probed = {
        int(n): p["gather_pages"]
        for n, p in by_threads.items()
        if isinstance((p or {}).get("gather_pages"), dict) and p["gather_pages"].get("base_bytes_per_s")
    }
    if probed:  # the choice reads the two pages' ratio: the nearest thread count probed tells it
        near = min(probed, key=lambda n: (abs(n - threads), -n))
        return probed[near], f"the machine probe of {profile.get('probed_at')} at {near} thread(s)"
    if not measure:
        return None, "this machine's profile has no gather on 2 MiB pages (`dlrm-lab machine probe` measures one)"
    sizes = device_peaks.ProbeSizes.preset(quick=True)
    measured = device_peaks.gather_on_pages(sizes, 2 * sizes.repeats + 1)
    return measured, f"measured now ({sizes.gather_tables} tables of {sizes.gather_rows:,} rows; the probe has none)"


def pages_faster(threads: int, measure: bool = True) -> tuple[bool, str]:
    """Whether this machine's gather measured at least PAGES_MARGIN faster on 2 MiB pages, and the line saying so
    (without `measure`, only where the machine's profile holds the figures)."""
    rates, source = gather_page_rates(threads, measure)
    if rates is None:
        return False, source
    base, huge = rates.get("base_bytes_per_s"), rates.get("huge_bytes_per_s")
    if not huge or not base:
        return False, f"no gather on 2 MiB pages could be measured ({rates.get('huge_error')})"
    faster = huge >= PAGES_MARGIN * base
    return faster, (
        f"an embedding gather ran {huge / 1e9:.2f} GB/s on 2 MiB pages against {base / 1e9:.2f} on 4 KiB "
        f"({source}): " + ("huge pages are faster" if faster else f"huge pages not {PAGES_MARGIN:.2f}x faster")
    )


def auto_pages(threads: int, measure: bool = True) -> tuple[str, str]:
    """`--table-pages auto`'s pages where the tables are in host memory: huge where Linux has transparent huge pages
    and `pages_faster`, else base; and the line saying why."""
    from dlrm_lab.metrics.huge_pages import unsupported

    if (why := unsupported()) is not None:
        return "base", why
    faster, reason = pages_faster(threads, measure)
    return ("huge" if faster else "base"), reason
