"""The options of each command, composed from the typed configs that declare them.

An option is declared once, as a field of the config it sets (`config.options.option`):
`TRAIN`, `INFER_RUN`, `INFER_SEARCH`, `SERVE` and `CLIENT` list a command's options in order.
The CLI's Typer signatures (`cli.options`), a sweep's TOML keys and its checks derive from these
lists. `train_setup`, `infer_setup` and `search_setup` take option values keyed by name
(`batch-size` or `batch_size`), coerced the way the command line parses them; the CLI
commands and the sweep's grid check both build their configs here, so a sweep point is
checked by the very construction that will run it, without importing the CLI.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

from dlrm_lab.config import TrainConfig
from dlrm_lab.config.family import Spec, family_of
from dlrm_lab.config.options import Declared, PresetChoice, build, given, options_of, parse_words
from dlrm_lab.config.values import OptionValue, OptionValues
from dlrm_lab.errors import FieldError
from dlrm_lab.infer.options import (
    RUN_KNOBS,
    BuildTableOptions,
    InferConfig,
    LoadOptions,
    ServingOptions,
)
from dlrm_lab.infer.search_options import SEARCH_CHANGES, SearchOptions, SearchSpace
from dlrm_lab.infer.serving_parts import serving_of
from dlrm_lab.serve.options import CLIENT_CHANGES, ClientOptions, ServeOptions

# Options of the command line only: where results go and how progress shows.
CLI_ONLY = frozenset({"metrics_dir", "progress"})
# ... as words a command line may give (`cli.options` declares them for Typer): a library parser reads them too
_CLI_WORDS = [
    Declared(object, "metrics_dir", "metrics_dir", str, "runs", "Directory that receives the run directory."),
    Declared(object, "progress", "progress", bool, True, "Show a progress bar."),
]

TRAIN: list[Declared] = [*options_of(PresetChoice), *options_of(TrainConfig)]
INFER_RUN: list[Declared] = [
    *options_of(LoadOptions),
    *options_of(InferConfig),
    *options_of(ServingOptions, exclude=("max_query_samples",), **RUN_KNOBS),
]
# One model at one query size and bound; the layouts and batching policies are its grid.
INFER_SEARCH: list[Declared] = [
    *options_of(LoadOptions, exclude=("qps", "query_size", "sla_ms")),
    *options_of(SearchSpace),
    *options_of(InferConfig, exclude=("max_issue_lag_ms", "alone", "trace"), **SEARCH_CHANGES),
    *options_of(SearchOptions),
    *options_of(ServingOptions, exclude=("instances", "threads", "max_batch", "max_delay_ms", "max_query_samples")),
]
# One model's serving builds side by side: how it is served, not a load
INFER_BUILDS: list[Declared] = [
    *options_of(LoadOptions, only=("model",)),
    *options_of(BuildTableOptions),
    *options_of(
        ServingOptions,
        only=("threads", "precision", "table_precision", "data_spec", "checkpoint", "table_scale", "max_rows"),
    ),
    *options_of(InferConfig, only=("seed",)),
]
# The served models as `infer run` takes them, behind a gRPC front of their own
SERVE: list[Declared] = [
    *options_of(LoadOptions, only=("model",)),
    *options_of(ServeOptions),
    *options_of(ServingOptions, exclude=("history_cache_mb", "attention", "history_affinity", "set")),
    *options_of(InferConfig, only=("device", "pin_cores")),
]
# `infer run --target grpc://HOST:PORT` under its former name: its own load words, the rest passed on
CLIENT: list[Declared] = [
    *options_of(ClientOptions),
    *options_of(LoadOptions, only=("arrival",)),
    *options_of(InferConfig, only=(*CLIENT_CHANGES, "percentile", "max_issue_lag_ms"), **CLIENT_CHANGES),
]
COMMANDS = {
    "train": TRAIN,
    "infer run": INFER_RUN,
    "infer search": INFER_SEARCH,
    "infer builds": INFER_BUILDS,
    "serve": SERVE,
    "client": CLIENT,
}
# Every config field a command line sets, by the flag that sets it (`timeout_s`: --timeout)
_CONFIGS = (
    PresetChoice,
    TrainConfig,
    LoadOptions,
    InferConfig,
    ServingOptions,
    SearchSpace,
    SearchOptions,
    BuildTableOptions,
    ServeOptions,
    ClientOptions,
)
# What the library names by field of the commands whose options are not declared yet (`data gen`, `launch`,
# `scale`, `compare`, `machine`, `report`) and of the command line alone (`--metrics-dir`): each is --field-name
_UNDECLARED = (
    "metrics_dir",
    "out",
    "rows",
    "shards",
    "format",
    "spec",
    "window",
    "launcher",
    "nproc",
    "nnodes",
    "rdzv_endpoint",
    "mode",
    "ranks",
    "project",
    "threshold",
    "by_machine",
    "base_machine",
    "instance_type",
    "catalogue",
    "comms_only",
)
FLAGS = {f: "--" + f.replace("_", "-") for f in _UNDECLARED} | {
    d.field: d.flag for config in _CONFIGS for d in options_of(config)
}


def flag(field: str) -> str:
    """How the command line names a config's field (`FieldError.named`); a field no option sets keeps its name."""
    return FLAGS.get(field, field)


