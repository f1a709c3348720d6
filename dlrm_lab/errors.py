"""The exceptions the CLI prints as one line.

Anything a user can get wrong (a preset name, a TOML field, a CLI value) raises
`UserError` with a message that names the culprit and the allowed values; the CLI prints
it on one line and exits 2. Faults a user must hear of but did not cause (a dead rank, a
SIGTERM, a full disk under the metrics) print one line and exit 1. Everything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def first_line(error: BaseException) -> str:
    """An error's first line (a C++ op's message carries its frames below): what a one-line reason quotes."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class UserError(Exception):
    """A mistake in user input: bad preset, spec field, option value or path."""

    exit_code = 2


_FIELD_NAMES: list[Callable[[str], str]] = []  # how FieldErrors spell fields, innermost last (`fields_named_by`)


@contextmanager
def fields_named_by(name: Callable[[str], str]) -> Iterator[None]:
    """Within: a FieldError's message spells its fields by `name` from the moment it is raised (the command
    line: by flag), so a run's manifest and a rank's report say what stderr says."""
    _FIELD_NAMES.append(name)
    try:
        yield
    finally:
        _FIELD_NAMES.pop()


class FieldError(UserError):
    """A bad value of a typed config's field, named by the field (`batch_size 0: must be ...`).

    Library code knows fields, not how a user gave them: the command line names the field by
    its flag (`--batch-size 0: must be ...`) through `named`. Other fields a message mentions
    are written `{field}` in `detail` and named the same way."""

    def __init__(self, field: str, detail: str, *others: str) -> None:
        self.field, self.detail, self.fields = field, detail, (field, *others)
        super().__init__(self.named(_FIELD_NAMES[-1] if _FIELD_NAMES else str))

    def spelt(self, name: Callable[[str], str]) -> FieldError:
        """This error, its message naming the fields by `name` (as `train_setup` takes options: by flag)."""
        out = FieldError(self.field, self.detail, *self.fields[1:])
        out.args = (self.named(name),)
        return out

    def __reduce__(self) -> tuple[type, tuple[str, ...]]:  # to cross a process boundary
        return FieldError, (self.field, self.detail, *self.fields[1:])

    def named(self, name: Callable[[str], str]) -> str:
        """The message with every field it mentions spelt by `name` (e.g. a field's flag)."""
        text = name(self.field) + ("" if self.detail.startswith(":") else " ") + self.detail
        for other in self.fields[1:]:
            text = text.replace("{" + other + "}", name(other))
        return text


