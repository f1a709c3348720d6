"""Serving artefacts made once and loaded after: compiled packages cached on disk under a content key.

A key hashes everything that makes an artefact what it is (the weights, the preset, the precision, the
engine and its version, the machine's fingerprint), so a change of any of them is another file and a
stale one is never found. Each artefact sits beside a small record holding its sha256: one that is
partial or corrupt (its hash differs, or its record is missing) is rebuilt, never served. Two processes
that build one key at once take turns on a lock file, and a build is written to a temporary name and
renamed into place, so neither sees the other's half-written file.

Hand-written: torch's own caches (Inductor's FX graph cache) key on the graph, not on the weights a frozen
package carries, and keep no record that a reader can check a file against.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from dlrm_lab.config.values import JsonObject, env_seconds
from dlrm_lab.errors import DiskFull, ServingFault, UserError, is_disk_full

BUILD_DIR_ENV = "DLRM_LAB_BUILD_DIR"
RECORD = ".json"  # beside each artefact: its hash and what made it


def artefact_dir() -> Path:
    return Path(os.environ.get(BUILD_DIR_ENV) or Path.home() / ".cache" / "dlrm-lab" / "builds")


def content_key(parts: JsonObject, tensors: Iterable[torch.Tensor] = ()) -> str:
    """A hash of `parts` (JSON-able) and of the bytes of `tensors`, in order."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for t in tensors:
        t = t.detach().contiguous().cpu()
        digest.update(str((t.dtype, tuple(t.shape))).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:32]


