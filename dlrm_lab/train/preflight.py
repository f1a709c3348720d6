"""A training run's checks before any work (`preflight`), callable alone: the CLI runs them before its size line.

What they read and resolved (`ResolvedRun`: the spec, the config, `--shard` parsed against the model's tables, the
synthetic data's spec) is what `train` starts from, so that nothing is checked or read twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

from dlrm_lab.config import TrainConfig
from dlrm_lab.config.family import Spec, SpecIn, family_of
from dlrm_lab.data import BatchSource, DataSpec, check_data_options, open_sources
from dlrm_lab.data.streaming import streaming_of
from dlrm_lab.distributed.context import DistContext, detect_launch, resolve_device
from dlrm_lab.distributed.plan import check_table_types, parse_table_sharding
from dlrm_lab.distributed.wrap import table_sharder


class TrainingChecks(Protocol[SpecIn]):
    """A family's own rules for a training run (a role of `config.family`'s families in this room's types: every
    family has it, each checked against it where it is defined)."""

    def check_training(self, spec: SpecIn, cfg: TrainConfig) -> None: ...


@dataclass(frozen=True)
class ResolvedRun:
    """A training run as `preflight` checked it: what `train` starts from, so that nothing is checked or read twice."""

    spec: Spec
    cfg: TrainConfig
    per_table: dict[str, str]  # --shard, parsed against the model's tables
    # the synthetic data's spec, read once with its --set overrides (None: a dataset on disk, samples its preset
    # describes as the HSTU ranker's requests, or data left unchecked because the caller brings its own sources)
    data_spec: DataSpec | None = None

    def open_data(self, ctx: DistContext, eval_batches: int, start_batch: int = 0) -> tuple[BatchSource, BatchSource]:
        """This rank's training and held-out sources, from the data spec read by `preflight` (not read again);
        `--protocol streaming`: the windows in time order and, at each evaluation, the window after."""
        cfg = self.cfg
        if cfg.protocol == "streaming":
            return streaming_of(family_of(self.spec)).open_stream(
                self.spec,
                cfg.batch_size,
                rank=ctx.rank,
                world_size=ctx.world_size,
                eval_batches=eval_batches,
                seed=cfg.seed,
                start_batch=start_batch,
            )
        data_spec, overrides = (cfg.data_spec, cfg.data_overrides) if self.data_spec is None else (self.data_spec, ())
        return open_sources(
            self.spec,
            cfg.data,
            cfg.batch_size,
            ctx.rank,
            ctx.world_size,
            eval_batches,
            data_spec,
            overrides,
            cfg.seed,
            start_batch=start_batch,
        )


def preflight(spec: Spec, cfg: TrainConfig, *, data: bool = True) -> ResolvedRun:
    """The checks `train` makes before any work, callable alone (the CLI runs them before its
    size line): the device exists, `--shard` names real tables and types, and (with `data`)
    the data options fit the model. Each failure is one UserError. The run as checked, with
    what the checks read, is what `train(run)` starts from."""
    device = resolve_device(cfg.device)
    family = family_of(spec)
    cast("TrainingChecks[Spec]", family).check_training(spec, cfg)  # its rules (the ranker's pipeline, a DLRM's memory)
    if cfg.protocol == "streaming":
        streaming_of(family, spec.name)  # one line where its family has no time windows
    per_table = parse_table_sharding(cfg.shard, [t.name for t in spec.tables])
    check_table_types(spec.name, table_sharder(spec).sharding_types(device.type), cfg.sharding, per_table)
    data_spec = check_data_options(spec, cfg.data, cfg.data_spec, cfg.data_overrides) if data else None
    if cfg.protocol == "streaming" and data:  # the stream holds a global batch a window: checked before any work
        streamed = family.with_data_overrides(spec, cfg.data_overrides, serving=False)
        streaming_of(family).stream(streamed, cfg.batch_size * detect_launch().world_size)
    return ResolvedRun(spec, cfg, per_table, data_spec)
