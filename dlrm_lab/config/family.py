"""What a model family provides to the lab (`ModelFamily`), and the registry every room asks (`family_of`).

A family is what a preset's `family` key names (a preset without one is a DLRM). Everything that
differs between families (how a preset parses, how the model is built, what a sample costs,
which data and sample library it uses, how an instance serves it, what it holds in memory, how it
is described) is a method of its `ModelFamily`; the rest of the lab asks `family_of(spec)` and
never branches on the family itself.

The protocol and the registry stand on the ground floor (they import nothing of the lab above `errors`), so that
any room may ask them; the implementations stand above every room they compose (`dlrm_lab.families`: one module
each, found by `pkgutil`) and register themselves (`register_family`) when the package is imported, as TorchRec's
planner takes its estimators or LoadGen its SUT. `dlrm_lab/__init__.py` imports them, so no caller of the
registry finds it empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import UserError

if TYPE_CHECKING:
    import numpy as np

Spec = Any  # a family's typed preset (config.specs.ModelSpec, config.hstu.HSTUSpec, ...)


class ModelFamily(Protocol):
    """What one model family provides. `Spec` is its typed preset (ModelSpec, HSTUSpec, ...)."""

    name: str  # the preset's `family` value
    label: str  # in words: "DLRM", "HSTU ranker"
    called: str  # as a sentence names one of its models: "a DLRM", "the HSTU ranker"
    spec_type: type  # its typed spec
    builds: tuple[str, ...]  # the serving builds it has (infer.builds, by name)
    no_compiled_build: str  # why it has no `compiled` build ("" when it has one)
    attention_paths: tuple[str, ...]  # attention paths to choose between; () for none
    wire_samples: bool  # whether the gRPC transports carry its samples
    # its own columns in shared tables: (table, after column, [Column or name]) each (`metrics.columns`)
    columns: tuple[tuple[str, str, list[Any]], ...]
    samples_in_spec: bool  # whether its preset describes its samples (then `--set` changes the spec)
    projectable: bool  # whether `scale --project` projects it (train.scaling_model)
    cost_batch: int  # samples (a request for a ranker) an instance times its batch cost over, at most
    max_warmup_batch: int | None  # the largest batch an instance warms up with (None: the largest it serves)

    # ----- presets and specs (config)
    def parse_preset(self, raw: JsonObject, *, where: str, table_scale: float | None, max_rows: int | None) -> Any: ...

    def spec_from_dict(self, data: JsonObject) -> Any: ...

    def with_data_overrides(self, spec: Any, overrides: Sequence[str], *, serving: bool) -> Any:
        """The spec with `--set KEY=VALUE` applied where a family's samples are part of its spec
        (the ranker's requests); a DLRM's overrides go to its data spec (train) or are refused (serving)."""
        ...

    def size_line(self, spec: Any) -> str: ...

    def describe(self, spec: Any) -> tuple[list[str], tuple[list[str], list[list[str]]] | None]:
        """`presets show`: lines (the shapes, the cost per sample, the data) and a table (columns, rows) or None."""
        ...

    def preset_table(self, specs: Sequence[Any]) -> tuple[str, list[str], list[list[str]]]:
        """`presets`: the title, columns and one row per preset of this family."""
        ...

    # ----- the model and its cost (model/, metrics/)
    def build(self, spec: Any, device: Any, table_device: Any, table_precision: str, attention: str) -> Any: ...

    def sample_cost(self, spec: Any, table_precision: str, optimizer: str, window: str) -> Any: ...

    def communication_bytes(
        self, spec: Any, global_batch: int, world_size: int, sharding: dict[str, str]
    ) -> dict[str, float]: ...

    def gemm_shapes(self, spec: Any, rows: int, max_rows: int) -> list[tuple[int, int, int]]:
        """The dense matrix products of one forward pass of `rows` samples: (rows, in, out) each, at most
        `max_rows` tall (a taller product runs at the same rate per FLOP)."""
        ...

    def embedding_lr(self, spec: Any, default: float) -> tuple[float, str]:
        """The tables' learning rate when none is given, and why."""
        ...

    def sharder(self, spec: Any) -> Any: ...

    def request_flops_curve(self, spec: Any) -> tuple[str, tuple[Any, int, int], float] | None:
        """The report's FLOPs-per-request curve (label, (shape, candidates, longest history), mean history),
        for a family whose sample is a request of a history; None otherwise."""
        ...

    # ----- training (train/, data/)
    def check_training(self, spec: Any, cfg: Any) -> None: ...

    def check_data_options(self, spec: Any, data: str, data_spec: str | None, overrides: Sequence[str]) -> Any: ...

    def open_sources(self, spec: Any, data: str, batch_size: int, **how: Any) -> tuple[Any, Any]: ...

    def dataset_writer(
        self,
        spec: Any,
        *,
        rows: int,
        shards: int,
        seed: int,
        fmt: str,
        data_spec: str | None,
        overrides: Sequence[str],
        window: str,
    ) -> Any:
        """`data gen`'s writer of this family's synthetic samples (`families.dlrm.DatasetWriter`), checked."""
        ...

    # ----- serving (infer/, serve/)
    def check_served(self, served: Any) -> None: ...

    def serving_model(self, served: Any, seed: int, log: Any) -> tuple[Any, Any, JsonObject | None]:
        """The model an instance will serve, with the server's seed: the model, `served` with any measured
        choice resolved (the ranker's attention path), and that choice's record (None for none)."""
        ...

    def sample_library(self, served: Any, seed: int, samples: int) -> Any: ...

    def library_from_arrays(self, arrays: dict[str, np.ndarray]) -> Any:
        """Its sample library from the arrays of a snapshot (mapped, shared by every instance)."""
        ...

    def held_out(self, served: Any, library: Any, seed: int) -> Any:
        """Samples beyond the served ones that a serving build's accuracy check scores."""
        ...

    def memory(self, served: Any) -> Any: ...

    def count_columns(self, served: Any, counts: Any) -> dict[str, int | None]:
        """A served query's row columns from what its instances counted of it (`BatchResult.counts`)."""
        ...

    def summarize_queries(
        self, records: list[dict[str, str | float | bool | None]], ok: Any, samples: Any
    ) -> dict[str, float | None]:
        """Its summary columns of a point's query rows (`metrics.columns.QueryRow`s, their columns' scalars; `ok`: the
        completed ones; `samples` per row)."""
        ...

    def make_fused(self, model: Any, *, precision: str, table_precision: str) -> Any: ...

    def check_samples(self, block: Any) -> Any:
        """Held-out samples as both models of a build's accuracy check score them."""
        ...

    def score(self, module: Any, samples: Any, precision: str, autocast: bool) -> Any:
        """A build's scores (numpy) of held-out samples."""
        ...

    def make_runner(self, model: Any, library: Any, device: Any, precision: str, history_cache_mb: float) -> Any: ...

    def id_rows(self, spec: Any) -> list[int]:
        """Per sparse feature a query may send, its table's rows ([] where queries carry no ids)."""
        ...


_REGISTRY: dict[str, ModelFamily] = {}


TRAINING_MEMORY_SHARE = 0.9  # of the memory available: what a family's training on this host may plan to hold


def register_family(family: ModelFamily) -> None:
    """Make `family` known by its name (an implementation registers itself when imported)."""
    _REGISTRY[family.name] = family


def families() -> dict[str, ModelFamily]:
    """Every registered family by name."""
    return _REGISTRY


def family_named(name: str, where: str = "family") -> ModelFamily:
    try:
        return families()[name]
    except KeyError:
        raise UserError(f"{where}: unknown model family {name!r}; known: {', '.join(sorted(families()))}") from None


def family_of(spec: Any) -> ModelFamily:
    """The family of a typed spec (or of a model, a served model or anything carrying `.spec`)."""
    spec = getattr(spec, "spec", spec)
    for family in families().values():
        if isinstance(spec, family.spec_type):
            return family
    # a spec-like object (its fields, not its type: tests of a model's own checks) names its family, or is a DLRM
    name = getattr(spec, "family", "dlrm")
    if name in families():
        return families()[name]
    raise TypeError(f"no model family has specs of type {type(spec).__name__} (family {name!r})")


def preset_family_name(raw: JsonObject) -> str:
    """The family a parsed preset (or a spec's `to_dict`) names: DLRM where it names none."""
    return str(raw.get("family", "dlrm"))


def spec_from_dict(data: JsonObject) -> Any:
    """A model spec of any family from its `to_dict` form (as run manifests hold it)."""
    return family_named(preset_family_name(data)).spec_from_dict(data)


__all__ = [
    "ModelFamily",
    "Spec",
    "families",
    "family_named",
    "family_of",
    "preset_family_name",
    "register_family",
    "spec_from_dict",
]
