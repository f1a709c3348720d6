"""Data: synthetic generators, Parquet datasets, Criteo logs, all as batch sources.

A source is anything iterable over `torchrec.datasets.utils.Batch` (dense float32
[B, num_dense], a KeyedJaggedTensor over the model's feature names, float32 labels [B])
that can `describe()` itself for the run manifest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from torchrec.datasets.utils import Batch

from dlrm_lab.config import HSTUSpec, ModelSpec
from dlrm_lab.data.parquet import ParquetSource
from dlrm_lab.data.sequences import SequenceGenerator, SequenceSource, with_overrides
from dlrm_lab.data.source import SyntheticSource
from dlrm_lab.data.spec import DataSpec, load_data_spec
from dlrm_lab.data.synthetic import SyntheticGenerator
from dlrm_lab.errors import UserError

HELD_OUT_OFFSET = 1 << 40  # held-out samples start far beyond any training sample index


class BatchSource(Protocol):
    def __iter__(self) -> Iterator[Batch]: ...

    def describe(self) -> dict[str, Any]: ...


def resolve_data_spec(model: ModelSpec, data_spec: str | None = None, overrides: tuple[str, ...] = ()) -> DataSpec:
    """The data spec a synthetic source of `model` uses (default: the one the preset names,
    else uniform), `--set` overrides applied and checked: callers check it before starting
    anything, so a bad value is one line and no run directory."""
    return load_data_spec(data_spec or model.data_spec or "uniform", model, tuple(overrides))


def check_data_options(
    model: ModelSpec, data: str, data_spec: str | None = None, overrides: tuple[str, ...] = ()
) -> DataSpec | None:
    """The data spec a run on `data` generates from, checked (None for a dataset on disk,
    where `--data-spec`/`--set` cannot apply, and for an HSTU preset, whose requests its own
    [data] table describes): callers check before they start anything."""
    if isinstance(model, HSTUSpec):
        if data != "synthetic":
            raise UserError(f"--data {data}: {model.name} trains on its synthetic requests (--data synthetic) only")
        if data_spec:
            raise UserError(
                f"--data-spec: {model.name}'s requests are its preset's [data] table (change it with --set)"
            )
        with_overrides(model, overrides)  # checked here; the run applies them to its spec (train())
        return None
    if data == "synthetic":
        return resolve_data_spec(model, data_spec, overrides)
    if data_spec or overrides:
        raise UserError("--data-spec/--set apply to --data synthetic, not to a dataset on disk")
    return None


def synthetic_generator(
    model: ModelSpec, data_spec: str | None = None, overrides: tuple[str, ...] = (), seed: int = 0
) -> SyntheticGenerator:
    """The generator of `data_spec` (see `resolve_data_spec`)."""
    return SyntheticGenerator(resolve_data_spec(model, data_spec, overrides), seed)


def open_sources(
    model: ModelSpec,
    data: str,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    eval_batches: int = 8,
    data_spec: str | None = None,
    overrides: tuple[str, ...] = (),
    seed: int = 0,
    start_batch: int = 0,
) -> tuple[BatchSource, BatchSource]:
    """Training and held-out sources for one rank.

    `data` is "synthetic" or a Parquet dataset path. Held-out samples come from the same
    generator far past any training sample; for a dataset without a generator spec
    (converted Criteo) they are the dataset's first batches, and the description says so.
    """
    spec = check_data_options(model, data, data_spec, overrides)
    if isinstance(model, HSTUSpec):  # requests in time order; held out: the later window
        requests = SequenceGenerator(model.data, seed)
        return (
            SequenceSource(requests, batch_size, rank, world_size, "train", start_batch=start_batch),
            SequenceSource(requests, batch_size, rank, world_size, "eval", num_batches=eval_batches),
        )
    if spec is not None:
        gen = SyntheticGenerator(spec, seed)
        train = SyntheticSource(gen, batch_size, rank, world_size, start_batch=start_batch)
        held_out = SyntheticSource(gen.clone(), batch_size, rank, world_size, eval_batches, offset=HELD_OUT_OFFSET)
        return train, held_out
    train = ParquetSource(data, model, batch_size, rank, world_size, start_batch=start_batch)
    info = train.info
    if info.get("data_spec") is not None:
        spec = DataSpec.from_dict(info["data_spec"])
        gen = SyntheticGenerator(spec, int(info.get("seed", 0)))
        return train, SyntheticSource(gen, batch_size, rank, world_size, eval_batches, offset=HELD_OUT_OFFSET)
    return train, _FirstBatches(ParquetSource(data, model, batch_size, rank, world_size, eval_batches, epochs=1))


class _FirstBatches:
    """Held-out stand-in for datasets without a generator: their first batches, labelled as such."""

    def __init__(self, source: ParquetSource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.source)

    def describe(self) -> dict[str, Any]:
        return {**self.source.describe(), "held_out": False, "note": "evaluated on the dataset's first batches"}


__all__ = [
    "HELD_OUT_OFFSET",
    "Batch",
    "BatchSource",
    "DataSpec",
    "ParquetSource",
    "SyntheticGenerator",
    "SyntheticSource",
    "load_data_spec",
    "open_sources",
    "synthetic_generator",
]
