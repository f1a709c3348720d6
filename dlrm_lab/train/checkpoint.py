"""Checkpoints of sharded training with torch.distributed.checkpoint (DCP).

Each rank saves only its own shards (tables, their fused optimizer state, its replica of
the dense part), into `<dir>/step-<N>/`, written by DCP as one file per rank plus
metadata, and rank 0 adds `trained.json` (`model.checkpoint`: what serving reads of them); `latest`
names the newest complete checkpoint and is updated last, so a crash while saving leaves the previous
one current. A resumed run loads the shards of its own
plan (DCP reshards when the plan or rank count differs) and continues from step N with
the batch that step N would have used, so its losses are those of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError
from dlrm_lab.model.checkpoint import LATEST, TRAINED, latest_checkpoint


def _state(model: torch.nn.Module, optimizer: Any, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": torch.tensor(step)}


def save_checkpoint(root: str | Path, model: torch.nn.Module, optimizer: Any, step: int, is_main: bool,
                    about: JsonObject | None = None) -> Path:  # fmt: skip
    """Save after `step` steps (a collective: every rank calls it); `about`: what the weights were trained on
    (`model.checkpoint.TRAINED`), written by rank 0 beside them."""
    path = Path(root) / f"step-{step:08d}"
    dcp.save(_state(model, optimizer, step), checkpoint_id=str(path))
    if is_main and about is not None:
        tmp = path / f".{TRAINED}.tmp"
        tmp.write_text(json.dumps({**about, "step": step}, indent=1, default=str) + "\n")
        os.replace(tmp, path / TRAINED)
    if dist.is_initialized():
        dist.barrier()  # every rank's shard is on disk before `latest` moves
    if is_main:
        tmp = Path(root) / f".{LATEST}.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, Path(root) / LATEST)
    return path


def load_checkpoint(root: str | Path, model: torch.nn.Module, optimizer: Any) -> int:
    """Load the newest checkpoint under `root` into `model` and `optimizer`; return its step."""
    path = latest_checkpoint(root)
    if path is None:
        raise FieldError("resume", f": no checkpoint in {root} (expected a '{LATEST}' file naming step-N)")
    state = _state(model, optimizer, 0)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:  # noqa: BLE001 - a checkpoint of another model is a user mistake
        raise FieldError("resume", f"{path}: cannot load into this model ({str(exc).splitlines()[0][:200]})") from None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
