"""A per-rank watchdog: no step for `--timeout` seconds ends this rank, naming it.

The process-group timeout covers most collectives, but not every wait honours it (a
rank blocked in DDP's gradient all-reduce behind a stopped peer waits for good). The
main thread is then inside C++ and cannot be interrupted, so the watchdog thread marks
the run failed (rows already flushed stay; the runs command merges them), prints one
line naming the rank, and exits the process with status 1; the launcher then stops the
other ranks.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, on_expire: Callable[[str], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.on_expire = on_expire
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dlrm-lab-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Progress was made (a step, an evaluation, a checkpoint finished)."""
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                message = (
                    f"rank {self.rank}: no training progress for {idle:.0f}s: another rank is stuck or dead "
                    f"(--timeout {self.timeout_s:g}s)"
                )
                try:
                    if self.on_expire is not None:
                        self.on_expire(message)
                finally:
                    print(f"error: {message}", file=sys.stderr, flush=True)
                    os._exit(1)  # the main thread is blocked in C++: nothing else can end it