def machine_parts() -> dict[str, str]:
    """What ties a compiled artefact to this machine: its fingerprint (CPU model and flags) and the engine."""
    from dlrm_lab.metrics.hardware import hardware_fingerprint

    return {
        "fingerprint": hardware_fingerprint()["fingerprint_id"],
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Artefact:
    path: Path
    sha256: str
    built: bool  # made by this call (False: found in the cache and checked)
    reason: str  # why it was made or reused


def verified(path: Path) -> str | None:
    """Why `path` cannot be served (missing, no record, a hash that differs), or None when it is whole."""
    record = path.with_name(path.name + RECORD)
    if not path.is_file():
        return "not built yet"
    if not record.is_file():
        return "no record beside it (a build that did not finish)"
    try:
        expected = json.loads(record.read_text())["sha256"]
    except (ValueError, KeyError, TypeError):
        return "its record is unreadable"
    if file_sha256(path) != expected:
        return "its bytes differ from its record (partial or corrupt)"
    return None


# How long a build waits for another process's build of the same key before it says so and stops
BUILD_WAIT_ENV = "DLRM_LAB_BUILD_WAIT_S"


def build_wait_s() -> float:
    """At most this long a build waits for another's of the same key: 1,800 s, or DLRM_LAB_BUILD_WAIT_S (read when a
    build waits, so that a bad value is one line there, not a traceback at import)."""
    return env_seconds(BUILD_WAIT_ENV, 1800.0)


# Free space a build needs in the cache beyond its artefact's own estimate (the compiler's temporaries)
BUILD_HEADROOM_BYTES = 256 << 20


def cached_artefact(
    key: str, suffix: str, build: Callable[[Path], None], about: JsonObject, size_hint: int = 0
) -> Artefact:
    """The artefact of `key` from the cache, checked; else `build(path)` writes it to a temporary path, which is
    recorded and renamed into place. Concurrent callers of one key build it once.

    A whole artefact is served from a cache it cannot write (read-only, full). A build first checks the cache can
    take it (writable, `size_hint` bytes and headroom free), and names the directory where not; one that waits on
    another process's build of the key says who holds it and stops after `build_wait_s()`; temporaries of writers that
    died (their pid gone) are removed."""
    directory = artefact_dir()
    path = directory / f"{key}{suffix}"
    if verified(path) is None:  # no lock needed to read a whole artefact: a read-only cache serves it
        return _found(path)
    _check_writable(directory, size_hint)
    remove_dead_temporaries(directory)
    with open(directory / f"{key}.lock", "a+") as lock:
        _take(lock, key)
        why = verified(path)
        if why is None:
            return _found(path)
        tmp = directory / f".{key}.{os.getpid()}.tmp{suffix}"
        try:
            build(tmp)
            sha = file_sha256(tmp)
            record = {"sha256": sha, "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **about}
            path.with_name(path.name + RECORD).unlink(missing_ok=True)  # no record points at a file being replaced
            os.replace(tmp, path)
            record_tmp = directory / f".{key}.{os.getpid()}.tmp{RECORD}"
            record_tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
            os.replace(record_tmp, path.with_name(path.name + RECORD))
        except OSError as exc:
            if is_disk_full(exc):
                raise DiskFull(
                    f"the build cache {directory} filled up while building {path.name}: free space or "
                    f"set {BUILD_DIR_ENV} to a larger disk"
                ) from None
            raise
        finally:
            for leftover in directory.glob(f".{key}.{os.getpid()}.tmp*"):  # the engines' own parts included
                leftover.unlink(missing_ok=True)
        return Artefact(path, sha, True, f"built ({why})")


def _found(path: Path) -> Artefact:
    return Artefact(
        path,
        json.loads(path.with_name(path.name + RECORD).read_text())["sha256"],
        False,
        "found in the cache, its hash checked",
    )


def _check_writable(directory: Path, size_hint: int) -> None:
    """Refuse, in one line naming the directory, a cache that cannot take a build."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"the build cache {directory} is not writable ({exc.strerror or exc}): set {BUILD_DIR_ENV} "
            "to a writable directory"
        ) from None
    free = shutil.disk_usage(directory).free
    need = size_hint + BUILD_HEADROOM_BYTES
    if free < need:
        raise DiskFull(
            f"the build cache {directory} has {free / 2**20:.0f} MiB free; this build needs about "
            f"{need / 2**20:.0f} MiB: free space or set {BUILD_DIR_ENV} to a larger disk"
        )


def _take(lock: Any, key: str) -> None:
    """Take the key's lock; while another process holds it, say who once and wait, at most `build_wait_s()`."""
    start, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes, a killed holder's too
            break
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            waited = time.monotonic() - start
            if waited > build_wait_s():
                raise ServingFault(
                    f"the build of {key} is held by {holder} for {waited:.0f} s (its lock "
                    f"{lock.name}); stop that process, or set DLRM_LAB_BUILD_WAIT_S"
                ) from None
            if not told:
                print(
                    f"waiting for {holder}, which is building {key} (lock {lock.name}; at most {build_wait_s():.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                told = True
            time.sleep(0.2)
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} since {datetime.now(timezone.utc).isoformat(timespec='seconds')}")
    lock.flush()


def remove_dead_temporaries(directory: Path) -> list[Path]:
    """Remove the temporaries (`.KEY.PID.tmp*`, an engine's parts included) of writers whose process is gone."""
    removed = []
    for tmp in directory.glob(".*.*.tmp*"):
        parts = tmp.name.split(".")
        pid = parts[2] if len(parts) > 3 else ""
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def dense_package(
    build: str, module: Any, suffix: str, write: Callable[[Any, Path], None], made_by: JsonObject
) -> Artefact:
    """The package of a served module's dense part that `write(module, path)` makes, from the cache or made now:
    keyed by the build, the model's spec, the precisions the module serves in (its tables' shape a whole-batch
    package's lookup: `aoti_int8`'s, made for fp32 tables and reused for int8 ones, scored AUC 0.50), `made_by`
    (engine versions, calibration), the machine and the dense weights themselves."""
    served_in = {"precision": module.precision, "table_precision": module.table_precision}
    key = content_key(
        {"build": build, "spec": module.spec.to_dict(), **served_in, **made_by, **machine_parts()},
        module.dense.state_dict().values(),
    )
    size = sum(t.numel() * t.element_size() for t in module.dense.state_dict().values())
    return cached_artefact(
        key,
        suffix,
        lambda path: write(module, path),
        {"build": build, "model": module.spec.name, **made_by},
        size_hint=4 * size,
    )


def record_of(path: str | Path) -> JsonObject:
    """What made the artefact at `path`, from its record (empty where it has none or cannot be read)."""
    try:
        record = json.loads(Path(str(path) + RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def require_verified(path: str | Path) -> Path:
    """`path`, whole (`verified`); else a RuntimeError naming why it is not served."""
    why = verified(Path(path))
    if why is not None:
        raise RuntimeError(f"serving package {path}: {why}")
    return Path(path)
