"""MLPerf LoadGen in a process of its own: its scheduler and its callbacks beside the serving process, not in it.

LoadGen measures a query from its scheduled time, so any wait in its issue callback is charged to the system under
test. In the serving process that callback (Python) waits for the GIL the batcher, completions and records hold:
tiny, 1x1, LoadGen's p99 was 1.5x the lab's own for the same queries. The best CPU submitters run LoadGen's thread
alone in its process (Intel's DLRMv2 runner); so does this: LoadGen's FastSUT issue callback sends (tags, sample
indices, the time it was called) down a pipe, the serving process submits those queries and sends the tags it
finished back, and a thread here reports them to LoadGen in one `QuerySamplesComplete` a message.

Torch-free (it imports only LoadGen and the lab's errors), so that the process starts in well under a second.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

from dlrm_lab.errors import end_with_parent

ISSUE, END = "issue", "end"  # the messages LoadGen's process sends: a call of its issue callback; its test's end


def test_settings(fields: dict[str, Any]) -> Any:
    """LoadGen's TestSettings from plain values (`scenario` and `mode` by their enum names): built where LoadGen runs,
    as its settings object cannot cross a process."""
    import mlperf_loadgen as lg

    s = lg.TestSettings()
    for name, value in fields.items():
        if name == "scenario":
            value = getattr(lg.TestScenario, value)
        elif name == "mode":
            value = getattr(lg.TestMode, value)
        setattr(s, name, value)
    return s


def log_settings(log_dir: str) -> Any:
    import mlperf_loadgen as lg

    log = lg.LogSettings()
    log.log_output.outdir = log_dir
    log.log_output.copy_summary_to_stdout = False
    log.enable_trace = False
    return log


def loadgen_main(fields: dict[str, Any], samples: int, log_dir: str, issue_conn: Any, done_conn: Any) -> None:
    """The process's entry point: one LoadGen test of `samples` samples (all loaded by the serving process before
    it started), then (END, error or None, seconds it ran) down `issue_conn`, and exit."""
    end_with_parent()
    error: str | None = None
    seconds = 0.0
    try:
        import mlperf_loadgen as lg

        send_lock = threading.Lock()  # LoadGen may issue from more than one thread

        def issue(tags: list[int], indices: list[int]) -> None:
            now = time.monotonic_ns()  # one clock across processes (CLOCK_MONOTONIC): the query's scheduled time
            with send_lock:
                issue_conn.send((ISSUE, tags, indices, now))

        def complete() -> None:
            while True:
                try:
                    tags = done_conn.recv()
                except (EOFError, OSError):
                    return
                if tags is None:
                    return
                lg.QuerySamplesComplete([lg.QuerySampleResponse(t, 0, 0) for t in tags])

        sut = lg.ConstructFastSUT(issue, lambda: None)
        qsl = lg.ConstructQSL(samples, samples, lambda _indices: None, lambda _indices: None)
        threading.Thread(target=complete, name="loadgen-complete", daemon=True).start()
        gc.collect()
        gc.freeze()
        start = time.monotonic()
        lg.StartTestWithLogSettings(sut, qsl, test_settings(fields), log_settings(log_dir))
        seconds = time.monotonic() - start
    except BaseException as exc:  # noqa: BLE001 - told to the serving process, which fails the run with it
        error = f"{type(exc).__name__}: {exc}"
    try:
        issue_conn.send((END, error, seconds))
        issue_conn.close()
    finally:
        os._exit(0)  # LoadGen's C++ threads may still be alive: an interpreter's normal exit would abort on them
