"""How a model family serves its models (`ServingParts`), in the serving room's own types.

The role is the serving room's, as `data.DataParts` is the data room's: it speaks of a served model, a sample
library, a batch runner and what a served model holds in memory, which stand on this floor, not in `config`. It
names them structurally (`Served`, `BatchRunner`) or by the lowest modules that define them (`infer.library`,
`infer.batches`), so that every module that asks the role (`serving_of`), the served model's own checks among
them, stands above this one. Each family is checked against it where it is defined (`families/`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from dlrm_lab.config.family import HasSpec, ModelFamily, SpecIn, SpecOut, SpecT, families, family_of
from dlrm_lab.config.values import Log

if TYPE_CHECKING:
    import numpy as np
    import torch

    from dlrm_lab.config.hstu import HSTUSpec
    from dlrm_lab.config.specs import ModelSpec
    from dlrm_lab.config.values import JsonObject
    from dlrm_lab.data.sequences import RequestBlock
    from dlrm_lab.data.synthetic import SampleBlock
    from dlrm_lab.infer.batches import QueryRef
    from dlrm_lab.infer.batching import BatchCost
    from dlrm_lab.infer.library import LoadedSamples, PackedLibrary
    from dlrm_lab.model.checkpoint import TrainedCheckpoint


class Served(Protocol[SpecOut]):
    """What a family reads of a model as served (`infer.served.ServedModel` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> SpecOut: ...
    @property
    def instances(self) -> int: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def keep_warm_ms(self) -> float: ...
    @property
    def table_precision(self) -> str: ...
    @property
    def data_spec(self) -> str | None: ...
    @property
    def library_samples(self) -> int: ...
    @property
    def history_cache_mb(self) -> float: ...
    @property
    def attention(self) -> str: ...
    @property
    def build(self) -> str: ...
    @property
    def checkpoint(self) -> TrainedCheckpoint | None: ...


class BatchRunner(Protocol):
    """An instance's batch runner: scores of the library samples a batch's queries name (`infer.batches`)."""

    # what it counted per query of the last batch (`infer.instance.BatchResult.counts`; None: nothing counted)
    counts: np.ndarray | None
    stages: tuple[float | None, ...] | None  # the last batch's stages (`infer.batches.BATCH_STAGES`), ms

    def __call__(self, refs: list[QueryRef]) -> np.ndarray: ...

    def warm_up(self, max_batch: int) -> None: ...

    def batch_cost(self, large: int, repeats: int = 5) -> BatchCost: ...


@dataclass(frozen=True)
class ModelMemory:
    """Bytes one served model needs (host RAM unless `device_per_instance`): what its family says it holds."""

    name: str
    fp32_tables: int
    snapshot: int
    library: int
    per_instance: int  # private host memory of one instance
    instances: int
    device_per_instance: int  # on a GPU: device memory of one instance
    build_peak: int = 0  # while the parent makes and times its serving build (0: its fp32 tables)

    @property
    def steady(self) -> int:
        return self.snapshot + self.library + self.instances * self.per_instance


class ServingParts(Protocol[SpecIn]):
    """How an instance serves a family's models (infer/, serve/)."""

    def check_served(self, served: Served[SpecIn]) -> None:
        """One line for a served model this family cannot serve so (its build, its options), before anything starts."""
        ...

    def serving_model(
        self, served: Served[SpecIn], seed: int, log: Log
    ) -> tuple[torch.nn.Module, str | None, JsonObject | None]:
        """The model an instance will serve, with the server's seed: the model, the attention path it chose where
        `served.attention` asked it to (the ranker's; None: nothing chosen) and that choice's record."""
        ...

    def sample_library(self, served: Served[SpecIn], seed: int, samples: int) -> LoadedSamples: ...

    def library_from_arrays(self, arrays: dict[str, np.ndarray]) -> LoadedSamples:
        """Its sample library from the arrays of a snapshot (mapped, shared by every instance)."""
        ...

    def held_out(self, served: Served[SpecIn], library: LoadedSamples, seed: int) -> SampleBlock | RequestBlock:
        """Samples beyond the served ones that a serving build's accuracy check scores."""
        ...

    def memory(self, served: Served[SpecIn]) -> ModelMemory: ...

    def count_columns(self, served: Served[SpecIn], counts: np.ndarray | None) -> Mapping[str, int | None]:
        """A served query's row columns from what its instances counted of it (`BatchResult.counts`)."""
        ...

    def summarize_queries(
        self, records: Sequence[Mapping[str, object]], ok: np.ndarray, samples: np.ndarray
    ) -> Mapping[str, float | None]:
        """Its summary columns of a point's query rows (`metrics.columns.QueryRow`s; `ok`: the completed ones;
        `samples` per row)."""
        ...

    def make_fused(self, model: torch.nn.Module, *, precision: str, table_precision: str) -> torch.nn.Module: ...

    def check_samples(self, block: SampleBlock | RequestBlock) -> PackedLibrary | RequestBlock:
        """Held-out samples as both models of a build's accuracy check score them."""
        ...

    def score(
        self,
        module: torch.nn.Module,
        samples: PackedLibrary | SampleBlock | RequestBlock,
        precision: str,
        autocast: bool,
    ) -> np.ndarray:
        """A build's scores (numpy) of held-out samples."""
        ...

    def make_runner(
        self,
        model: torch.nn.Module,
        library: LoadedSamples,
        device: torch.device,
        precision: str,
        history_cache_mb: float,
    ) -> BatchRunner: ...


def serving_parts_of(family: ModelFamily[SpecT]) -> ServingParts[SpecT]:
    """`family`'s serving role: every family has it, each checked against it where it is defined."""
    return cast("ServingParts[SpecT]", family)


def every_serving() -> list[ServingParts[ModelSpec] | ServingParts[HSTUSpec]]:
    """Every registered family's serving role (a point's summary asks each for its own columns)."""
    return [cast("ServingParts[ModelSpec] | ServingParts[HSTUSpec]", f) for f in families().values()]


def serving_of(spec: SpecT | HasSpec[SpecT]) -> ServingParts[SpecT]:
    """The serving role of `spec`'s family (or of a model, a served model: anything carrying `.spec`)."""
    return serving_parts_of(family_of(spec))


def make_runner(
    model: torch.nn.Module,
    library: LoadedSamples,
    device: torch.device,
    precision: str,
    history_cache_mb: float = 0.0,
) -> BatchRunner:
    """The batch runner of a build: the HSTU ranker's (`history_cache_mb`: its history reuse), a fused or
    compiled DLRM, or the eager DLRM."""
    return serving_of(model.spec).make_runner(model, library, device, precision, history_cache_mb)


__all__ = [
    "BatchRunner",
    "ModelMemory",
    "Served",
    "ServingParts",
    "every_serving",
    "make_runner",
    "serving_of",
    "serving_parts_of",
]