class Terminated(BaseException):
    """The process was asked to stop (SIGTERM), e.g. by a launcher after another rank failed.

    A BaseException, as KeyboardInterrupt is: libraries' own `except Exception` (Inductor's compile and
    autotuning, a checkpoint reader) must not swallow a stop, nor turn it into their own error."""

    def __init__(self, message: str, signum: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum  # the signal that asked, sent again where a finaliser swallowed it

    def __reduce__(self) -> tuple[type, tuple[str, int | None]]:  # to cross a process boundary
        return Terminated, (str(self), self.signum)


def raise_on_sigterm() -> None:
    """Turn SIGTERM (a launcher or a user stopping the job) and SIGHUP (its terminal closed, an ssh session
    dropped) into `Terminated`, so the run
    directory is marked failed, the rows measured so far are flushed and resources (serving
    snapshots, worker processes) are released, instead of dying silently."""
    import os
    import signal

    launched = any(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_JOB_ID"))
    who = "a launcher stopped the job" if launched else "sent by another process: a user, a scheduler or a supervisor"

    def handler(signum: int, frame: object) -> None:
        why = "its terminal closed or its session ended" if signum == signal.SIGHUP else who
        raise Terminated(f"terminated by signal {signal.Signals(signum).name} ({why})", signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    redeliver_lost_stops()


@contextmanager
def stops_deferred() -> Iterator[None]:
    """Within: a stop (SIGTERM, SIGHUP, Ctrl-C) waits until the block ends and is then raised as it would have been
    (sent again to this process). For clean-up that must run whole: a stop raised in the middle of a server's stop
    skipped the rest of it (a SIGTERM arriving as an Offline run ended: its instances' join interrupted, the
    snapshot's tmpfs of 2 MiB pages left mounted, its tables in RAM). Python runs signal handlers in the main
    thread only: elsewhere the block runs as it is, as it does for a signal whose handler is not Python's."""
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: object) -> None:
        caught.append(signum)

    before: dict[signal.Signals, Any] = {}
    for stop in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        handler = signal.getsignal(stop)
        if handler is None or handler == signal.SIG_IGN:
            continue  # set outside Python (cannot be put back) or ignored: left as it is
        before[stop] = signal.signal(stop, hold)
    try:
        yield
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)
        if caught:
            os.kill(os.getpid(), caught[0])  # raised by the handler put back, at the next line


_SIGNAL_STACK: list[Any] = []  # the lab's alternate signal stack: never freed (the kernel writes signal frames there)
_SIGNAL_STACK_MIN = 1 << 16


def keep_signal_stack() -> bool:
    """Make the calling thread's alternate signal stack one the lab owns for the process's life, where another
    is set: call it after native code that may have set one it frees later. Python's handlers (SIGTERM's, Ctrl-C's)
    run on that stack (CPython installs them with SA_ONSTACK), so a stack that points at freed memory turns every
    stop into a kernel-forced SIGSEGV: no handler, no closed run, the snapshot left mounted. OpenVINO's CPU plugin
    sets its own on the thread that creates its engine and, when the engine goes, puts back the one it found if
    its own is still set, although that one may be another engine's, already unmapped (two engines made and freed
    in the order they were made: a kaggle serving start stopped by SIGTERM died that way in 8 of 19 tries). With
    the lab's stack set, no engine finds its own there and none puts a freed one back. Returns whether it changed
    the thread's stack (False off Linux, where it was already the lab's, or where none was set)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False

    class StackT(ctypes.Structure):
        _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    current = StackT()
    if libc.sigaltstack(None, ctypes.byref(current)) != 0 or current.ss_sp is None or current.ss_flags & 2:
        return False  # none set (or SS_DISABLE): signals run on the thread's own stack, which nothing frees
    if _SIGNAL_STACK and current.ss_sp == ctypes.addressof(_SIGNAL_STACK[0]):
        return False
    if not _SIGNAL_STACK:
        libc.getauxval.restype = ctypes.c_ulong
        at_minsigstksz = 51  # the kernel's minimum for this CPU's signal frame (AMX tiles: ~12 KB)
        size = max(_SIGNAL_STACK_MIN, 4 * int(libc.getauxval(at_minsigstksz)))
        _SIGNAL_STACK.append(ctypes.create_string_buffer(size))
    buffer = _SIGNAL_STACK[0]
    mine = StackT(ctypes.addressof(buffer), 0, ctypes.sizeof(buffer))
    return bool(libc.sigaltstack(ctypes.byref(mine), None) == 0)


def redeliver_lost_stops() -> None:
    """A stop (`Terminated`, Ctrl-C's KeyboardInterrupt) raised while Python runs a finaliser (a `__del__`, a weakref
    callback: the signal handler runs wherever the main thread is) is printed and ignored, and the run went on as if
    never stopped (a SIGTERM during an `aoti` compile was lost in a WeakSet's callback): the hook sends the signal
    again, so the stop is raised at the next line outside it. Other unraisable exceptions go to the hook before."""
    import os
    import signal
    import sys
    import threading

    if getattr(sys.unraisablehook, "redelivers_stops", False):
        return
    before = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        if not isinstance(exc, (Terminated, KeyboardInterrupt)) or signum is None:
            before(unraisable)
            return
        # sent from a thread a moment later: sent from here, it would be raised in this hook and be lost again; lost
        # in another finaliser, it comes back here and is sent once more
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()

    hook.redelivers_stops = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


@contextmanager
def interrupt_blocked() -> Iterator[None]:
    """Start the lab's workers inside this: the interpreter a worker is spawned as inherits Ctrl-C ignored (Python
    keeps an inherited SIG_IGN), so that a Ctrl-C while it still imports, before `end_with_parent` could ignore it, is
    not a KeyboardInterrupt traceback of its own. The parent holds Ctrl-C blocked meanwhile, so that one pressed then
    is its own as soon as the start returns (blocked, not lost). Only the main thread may change a handler: started
    from another thread, a worker gets the blocked mask alone."""
    import signal
    import threading

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a blocked signal is never discarded as ignored
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def end_with_parent(signum: int | None = None, ignore_interrupt: bool = True, parent: int | None = None) -> None:
    """In a worker process the lab started (a probe's, a client's, a serving instance, a sweep's point): end it
    with `signum` (default SIGKILL) when its parent dies, even by SIGKILL (Linux's parent-death signal), so that no
    worker, and no resource tracker kept alive by one, outlives a killed command; and leave Ctrl-C to the parent,
    which stops its workers itself (a worker's own KeyboardInterrupt was a traceback on the terminal). `parent`:
    the pid that started it (default: multiprocessing's parent), to tell whether it already died."""
    import contextlib
    import ctypes
    import os
    import signal

    signum = int(signum or signal.SIGKILL)
    if ignore_interrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    if parent_died(parent):  # before the signal was asked for
        os.kill(os.getpid(), signum)


def parent_died(parent: int | None = None) -> bool:
    """Whether this process's parent (`parent`, or multiprocessing's) is gone: its parent pid is no longer that
    one. Not "its parent is PID 1": an orphan goes to the nearest subreaper, and a lab run as a container's PID 1
    is the live parent of every worker."""
    import multiprocessing
    import os

    if parent is None:
        started_by = multiprocessing.parent_process()
        parent = started_by.pid if started_by is not None else None
    return parent is not None and os.getppid() != parent


class RankFailure(RuntimeError):
    """A collective failed: another rank died, or did not answer within the timeout."""


class ServingFault(RuntimeError):
    """A serving instance died or could not start: the server's results stop there (one line, exit 1)."""


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended since boot (`/proc/vmstat`), or None where unreadable."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


_OOM_KILLS_AT_START = oom_kills()  # read as this process starts: a later rise means the OOM killer ran since


def exit_description(code: int | None) -> str:
    """How a child process ended, from its exit code (negative: the signal that killed it). A SIGKILL while the
    kernel's OOM killer has run since this process started is named as that: a child that ate the machine's memory
    must not read as one that failed for no reason (a benchmark printed only "failed:" for a run the OOM killer
    took during its builds)."""
    import signal

    if code is None:
        return "is still running"
    if code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        now, before = oom_kills(), _OOM_KILLS_AT_START
        if -code == signal.SIGKILL and now is not None and before is not None and now > before:
            how += " (out of memory: the kernel's OOM killer has run since this process started, /proc/vmstat)"
        return how
    return f"exited with code {code}"


class RemoteFailure(RuntimeError):
    """A remote system under test failed during a load: the point is summarised as far as it went and
    the run fails, its rows kept (one line, exit 1)."""


class ServerLost(RemoteFailure):
    """... it stopped answering (only UNAVAILABLE for longer than the client allows)."""


class ClientLost(RemoteFailure):
    """... one of the lab's own client processes (`--concurrency`) died: the server is not to blame."""


class BadAnswer(RemoteFailure):
    """... it answered a query with something that is not one score per sample."""


class DiskFull(Exception):
    """Metrics could not be written: the file system holding them is full. The message
    names the file and the free space; rows already written stay readable."""

    @classmethod
    def at(cls, path: object, exc: OSError) -> DiskFull:
        import shutil
        from pathlib import Path

        where = Path(str(path))
        try:
            free = f"{shutil.disk_usage(where.parent).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        return cls(f"{where}: {exc.strerror or 'no space left on device'} ({free}); the rows written so far are kept")


def is_disk_full(exc: BaseException) -> bool:
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
