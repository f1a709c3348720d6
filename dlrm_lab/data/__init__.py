"""Data: synthetic generators, Parquet datasets, Criteo logs, all as batch sources.

A source is anything iterable over `torchrec.datasets.utils.Batch` (dense float32
[B, num_dense], a KeyedJaggedTensor over the model's feature names, float32 labels [B])
that can `describe()` itself for the run manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from torchrec.datasets.utils import Batch

from dlrm_lab.config import ModelSpec
from dlrm_lab.config.family import SpecIn, SpecT, family_of
from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.parquet import ParquetSource
from dlrm_lab.data.source import SyntheticSource
from dlrm_lab.data.spec import DataSpec, load_data_spec
from dlrm_lab.data.synthetic import SyntheticGenerator

HELD_OUT_OFFSET = 1 << 40  # held-out samples start far beyond any training sample index


class BatchSource(Protocol):
    def __iter__(self) -> Iterator[Batch]: ...

    def describe(self) -> JsonObject: ...


class DatasetWriter(Protocol):
    """`data gen`'s writer of a family's synthetic samples: what it will write, then the writing."""

    @property
    def headline(self) -> str: ...
    @property
    def rows(self) -> int: ...
    @property
    def unit(self) -> str: ...  # what a row is, in words: "samples", "requests"

    def write(self, out: str | Path, on_progress: Callable[[int], None]) -> None: ...


class DataParts(Protocol[SpecIn]):
    """A family's data: what its runs generate or read, and `data gen`'s writer (a role of `config.family`'s
    families that speaks in this room's types; `data_parts` asks for it)."""

    def check_data_options(
        self, spec: SpecIn, data: str, data_spec: str | None, overrides: Sequence[str]
    ) -> DataSpec | None: ...

    def open_sources(
        self,
        spec: SpecIn,
        data: str,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        eval_batches: int,
        data_spec: str | DataSpec | None,
        overrides: Sequence[str],
        seed: int,
        start_batch: int,
    ) -> tuple[BatchSource, BatchSource]: ...

    def dataset_writer(
        self,
        spec: SpecIn,
        *,
        rows: int,
        shards: int,
        seed: int,
        fmt: str,
        data_spec: str | None,
        overrides: Sequence[str],
        window: str,
    ) -> DatasetWriter:
        """`data gen`'s writer of this family's synthetic samples, checked."""
        ...


def data_parts(spec: SpecT) -> DataParts[SpecT]:
    """The data role of `spec`'s family (every family has it: each is checked against it where it is defined)."""
    return cast("DataParts[SpecT]", family_of(spec))


def resolve_data_spec(
    model: ModelSpec, data_spec: str | DataSpec | None = None, overrides: tuple[str, ...] = ()
) -> DataSpec:
    """The data spec a synthetic source of `model` uses (default: the one the preset names,
    else uniform), `--set` overrides applied and checked: callers check it before starting
    anything, so a bad value is one line and no run directory. A spec already resolved (what
    `train.preflight` read, its overrides applied) is used as it is: the file is read once."""
    if isinstance(data_spec, DataSpec):
        return data_spec
    return load_data_spec(data_spec or model.data_spec or "uniform", model, tuple(overrides))


def check_data_options(
    model: Any, data: str, data_spec: str | None = None, overrides: tuple[str, ...] = ()
) -> DataSpec | None:
    """The data spec a run on `data` generates from, checked (None for a dataset on disk,
    where `--data-spec`/`--set` cannot apply, and for a family whose samples its preset
    describes, as the HSTU ranker's requests): callers check before they start anything."""
    return data_parts(model).check_data_options(model, data, data_spec, overrides)


def synthetic_generator(
    model: ModelSpec, data_spec: str | None = None, overrides: tuple[str, ...] = (), seed: int = 0
) -> SyntheticGenerator:
    """The generator of `data_spec` (see `resolve_data_spec`)."""
    return SyntheticGenerator(resolve_data_spec(model, data_spec, overrides), seed)


def open_sources(
    model: Any,
    data: str,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    eval_batches: int = 8,
    data_spec: str | DataSpec | None = None,  # a data spec preset or file, or one already read
    overrides: tuple[str, ...] = (),
    seed: int = 0,
    start_batch: int = 0,
) -> tuple[BatchSource, BatchSource]:
    """Training and held-out sources for one rank.

    `data` is "synthetic" or a Parquet dataset path. Held-out samples come from the same
    generator far past any training sample; for a dataset without a generator spec
    (converted Criteo) they are the dataset's first batches, and the description says so.
    """
    return data_parts(model).open_sources(
        model,
        data,
        batch_size,
        rank=rank,
        world_size=world_size,
        eval_batches=eval_batches,
        data_spec=data_spec,
        overrides=overrides,
        seed=seed,
        start_batch=start_batch,
    )


class FirstBatches:
    """Held-out stand-in for datasets without a generator: their first batches, labelled as such."""

    def __init__(self, source: ParquetSource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.source)

    def describe(self) -> JsonObject:
        return {**self.source.describe(), "held_out": False, "note": "evaluated on the dataset's first batches"}


__all__ = [
    "HELD_OUT_OFFSET",
    "Batch",
    "BatchSource",
    "DataSpec",
    "FirstBatches",
    "ParquetSource",
    "SyntheticGenerator",
    "SyntheticSource",
    "load_data_spec",
    "open_sources",
    "synthetic_generator",
]
