"""What a model family provides to the lab (`ModelFamily`), and the registry every room asks (`family_of`).

A family is what a preset's `family` key names (a preset without one is a DLRM). Everything that
differs between families (how a preset parses, how the model is built, what a sample costs,
which data and sample library it uses, how an instance serves it, what it holds in memory, how it
is described) is a method of one of its roles; the rest of the lab asks `family_of(spec)` and
never branches on the family itself.

The protocol and the registry stand on the ground floor (they import nothing of the lab above `errors`), so that
any room may ask them; the implementations stand above every room they compose (`dlrm_lab.families`: one module
each, found by `pkgutil`) and register themselves (`register_family`) when the package is imported, as TorchRec's
planner takes its estimators or LoadGen its SUT. `dlrm_lab/__init__.py` imports them, so no caller of the
registry finds it empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from dlrm_lab.config.hstu import HSTUSpec, RankerShape
from dlrm_lab.config.specs import ModelSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import UserError

if TYPE_CHECKING:
    import torch
    from torchrec.distributed.types import ModuleSharder

Spec = ModelSpec | HSTUSpec  # a family's typed preset
# One family's typed preset: each role below is generic in it, and `family_of(spec)` gives the family of that type
SpecT = TypeVar("SpecT", bound="ModelSpec | HSTUSpec")
SpecIn = TypeVar("SpecIn", bound="ModelSpec | HSTUSpec", contravariant=True)  # a role that only takes specs
SpecOut = TypeVar("SpecOut", bound="ModelSpec | HSTUSpec", covariant=True)  # what only gives one


class FamilyTraits(Protocol):
    """What the lab reads of a family without calling it: its names and what it has."""

    @property
    def name(self) -> str: ...  # the preset's `family` value
    @property
    def label(self) -> str: ...  # in words: "DLRM", "HSTU ranker"
    @property
    def called(self) -> str: ...  # as a sentence names one of its models: "a DLRM", "the HSTU ranker"
    @property
    def spec_type(self) -> type: ...  # its typed spec
    @property
    def builds(self) -> tuple[str, ...]: ...  # the serving builds it has (infer.builds, by name)
    @property
    def no_compiled_build(self) -> str: ...  # why it has no `compiled` build ("" when it has one)
    @property
    def attention_paths(self) -> tuple[str, ...]: ...  # attention paths to choose between; () for none
    @property
    def wire_samples(self) -> bool: ...  # whether the gRPC transports carry its samples
    @property
    def samples_in_spec(self) -> bool: ...  # whether its preset describes its samples (then `--set` changes the spec)
    @property
    def projectable(self) -> bool: ...  # whether `scale --project` projects it (train.scaling_model)
    @property
    def cost_batch(self) -> int: ...  # samples (a request for a ranker) an instance times its batch cost over
    @property
    def max_warmup_batch(self) -> int | None: ...  # the largest batch an instance warms up with (None: its largest)


class PresetParts(Protocol[SpecT]):
    """Its presets and specs (config, `presets`)."""

    def parse_preset(
        self, raw: JsonObject, *, where: str, table_scale: float | None, max_rows: int | None
    ) -> SpecT: ...

    def spec_from_dict(self, data: JsonObject) -> SpecT: ...

    def with_data_overrides(self, spec: SpecT, overrides: Sequence[str], *, serving: bool) -> SpecT:
        """The spec with `--set KEY=VALUE` applied where a family's samples are part of its spec
        (the ranker's requests); a DLRM's overrides go to its data spec (train) or are refused (serving)."""
        ...

    def size_line(self, spec: SpecT) -> str: ...

    def describe(self, spec: SpecT) -> tuple[list[str], tuple[list[str], list[list[str]]] | None]:
        """`presets show`: lines (the shapes, the cost per sample, the data) and a table (columns, rows) or None."""
        ...

    def preset_table(self, specs: Sequence[SpecT]) -> tuple[str, list[str], list[list[str]]]:
        """`presets`: the title, columns and one row per preset of this family."""
        ...


class CostModel(Protocol[SpecIn]):
    """What a sample of its models computes and sends (metrics/, distributed/, the report); what a sample costs in
    all is `model.cost.SampleCostParts`'s."""

    def communication_bytes(
        self, spec: SpecIn, global_batch: int, world_size: int, sharding: dict[str, str]
    ) -> dict[str, float]: ...

    def gemm_shapes(self, spec: SpecIn, rows: int, max_rows: int) -> list[tuple[int, int, int]]:
        """The dense matrix products of one forward pass of `rows` samples: (rows, in, out) each, at most
        `max_rows` tall (a taller product runs at the same rate per FLOP)."""
        ...

    def request_flops_curve(self, spec: SpecIn) -> tuple[str, tuple[RankerShape, int, int], float] | None:
        """The report's FLOPs-per-request curve (label, (shape, candidates, longest history), mean history),
        for a family whose sample is a request of a history; None otherwise."""
        ...

    def id_rows(self, spec: SpecIn) -> list[int]:
        """Per sparse feature a query may send, its table's rows ([] where queries carry no ids)."""
        ...


class TrainingParts(Protocol[SpecIn]):
    """How its models are built and sharded (model/, distributed/, train/). Its data (`data.DataParts`, and
    `data.streaming.StreamingParts` where its samples are windows in time) and its training checks
    (`train.preflight.TrainingChecks`) are roles of the rooms whose types they speak in."""

    def build(
        self, spec: SpecIn, device: torch.device, table_device: torch.device, table_precision: str, attention: str
    ) -> torch.nn.Module: ...

    def embedding_lr(self, spec: SpecIn, default: float) -> tuple[float, str]:
        """The tables' learning rate when none is given, and why."""
        ...

    def sharder(self, spec: SpecIn) -> ModuleSharder[torch.nn.Module]: ...


class ModelFamily(FamilyTraits, PresetParts[SpecT], CostModel[SpecT], TrainingParts[SpecT], Protocol[SpecT]):
    """What one model family provides, composed of its roles: its traits, its presets, its cost model and its
    training (each generic in its typed preset, `SpecT`). The roles that speak in a higher room's types are that
    room's (`model.cost.SampleCostParts`, `data.DataParts`, `data.streaming.StreamingParts`,
    `train.preflight.TrainingChecks`, `infer.serving_parts.ServingParts`): each asks for its role of the family of a
    spec, and each family is checked against every role where it is defined."""


class HasSpec(Protocol[SpecOut]):
    """A model, a served model, or anything else carrying its typed preset."""

    @property
    def spec(self) -> SpecOut: ...


_REGISTRY: dict[str, ModelFamily[ModelSpec] | ModelFamily[HSTUSpec]] = {}


TRAINING_MEMORY_SHARE = 0.9  # of the memory available: what a family's training on this host may plan to hold


def register_family(family: ModelFamily[ModelSpec] | ModelFamily[HSTUSpec]) -> None:
    """Make `family` known by its name (an implementation registers itself when imported)."""
    _REGISTRY[family.name] = family


def families() -> dict[str, ModelFamily[ModelSpec] | ModelFamily[HSTUSpec]]:
    """Every registered family by name."""
    return _REGISTRY


def family_named(name: str, where: str = "family") -> ModelFamily[ModelSpec] | ModelFamily[HSTUSpec]:
    try:
        return families()[name]
    except KeyError:
        raise UserError(f"{where}: unknown model family {name!r}; known: {', '.join(sorted(families()))}") from None


def family_of(spec: SpecT | HasSpec[SpecT]) -> ModelFamily[SpecT]:
    """The family of a typed spec (or of a model, a served model or anything carrying `.spec`): the one whose
    spec type it is, so a family only ever meets its own specs."""
    spec = getattr(spec, "spec", spec)
    found = next((f for f in families().values() if isinstance(spec, f.spec_type)), None)
    # a spec-like object (its fields, not its type: tests of a model's own checks) names its family, or is a DLRM
    name = getattr(spec, "family", "dlrm")
    if found is None and name in families():
        found = families()[name]
    if found is not None:
        return cast("ModelFamily[SpecT]", found)  # the registry dispatches on the spec's type: it is SpecT's family
    raise TypeError(f"no model family has specs of type {type(spec).__name__} (family {name!r})")


def preset_family_name(raw: JsonObject) -> str:
    """The family a parsed preset (or a spec's `to_dict`) names: DLRM where it names none."""
    return str(raw.get("family", "dlrm"))


def spec_from_dict(data: JsonObject) -> Spec:
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
