"""A process's open runs, marked failed the moment it dies without closing them (a kernel's SIGSEGV, SIGKILL).

    python dlrm_lab/metrics/watch.py PID DIRECTORY

A dying process cannot write its own manifest: one small watcher per process (`Run.create` starts it with the
first run) waits for it to end, then marks every run still listed in DIRECTORY (one file per open run, holding
its directory; removed when the run closes) as `metrics.run.recover_run` would: its parts merged, `failed`, the
fatal signal named from its fault log. Runs as a file, not `-m`, so that a watcher costs an interpreter and the
standard library only, until a run needs marking. `runs recover` later rebuilds what a kind's recovery adds.

Hand-written: no library watches another process's run records.
"""

from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path


def wait_for_exit(pid: int) -> None:
    """Return once process `pid` has ended (a pidfd where the kernel has them, else polled)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            select.select([fd], [], [])  # a pidfd turns readable when its process ends
        finally:
            os.close(fd)
        return
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(0.5)


def mark_left_open(directory: Path) -> None:
    """Mark each run still listed in `directory` failed (`recover_run`), and take it off the list."""
    for entry in sorted(directory.glob("*")):
        try:
            run_dir = Path(entry.read_text().strip())
            if run_dir.is_dir():
                from dlrm_lab.metrics.run import recover_run  # only now: pyarrow and the lab

                recover_run(run_dir)
        except Exception:  # noqa: BLE001, S110 - another run may still be marked; `runs recover` sees this one
            pass
        finally:
            entry.unlink(missing_ok=True)


def main(argv: list[str]) -> None:
    pid, directory = int(argv[0]), Path(argv[1])
    wait_for_exit(pid)
    if directory.is_dir():
        mark_left_open(directory)
        directory.rmdir()


if __name__ == "__main__":
    main(sys.argv[1:])
