"""A run's fault log: where Python's fault handler writes its report if the run's process dies of a fatal signal
(a kernel's SIGSEGV), and the reason a dead run is marked with, read from it (`metrics.run.recover_run`)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

FAULT_LOG = "fault.log"  # Python's fault handler writes here if the run's process dies of a fatal signal
_FATAL = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
_fault_files: dict[Path, Any] = {}


def open_fault_log(run_dir: Path) -> None:
    """Have Python's fault handler write its report of a fatal signal (a kernel's SIGSEGV) into the run, so that
    a run whose process died that way is marked with the signal (`recover_run`), not only as gone."""
    import faulthandler

    try:
        handle = open(run_dir / FAULT_LOG, "w")  # noqa: SIM115 - open for the run's life: the handler needs the fd
    except OSError:
        return
    _fault_files[run_dir] = handle
    faulthandler.enable(file=handle, all_threads=True)


def close_fault_log(run_dir: Path) -> None:
    """The run closed: the fault handler goes back to stderr (where Python and pytest keep it), an empty log away."""
    import faulthandler

    handle = _fault_files.pop(run_dir, None)
    if handle is None:
        return
    # without a stderr at start (None) the handler takes sys.stderr, as it does when given None
    faulthandler.enable(file=sys.__stderr__ or sys.stderr, all_threads=True)
    handle.close()
    with contextlib.suppress(OSError):
        if (run_dir / FAULT_LOG).stat().st_size == 0:
            (run_dir / FAULT_LOG).unlink()


def crash_reason(run_dir: Path) -> str:
    """Why a run's process ended without closing it: the fatal signal its fault log names, or a crash or kill."""
    try:
        first = (run_dir / FAULT_LOG).read_text(errors="replace").strip().splitlines()[0]
    except (OSError, IndexError):
        return "process ended without closing the run (crash or kill)"
    what = first.removeprefix("Fatal Python error: ").strip()
    signal_name = _FATAL.get(what)
    named = f"killed by signal {signal_name} ({what})" if signal_name else what
    return f"process {named}; Python's report in {FAULT_LOG}"