@contextmanager
def _by_flag() -> Iterator[None]:
    """The setups take options by their command-line names: their errors name the fields so too."""
    try:
        yield
    except FieldError as exc:
        raise exc.spelt(flag) from None


@_by_flag()
def train_words(words: list[str]) -> OptionValues:
    """The `dlrm-lab train` options in a command line's words (after `scale --`, or a TorchX component's), keyed
    as a sweep's options are (`batch-size`, `set`): those given, each checked as `train` checks it."""
    return parse_words([*TRAIN, *_CLI_WORDS], words, "train")


@_by_flag()
def train_setup(options: Mapping[str, OptionValue]) -> tuple[Spec, TrainConfig]:
    """The model and the training config of `dlrm-lab train` with these options (the rest default)."""
    o = given(options, TRAIN, "train", CLI_ONLY)
    spec = build(PresetChoice, TRAIN, o).load()  # either family: DLRM or the HSTU ranker
    cfg = build(TrainConfig, TRAIN, o)

    # where --set changes the samples (the ranker's requests) the size line shows them (train() keeps them)
    return family_of(spec).with_data_overrides(spec, cfg.data_overrides, serving=False), cfg


# How the lab's own server serves: a remote server serves as its own start said (its `dlrm-lab serve` options)
SERVER_SIDE = (
    *("instances", "threads", "max_delay_ms", "max_queue", "min_piece", "spin_ms", "keep_warm_ms", "idle_hold"),
    *("precision", "table_precision", "build", "history_cache_mb", "attention", "history_affinity", "pin_cores"),
    *("device", "batch_memory", "allocator", "table_pages"),
)
# The serving options a client with a remote --target uses too: the model its queries are for (its tables, its
# samples: the library is made from them and the max batch) and what it sends (the largest query); --checkpoint is
# refused apart (`infer.targets.check_remote_models`). Every serving option is in one of the two (a test).
CLIENT_SIDE = ("table_scale", "max_rows", "data_spec", "data_overrides", "max_batch", "max_query_samples", "checkpoint")


def _refuse_server_side(o: OptionValues, declared: list[Declared]) -> None:
    """With a remote --target, an option of how the lab's own server serves, set to other than its default, is
    refused (as --checkpoint is, `infer.targets.check_remote_models`): the run would record what was never served."""
    from dlrm_lab.infer.targets import parse_target

    target = cast(str, o.get("target") or "in-process")  # --target: a string option
    if parse_target(target).sets_policy:
        return
    for d in declared:
        value = o.get(d.name)
        if d.name in SERVER_SIDE and value is not None and value != d.default and value != "auto":  # auto: the
            # config's own refusal says why (its knobs are chosen on a server in this process)
            raise FieldError(
                d.name,
                f"{value}: {{target}} {target}: a remote server serves as its own start said (give it to its "
                "dlrm-lab serve); the run would record what it never served",
                "target",
            )


