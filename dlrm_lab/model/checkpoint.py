"""A trained model's checkpoint as serving reads it: the weights, and what they were trained on.

`train --checkpoint-dir DIR` writes `DIR/step-N/` with torch.distributed.checkpoint (DCP: each rank its
shards) and beside the shards `trained.json`: the model's spec, the step, the held-out AUC of that step,
and how the run's held-out samples are drawn again (the data, its generator's spec and seed). `DIR/latest`
names the newest complete one. Serving loads the weights into the model as it serves it, one process with
whole tables: DCP reshards from the training layout (any sharding, any rank count).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from dlrm_lab.config.train import PRECISIONS
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError

LATEST = "latest"  # names the newest complete step-N directory, moved last
TRAINED = "trained.json"  # in a step-N directory: what the weights were trained on (rank 0 writes it)
TRAINED_PRECISIONS = ("auto", *PRECISIONS)  # what training's --precision can have recorded


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete step-N directory `latest` names; None where there is none. A `latest` that names no
    directory of the root (damaged: bytes that are no name, a path out of it) is one line naming the file."""
    marker = Path(root) / LATEST
    if not marker.is_file():
        return None
    raw = marker.read_bytes()[:256]
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not name or "/" in name or name in (".", ".."):
        raise FieldError("checkpoint", f"{marker}: damaged ({raw[:40]!r} names no step directory); remove it, or "
                         "write the name of the newest complete step-N directory into it")  # fmt: skip
    path = Path(root) / name
    return path if path.is_dir() else None


@dataclass(frozen=True)
class TrainedCheckpoint:
    """One complete checkpoint of a training run, as a server names and loads it."""

    path: Path  # the step-N directory
    step: int
    about: JsonObject  # trained.json

    @property
    def model(self) -> JsonObject:
        return cast(JsonObject, self.about["model"])  # an object (`sidecar_problem` checked it when read)

    @property
    def last_eval(self) -> JsonObject:
        """The last evaluation trained.json records (an object or null: `sidecar_problem`); {} where none."""
        return cast("JsonObject | None", self.about.get("eval")) or {}

    # what the run trained on, as `sidecar_problem` checked it when read: the held-out samples are drawn again from it
    @property
    def data(self) -> str:
        return cast(str, self.about["data"])  # 'synthetic' or the training data's path

    @property
    def seed(self) -> int:
        return cast(int, self.about["seed"])

    @property
    def data_spec(self) -> str | None:
        return cast("str | None", self.about.get("data_spec"))

    @property
    def data_overrides(self) -> tuple[str, ...]:
        return tuple(cast("list[str] | None", self.about.get("data_overrides")) or ())

    @property
    def held_out_auc(self) -> float | None:
        return cast("float | None", self.last_eval.get("auc"))  # a number in [0, 1] or null (`sidecar_problem`)

    def describe(self) -> JsonObject:
        """What a run's manifest says of the weights it served."""
        return {
            "path": str(self.path),
            "step": self.step,
            "held_out_auc": self.held_out_auc,
            "held_out_step": self.last_eval.get("step"),
            "trained_by": self.about.get("run_id"),
            "data": self.about.get("data"),
        }


def read_checkpoint(root: str | Path, field: str = "checkpoint") -> TrainedCheckpoint:
    """The newest complete checkpoint under `root` (a `train --checkpoint-dir` directory, or one of its step-N
    directories); one FieldError naming the path where it is not one."""
    root = Path(root)
    if not root.exists():
        raise FieldError(field, f"{root}: no such directory (expected a train --checkpoint-dir)")
    path = root if (root / TRAINED).is_file() else latest_checkpoint(root)
    if path is None:
        raise FieldError(
            field,
            f"{root}: no complete checkpoint (expected a '{LATEST}' file naming step-N, written by "
            "train --checkpoint-dir)",
        )
    sidecar = path / TRAINED
    if not sidecar.is_file():
        raise FieldError(
            field,
            f"{path}: no {TRAINED} beside the weights (written by train since 2026-11-27): "
            "train again with --checkpoint-dir",
        )
    try:
        about = json.loads(sidecar.read_text())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise FieldError(field, f"{sidecar}: unreadable ({type(exc).__name__}: {exc})") from None
    if problem := sidecar_problem(about):
        raise FieldError(field, f"{sidecar}: {problem}: written by train --checkpoint-dir; train again") from None
    return TrainedCheckpoint(path, about["step"], about)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any, lo: float = -math.inf, hi: float = math.inf) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and lo <= value <= hi


