"""What every benchmark's results file starts with, and where it goes: one place for all the scripts.

results = header(shape=...)           # date (UTC), the CPU and its GEMM-deciding flags, then yours
write_results(results_path("serve", opts.out), results)
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
    """The date (UTC, to the second), the CPU model and its avx/amx/fma flags, then `fields`."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        **fields,
    }


def lab_run(tmp: Path, *args: str) -> Path:
    """Run `dlrm-lab ARGS` with a metrics directory of its own under `tmp`; the run directory it made
    (the command's output tails end the benchmark when it fails)."""
    root = tmp / f"run-{len(list(tmp.iterdir()))}"
    cmd = [sys.executable, "-m", "dlrm_lab", *args, "--metrics-dir", str(root), "--no-progress"]
    print("$", " ".join(cmd[2:]), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return run_dir


RESULTS = HERE / "results"  # every benchmark's results files, named in BENCHMARKS.md


def results_path(name: str, out: str | Path | None = None) -> Path:
    """`out` when given, else results/results-<name>-<today, UTC>.json beside the scripts."""
    if out:
        return Path(out)
    RESULTS.mkdir(exist_ok=True)
    return RESULTS / f"results-{name}-{datetime.now(timezone.utc).strftime('%Y-%m-%d')}.json"


def write_results(path: str | Path, results: dict[str, Any]) -> Path:
    """`results` as indented JSON (numpy numbers as numbers, anything else unknown as its text)."""
    path = Path(path)
    path.write_text(json.dumps(results, indent=2, default=_plain) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else str(value)
