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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from dlrm_lab.config.values import JsonObject

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

    return {"fingerprint": hardware_fingerprint()["fingerprint_id"], "torch": torch.__version__,
            "python": platform.python_version()}  # fmt: skip


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


def cached_artefact(key: str, suffix: str, build: Callable[[Path], None], about: JsonObject) -> Artefact:
    """The artefact of `key` from the cache, checked; else `build(path)` writes it to a temporary path, which is
    recorded and renamed into place. Concurrent callers of one key build it once."""
    directory = artefact_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}{suffix}"
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, a killed holder's included
        why = verified(path)
        if why is None:
            return Artefact(path, json.loads(path.with_name(path.name + RECORD).read_text())["sha256"], False,
                            "found in the cache, its hash checked")  # fmt: skip
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
        finally:
            tmp.unlink(missing_ok=True)
        return Artefact(path, sha, True, f"built ({why})")


def dense_package(build: str, module: Any, suffix: str, write: Callable[[Any, Path], None],
                  made_by: JsonObject) -> Artefact:  # fmt: skip
    """The package of a served module's dense part that `write(module, path)` makes, from the cache or made now:
    keyed by the build, the model's spec, `made_by` (precision, engine versions, calibration), the machine and the
    dense weights themselves."""
    key = content_key({"build": build, "spec": module.spec.to_dict(), **made_by, **machine_parts()},
                      module.dense.state_dict().values())  # fmt: skip
    return cached_artefact(key, suffix, lambda path: write(module, path),
                           {"build": build, "model": module.spec.name, **made_by})  # fmt: skip


def require_verified(path: str | Path) -> Path:
    """`path`, whole (`verified`); else a RuntimeError naming why it is not served."""
    why = verified(Path(path))
    if why is not None:
        raise RuntimeError(f"serving package {path}: {why}")
    return Path(path)