def sidecar_problem(about: Any) -> str | None:
    """What is wrong with a `trained.json` (`field = value: rule`), checked whole when it is read: every field
    serving reads later (the held-out samples' data and seed, the AUC it records) is known good before any load
    runs, so a damaged one costs one line at start, not a crash after the load."""
    if not isinstance(about, dict):
        return f"not an object but {type(about).__name__}"
    rules: list[tuple[str, Any, bool, str]] = [
        ("step", about.get("step"), _whole(about.get("step")), "a whole number >= 0"),
        ("model", about.get("model"), isinstance(about.get("model"), dict), "the model's spec, an object"),
        (
            "data",
            about.get("data"),
            isinstance(about.get("data"), str) and bool(about.get("data")),
            "'synthetic' or the training data's path",
        ),
        ("seed", about.get("seed"), _whole(about.get("seed")), "a whole number >= 0"),
        (
            "data_spec",
            about.get("data_spec"),
            about.get("data_spec") is None or isinstance(about["data_spec"], str),
            "a data spec's name or null",
        ),
        (
            "data_overrides",
            about.get("data_overrides"),
            about.get("data_overrides") is None
            or (isinstance(about["data_overrides"], list) and all(isinstance(o, str) for o in about["data_overrides"])),
            "a list of KEY=VALUE strings",
        ),
        (
            "eval",
            about.get("eval"),
            about.get("eval") is None or isinstance(about["eval"], dict),
            "the last evaluation, an object, or null",
        ),
        # recorded beside every run that serves the checkpoint: a damaged one would be a wrong record
        (
            "precision",
            about.get("precision"),
            about.get("precision") is None or about["precision"] in TRAINED_PRECISIONS,
            f"one of {', '.join(TRAINED_PRECISIONS)}, or null",
        ),
        (
            "world_size",
            about.get("world_size"),
            about.get("world_size") is None or (_whole(about["world_size"]) and about["world_size"] >= 1),
            "a whole number >= 1, or null",
        ),
        (
            "eval_data",
            about.get("eval_data"),
            about.get("eval_data") is None or isinstance(about["eval_data"], dict),
            "what the held-out samples were drawn from, an object, or null",
        ),
        *(
            (key, about.get(key), about.get(key) is None or isinstance(about[key], str), "a string, or null")
            for key in ("protocol", "run_id")
        ),
    ]
    last = about.get("eval")
    if isinstance(last, dict):
        rules += [
            ("eval.auc", last.get("auc"), last.get("auc") is None or _number(last["auc"], 0.0, 1.0), "in [0, 1]"),
            ("eval.step", last.get("step"), last.get("step") is None or _whole(last["step"]), "a whole number >= 0"),
            ("eval.loss", last.get("loss"), last.get("loss") is None or _number(last["loss"]), "a finite number"),
            (
                "eval.samples",
                last.get("samples"),
                last.get("samples") is None or _whole(last["samples"]),
                "a whole number >= 0",
            ),
        ]
    for name, value, good, rule in rules:
        if not good:
            shown = "missing" if value is None and name in ("step", "model", "data", "seed") else f"{value!r:.60}"
            return f"{name} = {shown}: must be {rule}"
    return None


def load_weights(model: Any, checkpoint: TrainedCheckpoint, field: str = "checkpoint") -> None:
    """Load the checkpoint's model weights into `model` (whole tables, one process; DCP reshards), in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    check_metadata(checkpoint.path, field)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(checkpoint.path), no_dist=True)
        model.load_state_dict(state["model"])
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - weights of another shape: a user mistake
        raise_interruption(exc)
        first = first_line(exc)
        raise FieldError(field, f"{checkpoint.path}: its weights do not fit the served model ({first})") from None


# A spec's fields that say where it came from, not what the weights are: a checkpoint serves from any checkout
PROVENANCE = ("source", "description")


def check_spec(
    checkpoint: TrainedCheckpoint, spec: JsonObject, field: str = "checkpoint", ignore: tuple[str, ...] = ()
) -> None:
    """Refuse, in one line naming the first difference, to serve a checkpoint's weights as another model."""
    trained, spec = checkpoint.model, json.loads(json.dumps(spec, default=str))  # tuples as the JSON's lists

    def first_difference(a: Any, b: Any, where: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if where == "" and (key in ignore or key in PROVENANCE or key.startswith("reference")):
                    continue
                found = first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else key)
                if found:
                    return found
            return None
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if found := first_difference(x, y, f"{where}[{i}]"):
                    return found
            return None
        return None if a == b else f"{where}: trained {_short(a)}, served {_short(b)}"

    if difference := first_difference(trained, spec, ""):
        raise FieldError(
            field,
            f"{checkpoint.path}: trained {trained.get('name')!r}, not the model served "
            f"({difference}); serve the preset and scaling it was trained with",
        )


def check_metadata(path: Path, field: str = "checkpoint") -> None:
    """Refuse, in one line, a checkpoint whose DCP metadata cannot be read (damaged, truncated, a partial copy),
    before DCP's reader tries its fallbacks and logs a traceback for each."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - pickle's, the file system's: a damaged checkpoint either way
        raise FieldError(
            field,
            f"{path}: its .metadata is damaged or partial ({first_line(exc)}): train again, or serve another step",
        ) from None
    # every shard file as long as the metadata says its last item ends: a truncated or emptied shard is named, not
    # read into a pickle error that reads as "weights of another model"
    needed: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = path / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            what = "is missing" if size is None else f"has {size:,} bytes of the {end:,} its metadata names"
            raise FieldError(field, f"{shard}: {what} (damaged or partial): train again, or serve another step")


def raise_interruption(exc: BaseException) -> None:
    """Raise the stop inside `exc`, if it holds one: DCP wraps whatever a rank raised, Ctrl-C and SIGTERM included,
    in its CheckpointException, which would otherwise read as a damaged checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dlrm_lab.errors import Terminated

    if isinstance(exc, CheckpointException):
        for wrapped, _trace in exc.failures.values():
            if isinstance(wrapped, KeyboardInterrupt | Terminated):
                raise wrapped from None


def first_line(exc: BaseException) -> str:
    """The cause in one line: DCP wraps each rank's exception in a traceback whose last line names it."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if isinstance(exc, Exception) and lines and not lines[0].startswith("CheckpointException"):
        return lines[0][:200]
    return (lines[-1] if lines else type(exc).__name__)[:200]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
