"""A serving snapshot: the model as served and its sample library, written once by the server to a directory of
shared memory that every instance maps (the tables are never copied per instance), on 2 MiB pages where the plan
chose them (`--table-pages`: a tmpfs the server mounts on the snapshot's directory, unmounted with it)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.infer.library import LoadedSamples
from dlrm_lab.infer.serving_parts import serving_of
from dlrm_lab.metrics.huge_pages import mount_huge_tmpfs, pmd_mapped_bytes, unmount
from dlrm_lab.metrics.huge_pages import unsupported as huge_pages_unsupported

# The snapshot's pages (`write_snapshot`): base (4 KiB, the snapshot directory's tmpfs) or huge (a tmpfs of 2 MiB
# pages mounted on the snapshot directory: a random row's page walk, two-dimensional under a hypervisor, all but
# gone; kaggle bf16, 1M-row tables, one thread: a sample 0.28x, a 1-sample batch 0.80x, BENCHMARKS.md 2026-11-30)
TABLE_PAGES = ("base", "huge")
LIBRARY_FILE = "library.pt"  # in a snapshot, next to model.pt


def own_tmpfs_here() -> bool:
    """Whether a snapshot asked on 2 MiB pages gets its own tmpfs here (`write_snapshot`: Linux, root, transparent
    huge pages on): it then takes nothing of `snapshot_base()`'s room, only RAM."""
    return sys.platform.startswith("linux") and os.geteuid() == 0 and huge_pages_unsupported() is None


def snapshot_base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def snapshot_dir_for(tag: str) -> Path:
    return snapshot_base() / f"dlrm-lab-{os.getpid()}-{tag}"


def remove_stale_snapshots(base: Path | None = None) -> list[Path]:
    """Delete snapshots left by serving processes that were killed (their pid is gone):
    each holds a copy of the tables in RAM. Returns what was removed."""
    removed = []
    for path in (base or snapshot_base()).glob("dlrm-lab-*-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        remove_snapshot(path)
        removed.append(path)
    return removed


def remove_snapshot(directory: Path) -> None:
    """Delete a snapshot, and unmount the tmpfs of huge pages it was written on (`write_snapshot`)."""
    if os.path.ismount(directory):
        unmount(directory)  # detached: its memory goes with the last process that maps it
    shutil.rmtree(directory, ignore_errors=True)


def write_snapshot(
    directory: Path, model: torch.nn.Module, library: LoadedSamples, pages: str = "base"
) -> tuple[int, str | None]:
    """Write the model as served (its build, `infer.build`: tables already quantised on CPU; on GPU each
    instance quantises on its device) and the sample library for instances to map, on 2 MiB pages where `pages` is
    huge (a tmpfs mounted on `directory`, `metrics.huge_pages`); returns bytes and, where huge pages were asked
    and could not be had, why (the snapshot then on the directory's own pages)."""
    directory.mkdir(parents=True, exist_ok=False)
    why = mount_huge_tmpfs(directory) if pages == "huge" else None
    torch.save(model, directory / "model.pt")
    torch.save({k: torch.from_numpy(v) for k, v in library.arrays().items()}, directory / LIBRARY_FILE)
    return sum(p.stat().st_size for p in directory.iterdir()), why


def map_library(directory: Path, spec: Any) -> LoadedSamples:
    """The sample library of a snapshot of `spec`'s model, of its family's kind (a PackedLibrary, an HSTU
    RequestLibrary), mapped: every process that maps it shares its pages."""
    arrays = torch.load(directory / LIBRARY_FILE, mmap=True)
    return serving_of(spec).library_from_arrays({k: v.numpy() for k, v in arrays.items()})


def say_pages(name: str, directory: Path, pids: list[int], size: int, choices: dict[str, JsonObject], log: Log) -> None:
    """Where model `name`'s snapshot is on 2 MiB pages: how much of it each of its instances (`pids`) maps whole,
    the least of them, recorded in `choices` (the server's, by model: `huge_bytes`) and said: the kernel maps a
    huge page whole only where the mapping lets it."""
    mapped = min((pmd_mapped_bytes(pid, directory) for pid in pids), default=0)
    _record(choices, name, huge_bytes=mapped)
    log(
        f"{name}: its snapshot on 2 MiB pages ({directory}): {mapped / 2**20:,.0f} MiB of {size / 2**20:,.0f} mapped "
        "whole by each instance after its warm-up"
    )


def refused_pages(choices: dict[str, JsonObject], name: str, why: str, log: Log) -> None:
    """Huge pages chosen for model `name` and the mount refused at start: said, and recorded in `choices` (the
    server's, by model) as base pages, with why."""
    log(f"{name}: table pages base: {why}")
    _record(choices, name, table_pages="base", reason=why)


def _record(choices: dict[str, JsonObject], name: str, **fields: Any) -> None:
    """`fields` set in model `name`'s `table_pages_choice` (the plan's record, kept where it has one)."""
    mine = choices.setdefault(name, {})
    before = mine.get("table_pages_choice")
    mine["table_pages_choice"] = {**(before if isinstance(before, dict) else {}), **fields}
