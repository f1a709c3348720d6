"""torchrun, with a failed job told in one line: `main(ARGS)` takes torchrun's arguments and runs
torch's own elastic launcher in this process (the command is `python -m dlrm_lab.torchrun`).

What it adds to plain torchrun (which prints a ChildFailedError traceback and, for a rank
killed by a signal, leaves the run's manifest saying only that the launcher stopped rank 0):
- one line naming the rank that failed first, its pid and its signal or exit code;
- the file `RUN_RECORD_ENV` names, where each run the ranks create writes its directory, handed with that
  reason to the caller's `on_failure` (`dlrm_lab.torchrun` writes it into their manifests);
- the ranks left alive get `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (default here 5 s, torch's 30 s)
  to end after SIGTERM before SIGKILL, so a stopped or hung rank does not hold the job. Their
  rows are safe when killed: parts are flushed as they go and the runs are recovered on failure.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlrm_lab.config.values import env_seconds
from dlrm_lab.errors import exit_description

SHUTDOWN_TIMEOUT_S = 5
# The launcher names a file here; each run created under it appends its directory (`metrics.run`)
RUN_RECORD_ENV = "DLRM_LAB_RUN_RECORD"


def root_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure that started it. torch lists failures in the order it saw them, with the
    ranks it then stopped (SIGTERM, SIGKILL after the grace) after them, stamped to the
    second. Among those seen first (same second), a rank killed by a signal is the cause:
    it could not say why, and the others (a collective failed) followed it."""
    first = min(failure.timestamp for failure in failures.values())
    seen_first = [rank for rank, failure in failures.items() if failure.timestamp == first]
    killed = [rank for rank in seen_first if failures[rank].exitcode < 0]
    rank = (killed or seen_first)[0]
    return rank, failures[rank]


def describe_failure(rank: int, failure: Any, world_size: int | None = None) -> str:
    """One line for a rank's failure (a torch elastic ProcessFailure)."""
    what = exit_description(failure.exitcode)  # names the OOM killer where it ran since this launcher started
    if failure.exitcode < 0 and failure.signal_name() == "SIGKILL" and "out of memory" not in what:
        what += " (out of memory, or killed by hand)"
    others = "; the launcher stopped the other ranks" if world_size is None or world_size > 1 else ""
    return f"rank {rank} (pid {failure.pid}) {what}{others}"


def _cap_shutdown_grace(seconds: float) -> None:
    """torch closes the other ranks after a failure from inside its process context's poll
    with close()'s own default grace, 30 s, which neither torchrun's options nor
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT reach (torch 2.13, elastic/multiprocessing/api.py). Cap it
    in this launcher process; if torch's API moves, the launcher still works with torch's grace."""
    from torch.distributed.elastic.multiprocessing import api

    close = getattr(api.PContext, "close", None)
    if close is None or getattr(close, "_dlrm_lab_capped", False):
        return

    def capped(self: Any, death_sig: Any = None, timeout: int = 30) -> None:
        return close(self, death_sig, int(min(timeout, seconds)))

    capped._dlrm_lab_capped = True  # type: ignore[attr-defined]
    api.PContext.close = capped


def main(argv: list[str] | None = None, on_failure: Callable[[Path, str, bool], Any] | None = None) -> int:
    """Run torchrun's `argv`; the exit code. A failed job calls `on_failure(record, reason, killed)`: the file
    where the ranks' runs wrote their directories, the one-line reason, whether a rank was killed by a signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    _cap_shutdown_grace(env_seconds("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S))
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fd, record_path = tempfile.mkstemp(prefix="dlrm-lab-launch-", suffix=".runs")
    os.close(fd)
    record = Path(record_path)
    os.environ[RUN_RECORD_ENV] = record_path
    # the agent's own log lines (closing signals, the failure table) repeat what the one line says
    logging.disable(logging.ERROR)
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        rank, failure = root_failure(exc.failures)
        reason = describe_failure(rank, failure)
        if on_failure is not None:
            on_failure(record, reason, failure.exitcode < 0)
        print(f"error: launcher: {reason}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:  # Ctrl-C or SIGTERM of the launcher: the ranks said where their runs are
        return 130 if exc.sigval == 2 else 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a rendezvous or start-up failure, told in one line
        print(f"error: launcher: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}", file=sys.stderr)
        return 1
    finally:
        logging.disable(logging.NOTSET)
        record.unlink(missing_ok=True)