@_by_flag()
def infer_setup(options: Mapping[str, OptionValue]) -> tuple[list[Any], Any, InferConfig]:
    """The served models, the load plan and the config of `dlrm-lab infer run` with these options."""
    from dlrm_lab.infer.targets import parse_target
    from dlrm_lab.infer.tune import KNOBS, parse_knob

    o = given(options, INFER_RUN, "infer run", CLI_ONLY)
    _refuse_server_side(o, INFER_RUN)
    for d in INFER_RUN:
        if d.name in KNOBS and o.get(d.name) is None:
            o[d.name] = d.default  # the command's (max_batch: auto, infer.tune)
    target = cast(str, o.get("target") or "in-process")  # --target: a string option
    if not parse_target(target).sets_policy and o["max_batch"] == "auto":
        o["max_batch"] = None  # a remote server batches as it does: no max batch to choose here
    tune = []
    for knob in KNOBS:  # auto: chosen by measurement on the running server (infer.tune)
        if o.get(knob) is not None:
            value = parse_knob(knob, o[knob])
            if value is None:
                tune.append(knob)
            o[knob] = None if value is None else (int(value) if knob == "max_batch" else value)
    served = build(ServingOptions, INFER_RUN, o).served(o.get("model"))
    if "keep_warm_ms" in tune:  # auto probes a keep-warm: a family that takes none says so now
        from dlrm_lab.infer.tune import KEEP_WARM_PROBE_MS

        for m in served:
            serving_of(m.spec).check_served(replace(m, keep_warm_ms=KEEP_WARM_PROBE_MS))
    load = build(LoadOptions, INFER_RUN, o).plan(served)
    cfg = build(
        InferConfig,
        INFER_RUN,
        o,
        sla_ms=load.streams[0].sla_ms,
        qps_auto=load.qps_auto,
        sla_auto=load.sla_auto,
        tune=tuple(tune),
    )
    return served, load, cfg


@_by_flag()
def search_setup(options: Mapping[str, OptionValue]) -> tuple[Any, Any, Any, InferConfig, SearchOptions]:
    """The served model, its load stream, the grid, the config and the probing of `dlrm-lab infer search`."""
    from dlrm_lab.infer.options import default_sla_ms, plan_load

    o = given(options, INFER_SEARCH, "infer search", CLI_ONLY)
    _refuse_server_side(o, INFER_SEARCH)
    space = build(SearchSpace, INFER_SEARCH, o)
    grid = space.grid()
    (base,) = build(ServingOptions, INFER_SEARCH, o).served(o.get("model"))
    sla_ms = default_sla_ms(base.spec) if space.sla_ms is None else space.sla_ms
    cfg = build(InferConfig, INFER_SEARCH, o, sla_ms=sla_ms)
    probing = build(SearchOptions, INFER_SEARCH, o)
    load = build(LoadOptions, INFER_SEARCH, o)
    (stream,) = plan_load([base], ["1"], [space.query_size], [str(sla_ms)], load.arrival, load.order).streams
    return base, stream, grid, cfg, probing


@_by_flag()
def builds_setup(options: Mapping[str, OptionValue]) -> tuple[Any, BuildTableOptions, int]:
    """The served model, what to compare and the seed of `dlrm-lab infer builds` with these options."""
    o = given(options, INFER_BUILDS, "infer builds", CLI_ONLY)
    models = cast("Sequence[str]", o.get("model") or [])  # --model: a list option of names
    if len(models) > 1:
        raise FieldError("model", f"{', '.join(models)}: one model's builds at a time")
    (served,) = build(ServingOptions, INFER_BUILDS, o).served(models)
    table = build(BuildTableOptions, INFER_BUILDS, o)
    table.size_list()  # a bad list is one line before anything is built
    return served, table, build(InferConfig, INFER_BUILDS, o).seed


@_by_flag()
def serve_setup(options: Mapping[str, OptionValue]) -> tuple[list[Any], ServeOptions]:
    """The served models and the gRPC front of `dlrm-lab serve` with these options."""
    o = given(options, SERVE, "serve", CLI_ONLY)
    return build(ServingOptions, SERVE, o).served(o.get("model")), build(ServeOptions, SERVE, o)


# Each command's setup by its name: what builds its typed configs from its options, checking them as it runs would
SETUPS: dict[str, Any] = {
    "train": train_setup,
    "infer run": infer_setup,
    "infer search": search_setup,
    "infer builds": builds_setup,
    "serve": serve_setup,
}


def check_command_words(words: list[str]) -> str | None:
    """A `dlrm-lab` command line of a command whose options the library declares (train, infer run|search|builds,
    serve), checked as that command checks it before anything starts: one UserError naming the culprit. The
    command's name, or None for another command (its own parser checks it where it runs)."""
    name = " ".join(words[:2]) if words[:1] == ["infer"] else " ".join(words[:1])
    if name not in SETUPS:
        return None
    rest = words[len(name.split()) :]
    SETUPS[name](parse_words([*COMMANDS[name], *_CLI_WORDS], rest, name))
    return name
