"""The options of the commands that sweeps run, built into the lab's typed configs.

`train_setup` and `infer_setup` take option values keyed by the command-line names
(`batch-size` or `batch_size`); the CLI commands and the sweep's grid check both build
their configs here, so a sweep point is checked by the very construction that will run
it, without importing the CLI. Values from TOML are coerced to each option's type the way
the command line would parse them; an unknown option or a bad value is one UserError.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from dlrm_lab.config import TrainConfig, load_any_preset
from dlrm_lab.errors import UserError
from dlrm_lab.families import Spec

# Options of the command line only: where results go and how progress shows.
CLI_ONLY = frozenset({"metrics_dir", "progress"})
_MODEL_SCALING = {"table_scale": float | None, "max_rows": int | None}
# Command-line names whose TrainConfig field is named otherwise.
_TRAIN_RENAMED = {"set": "data_overrides", "timeout": "timeout_s"}

# `infer run`'s options and their types (ServingOptions and InferConfig hold the rules).
_INFER_OPTIONS: dict[str, Any] = {
    "model": list[str] | None,
    "scenario": str,
    "target": str,
    "rpc": str | None,
    "concurrency": int,
    "timeout": float,
    "connect_timeout": float,
    "unavailable_s": float,
    "price_per_hour": float | None,
    "currency": str | None,
    "qps": list[str] | None,
    "query_size": list[str] | None,
    "arrival": str,
    "duration": float,
    "warmup": float,
    "sla_ms": list[str] | None,
    "percentile": float,
    "instances": int,
    "threads": int,
    "max_batch": str,  # a number, or auto (infer.tune)
    "max_delay_ms": str,
    "max_queue": int,
    "min_piece": int,
    "spin_ms": str,
    "max_issue_lag_ms": float,
    "precision": str,
    "table_precision": str,
    "build": str,
    "device": str,
    "pin_cores": bool,
    "alone": bool,
    "data_spec": str | None,
    "order": str,
    "history_cache_mb": float,
    "history_affinity": bool,
    "attention": str,
    "set": list[str] | None,
    "seed": int,
    "trace": bool,
    **_MODEL_SCALING,
}


def _key(name: str) -> str:
    return name.replace("-", "_").rstrip("_")  # `set_` is the CLI function's name for --set


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def coerce(option: str, value: Any, kind: Any) -> Any:
    """`value` as the command line would parse it into `kind` (int, float, str, bool, a
    list or tuple of them, or Optional of one); a mismatch names the option and the value."""
    if value is None:
        return None
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return coerce(option, value, inner[0])
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        items = value if isinstance(value, list | tuple) else [value]
        converted = [coerce(option, v, args[0]) for v in items]
        return tuple(converted) if origin is tuple else converted
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{_flag(option)} {value!r}: must be true or false")
    if kind in (int, float):
        if isinstance(value, bool):
            raise UserError(f"{_flag(option)} {value!r}: must be a {'whole ' if kind is int else ''}number")
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise UserError(f"{_flag(option)} {value!r}: must be a {'whole ' if kind is int else ''}number") from None
        if kind is int and isinstance(value, float) and value != number:
            raise UserError(f"{_flag(option)} {value!r}: must be a whole number")
        return number
    return str(value)


def _split(options: Mapping[str, Any], allowed: set[str], command: str) -> dict[str, Any]:
    given = {_key(k): v for k, v in options.items()}
    if unknown := sorted(set(given) - allowed - CLI_ONLY):
        names = ", ".join(_flag(n) for n in sorted(allowed))
        raise UserError(f"{command}: unknown option {_flag(unknown[0])}; allowed: {names}")
    return {k: v for k, v in given.items() if k not in CLI_ONLY}


def train_setup(options: Mapping[str, Any]) -> tuple[Spec, TrainConfig]:
    """The model and the training config of `dlrm-lab train` with these options (the rest default)."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    cli_to_field = {name: name for name in fields} | _TRAIN_RENAMED
    allowed = set(cli_to_field) - set(_TRAIN_RENAMED.values()) | {"preset", *_MODEL_SCALING}
    given = _split(options, allowed, "train")
    preset = coerce("preset", given.pop("preset", "tiny"), str)
    scaling = {k: coerce(k, given.pop(k, None), kind) for k, kind in _MODEL_SCALING.items()}
    values = {}
    for name, value in given.items():
        field = cli_to_field[name]
        values[field] = coerce(name, value, hints[field])
        if value is None and fields[field].default is not None:
            values.pop(field)  # an option left unset takes the config's default
    spec = load_any_preset(preset, **scaling)  # either family: DLRM or the HSTU ranker
    cfg = TrainConfig(**values)
    from dlrm_lab.families import family_of

    # where --set changes the samples (the ranker's requests) the size line shows them (train() keeps them)
    return family_of(spec).with_data_overrides(spec, cfg.data_overrides, serving=False), cfg


def infer_setup(options: Mapping[str, Any]) -> tuple[list[Any], Any, Any]:
    """The served models, the load plan and the config of `dlrm-lab infer run` with these options."""
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.options import ServingOptions, plan_load

    given = _split(options, set(_INFER_OPTIONS), "infer run")
    if given.get("max_batch") is None:
        given["max_batch"] = "auto"  # the command's default (infer.tune)
    o = {k: coerce(k, v, _INFER_OPTIONS[k]) for k, v in given.items()}
    from dlrm_lab.infer.targets import parse_target
    from dlrm_lab.infer.tune import KNOBS, parse_knob

    tune = []
    if parse_target(o.get("target") or "in-process").remote and o.get("max_batch") == "auto":
        o["max_batch"] = None  # a remote server batches as it does: no max batch to choose here
    for knob in KNOBS:  # auto: chosen by measurement on the running server (infer.tune)
        if o.get(knob) is not None:
            value = parse_knob(knob, o[knob])
            if value is None:
                tune.append(knob)
            o[knob] = None if value is None else (int(value) if knob == "max_batch" else value)
    if o.get("set"):
        o["data_overrides"] = tuple(o.pop("set"))
    defaults = {f.name: f.default for f in dataclasses.fields(ServingOptions)}
    serving = ServingOptions(**{k: o[k] for k in defaults if k in o and o[k] is not None})
    served = serving.served(o.get("model"))
    load = plan_load(served, o.get("qps"), o.get("query_size"), o.get("sla_ms"), o.get("arrival", "poisson"),
                     o.get("order", "random"))  # fmt: skip
    renamed = {"duration": "duration_s", "warmup": "warmup_s", "percentile": "sla_percentile", "alone": "compare_alone",
               "timeout": "timeout_s", "connect_timeout": "connect_timeout_s"}  # fmt: skip
    infer_fields = {f.name for f in dataclasses.fields(InferConfig)}
    cfg_values = {renamed.get(k, k): v for k, v in o.items() if renamed.get(k, k) in infer_fields and v is not None}
    cfg_values.pop("sla_ms", None)
    cfg = InferConfig(**cfg_values, sla_ms=load.streams[0].sla_ms, qps_auto=load.qps_auto, sla_auto=load.sla_auto,
                      tune=tuple(tune))  # fmt: skip
    return served, load, cfg


SETUPS = {"train": train_setup, "infer run": infer_setup}
