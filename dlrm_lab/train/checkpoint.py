"""Checkpoints of sharded training with torch.distributed.checkpoint (DCP).

Each rank saves only its own shards (tables, their fused optimizer state, its replica of
the dense part), into `<dir>/step-<N>/`, written by DCP as one file per rank plus
metadata, and rank 0 adds `trained.json` (`model.checkpoint`: what serving reads of them); `latest`
names the newest complete checkpoint and is updated last, so a crash while saving leaves the previous
one current; a checkpoint is written beside the others and renamed into place whole (`save_checkpoint`).
A resumed run loads the shards of its own plan (DCP reshards when the plan or rank count differs) and
continues from step N with the batch that step N would have used, so its losses are those of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError
from dlrm_lab.metrics.tables import atomic_file
from dlrm_lab.model.checkpoint import (
    LATEST,
    TRAINED,
    check_metadata,
    first_line,
    latest_checkpoint,
    raise_interruption,
)


def _state(model: torch.nn.Module, optimizer: Any, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": torch.tensor(step)}


def save_checkpoint(
    root: str | Path, model: torch.nn.Module, optimizer: Any, step: int, is_main: bool, about: JsonObject | None = None
) -> Path:
    """Save after `step` steps (a collective: every rank calls it); `about`: what the weights were trained on
    (`model.checkpoint.TRAINED`), written by rank 0 beside them.

    Written beside every earlier checkpoint, never over one: into `.step-N.partial`, every file synced, renamed to
    `step-N` (or `step-N.K` where an earlier run left a `step-N`: its weights stay whole), and only then does
    `latest` move. A run killed at any point leaves `latest` naming a complete checkpoint, and a reader never
    sees a partial step."""
    root = Path(root)
    partial = root / f".step-{step:08d}.partial"
    if is_main:
        shutil.rmtree(partial, ignore_errors=True)  # a killed run's leftover
    if dist.is_initialized():
        dist.barrier()
    dcp.save(_state(model, optimizer, step), checkpoint_id=str(partial))  # its writer syncs each rank's files
    if is_main and about is not None:
        _write_synced(partial / TRAINED, json.dumps({**about, "step": step}, indent=1, default=str) + "\n")
    if dist.is_initialized():
        dist.barrier()  # every rank's shard is on disk before it is renamed and `latest` moves
    path = root / f"step-{step:08d}"
    if is_main:
        path = _free_name(path)
        os.rename(partial, path)
        _sync_directory(root)
        _write_synced(root / LATEST, path.name + "\n")
    if dist.is_initialized():  # every rank returns the name rank 0 chose
        names = [path.name]
        dist.broadcast_object_list(names, src=0)
        path = root / names[0]
    return path


def _free_name(path: Path) -> Path:
    """`path`, or `path.K` with the smallest K >= 1 no directory holds."""
    k, candidate = 0, path
    while candidate.exists():
        k += 1
        candidate = path.with_name(f"{path.name}.{k}")
    return candidate


def _write_synced(path: Path, text: str) -> None:
    """`text` into `path` through a synced temporary file renamed over it (`metrics.tables.atomic_file`): a kill
    leaves the old file or the new, and a full disk is one line naming the file."""
    with atomic_file(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(root: str | Path, model: torch.nn.Module, optimizer: Any) -> int:
    """Load the newest checkpoint under `root` into `model` and `optimizer`; return its step."""
    path = latest_checkpoint(root)
    if path is None:
        raise FieldError("resume", f": no checkpoint in {root} (expected a '{LATEST}' file naming step-N)")
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    check_metadata(path, "resume")
    state = _state(model, optimizer, 0)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - another model's, or a damaged one
        raise_interruption(exc)
        raise FieldError("resume", f"{path}: cannot load into this model ({first_line(exc)})") from None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
