"""What every benchmark's results file starts with, and where it goes: one place for all the scripts.

results = header(shape=...)           # date (UTC), the CPU and its GEMM-deciding flags, a canary reading, then yours
canary_mark(results, "after the fp32 repeats")   # another reading, named, where a benchmark moves between phases
write_results(results_path("serve", opts.out), results)   # a last reading; the canary's median and spread
run_dir = lab_run(tmp, "infer", "run", ...)   # one dlrm-lab command in its own metrics dir; its run
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_lab.metrics.hardware import cpu_flags, cpu_model

HERE = Path(__file__).parent


def header(**fields: Any) -> dict[str, Any]:
    """The date (UTC, to the second), the CPU model and its avx/amx/fma flags, a first speed-canary reading, then
    `fields`."""
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "canary": {"readings": []},
        **fields,
    }
    canary_mark(results, "start")
    return results


def canary_mark(results: dict[str, Any], label: str) -> float | None:
    """One speed-canary reading now (`metrics.canary.canary_now`: a GEMM and a gather, ~1 ms, against the machine
    profile's quiet reading), kept in `results["canary"]` under `label`: every figure a benchmark writes then sits
    beside the host's speed in its phase (issue 60). None where the machine was never probed."""
    from dlrm_lab.metrics.canary import canary_now
    from dlrm_lab.metrics.roofline import load_profile

    ratio = canary_now(load_profile())
    results.setdefault("canary", {"readings": []})["readings"].append({"label": label, "ratio": ratio})
    return ratio


def lab_run(tmp: Path, *args: str) -> Path:
    """Run `dlrm-lab ARGS` with a metrics directory of its own under `tmp`; the run directory it made
    (the command's output tails end the benchmark when it fails)."""
    root = tmp / f"run-{len(list(tmp.iterdir()))}"
    cmd = [sys.executable, "-m", "dlrm_lab", *args, "--metrics-dir", str(root), "--no-progress"]
    print("$", " ".join(cmd[2:]), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise child_failed(f"dlrm-lab {' '.join(args[:2])}", out)
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return run_dir


def child_failed(what: str, out: subprocess.CompletedProcess[Any]) -> SystemExit:
    """What a benchmark ends with when a child it ran failed: how it ended (the signal that killed it, and the OOM
    killer where it ran: a run killed during its builds printed only "failed:") and the tails of its output."""
    from dlrm_lab.errors import exit_description

    tails = "\n".join(str(t)[-3000:] for t in (out.stdout, out.stderr) if t)
    return SystemExit(f"{what} {exit_description(out.returncode)}:\n{tails}")


RESULTS = HERE / "results"  # every benchmark's results files, named in BENCHMARKS.md


def tables_on_huge_pages(modules: list[Any]) -> Any:
    """Each distinct table tensor of these served modules (siblings share their base's) backed by 2 MiB pages, in
    place, as an instance's mapped tables are where `--table-pages auto` picks them: its `PagesResult`."""
    from dlrm_lab.infer.table_lookup import table_weights
    from dlrm_lab.metrics.huge_pages import back_with_huge_pages

    tables = {t.data_ptr(): t for t in (table_weights(m.tables) for m in modules)}
    return back_with_huge_pages(list(tables.values()))


def results_path(name: str, out: str | Path | None = None) -> Path:
    """`out` when given, else results/results-<name>-<today, UTC>.json beside the scripts."""
    if out:
        return Path(out)
    RESULTS.mkdir(exist_ok=True)
    return RESULTS / f"results-{name}-{datetime.now(timezone.utc).strftime('%Y-%m-%d')}.json"


def write_results(path: str | Path, results: dict[str, Any]) -> Path:
    """`results` as indented JSON (numpy numbers as numbers, anything else unknown as its text), after a last canary
    reading: the readings' median and range beside the figures (`canary r` in BENCHMARKS.md)."""
    path = Path(path)
    # the header's readings, where a script keeps its header at the top level or under "header"
    holder = (
        results if "canary" in results else results.get("header") if isinstance(results.get("header"), dict) else None
    )
    if holder is not None and "canary" in holder:
        canary_mark(holder, "end")
        ratios = [r["ratio"] for r in holder["canary"]["readings"] if r["ratio"] is not None]
        if ratios:
            holder["canary"].update(median=float(np.median(ratios)), low=min(ratios), high=max(ratios))
            print(
                f"canary r {holder['canary']['median']:.2f} ({min(ratios):.2f}-{max(ratios):.2f}, "
                f"{len(ratios)} readings): the host's speed against its quiet profile while this ran",
                flush=True,
            )
    path.write_text(json.dumps(results, indent=2, default=_plain) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else str(value)
