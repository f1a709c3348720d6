"""Analytic cost of a DLRM: FLOPs, memory bytes and communication bytes, counted from the spec.

Conventions (what a number counts, so that runs can be placed on a roofline):
- A multiply-add is 2 FLOPs; biases, activations and pooling sums are not counted (they
  are O(width) next to O(width^2) matrix products; the pooled-embedding sums are memory,
  not compute, bound).
- Linear layer in->out, forward: 2*in*out per sample. Backward: 2*in*out for the weight
  gradient plus 2*in*out for the input gradient, except the first bottom-MLP layer whose
  input (the dense features) needs no gradient.
- Dot interaction: the (F+1)x(F+1) Gram matrix of D-vectors, 2*(F+1)^2*D forward (as
  computed by bmm, both triangles), twice that backward. cat: 0. DCNv2 low-rank layer with
  width n and rank r: x0 * (W (V x) + b) costs 4*n*r forward, 8*n*r backward.
- Embedding bytes per sample: rows read, sum over features of pooling factor x dim x bytes
  per value at the tables' storage precision (`lookup_bytes_per_sample`). Training also
  reads and writes each looked-up row's gradient update in place and, for row-wise
  Adagrad, one float of state per row (read and written).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, cast

from dlrm_lab.config import ModelSpec
from dlrm_lab.config.family import Spec, SpecIn, family_of
from dlrm_lab.metrics.roofline import Work


@dataclass(frozen=True)
class SampleCost:
    """Per-sample FLOPs and bytes of one model (a sample of the HSTU ranker is a request)."""

    bottom_mlp_flops: int
    interaction_flops: int
    top_mlp_flops: int
    forward_flops: int
    backward_flops: int
    embedding_bytes_read: float
    embedding_bytes_written: float
    optimizer_state_bytes: float
    embedding_rows_read: float = 0.0  # rows looked up (random accesses: the gather's row ceiling counts them)

    @property
    def training_flops(self) -> int:
        return self.forward_flops + self.backward_flops

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "training_flops": self.training_flops}


class SampleCostParts(Protocol[SpecIn]):
    """What a sample of a family's models costs (a role of `config.family`'s families in this room's types)."""

    def sample_cost(self, spec: SpecIn, table_precision: str, optimizer: str, window: str) -> SampleCost: ...


def sample_cost(
    spec: Spec, table_precision: str = "fp32", optimizer: str = "rowwise_adagrad", window: str = "train"
) -> SampleCost:
    """FLOPs and embedding bytes per sample (see the module docstring for what counts), as the spec's
    family counts them (`families`; the HSTU ranker's sample is a request of `window`)."""
    # every family has this role: each is checked against it where it is defined
    costs = cast("SampleCostParts[Spec]", family_of(spec))
    return costs.sample_cost(spec, table_precision, optimizer, window)


ROW_SHARDED = ("row_wise", "table_row_wise")  # pooled outputs reduce-scattered: partial sums of every sample


COMM_ITEMS = ("input_dist", "pooled_all_to_all", "pooled_reduce_scatter", "gradient_all_reduce")  # bytes a step


def step_communication_bytes(
    spec: Spec, global_batch: int, world_size: int, sharding: dict[str, str] | None = None
) -> dict[str, float]:
    """Bytes one rank sends per training step with model-parallel tables and DDP MLPs.

    Uniform assumptions: a share (W-1)/W of each rank's ids and pooled embeddings belongs to
    other ranks; ids are int64 with an int32 length per sample and feature; pooled
    embeddings are fp32 and go back as gradients of the same size; the dense gradient
    all-reduce is a ring (2 (W-1)/W of the gradient bytes). The run's `sharding` (table ->
    sharding type, from its plan) decides what each table sends, as its family counts it.
    """
    zero = dict.fromkeys(COMM_ITEMS, 0.0)
    if world_size <= 1:
        return zero

    return family_of(spec).communication_bytes(spec, global_batch, world_size, sharding or {})


# Bytes per stored table value; row-wise quantised rows also carry an fp16 scale and bias (fbgemm).
TABLE_BYTES_PER_VALUE = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
_QUANTISED_ROW_EXTRA_BYTES = {"int8": 4, "int4": 4}
# Dense-parameter accesses per training step: forward read, backward read, gradient write,
# then the optimizer reads the gradient, reads and writes the parameter and each state.
_DENSE_OPTIMIZER_STATES = {"sgd": 0, "adagrad": 1, "adam": 2}


def row_bytes(embedding_dim: int, table_precision: str = "fp32") -> float:
    """Bytes of one stored table row at `table_precision` (quantised rows with their scale and bias)."""
    return embedding_dim * TABLE_BYTES_PER_VALUE[table_precision] + _QUANTISED_ROW_EXTRA_BYTES.get(table_precision, 0)


def dense_training_bytes(dense_parameters: int, optimizer: str = "adagrad", distributed: bool = False) -> float:
    """Bytes the dense parameters take while training (fp32): weights, gradients, the optimizer's states and, on
    several ranks, DDP's gradient buckets."""
    states = _DENSE_OPTIMIZER_STATES.get(optimizer, 1)
    return 4.0 * dense_parameters * (2 + states + (1 if distributed else 0))


def lookup_bytes_per_sample(spec: Spec, table_precision: str = "fp32") -> float:
    """Bytes of embedding rows one sample's lookups read, at the tables' storage precision."""
    return float(
        sum(t.pooling_factor * len(t.feature_names) * row_bytes(t.embedding_dim, table_precision) for t in spec.tables)
    )


def stored_table_bytes(spec: Spec, table_precision: str = "fp32") -> float:
    """Bytes of every table of `spec` stored at `table_precision`."""
    return float(sum(t.num_embeddings * row_bytes(t.embedding_dim, table_precision) for t in spec.tables))


def dense_step_bytes(spec: Spec, optimizer: str = "adagrad") -> float:
    """Bytes of dense (MLP) parameters, gradients and optimizer state touched by one training
    step (fp32): independent of the batch, so it matters at small batches only."""
    states = _DENSE_OPTIMIZER_STATES.get(optimizer, 1)
    accesses = 3 + 3 + 2 * states  # fwd read, bwd read, grad write; grad read, param read+write; states r+w
    return float(4 * accesses * spec.dense_parameters)


@dataclass(frozen=True)
class TrainingMemory:
    """Host bytes one training rank of a DLRM needs, from its spec alone (checked before anything is built)."""

    tables: float  # fp32 rows and the row-wise optimizer's one float per row
    dense: float  # MLP weights, their gradients, the optimizer's states and DDP's gradient buckets
    activations: float  # one batch's forward outputs kept for backward, and their gradients

    @property
    def total(self) -> float:
        return self.tables + self.dense + self.activations


def training_memory(
    spec: ModelSpec, batch_size: int, dense_optimizer: str = "adagrad", distributed: bool = False
) -> TrainingMemory:
    """What a rank holds while it trains `spec` at `batch_size` samples (fp32): a lower bound, since the
    framework's own workspaces come on top."""
    dense = dense_training_bytes(spec.dense_parameters, dense_optimizer, distributed)
    outputs = sum(spec.bottom_mlp) + spec.pooled_width + spec.over_arch_in_features + sum(spec.top_mlp)
    if spec.interaction == "dot":
        outputs += (spec.num_features + 1) ** 2  # the pairwise products before the upper triangle is taken
    activations = 2 * 4.0 * batch_size * outputs  # kept for backward, and their gradients
    tables = float(sum(t.num_embeddings * (row_bytes(t.embedding_dim) + 4) for t in spec.tables))
    return TrainingMemory(tables=tables, dense=dense, activations=activations)


def table_update_work(
    spec: Spec,
    batch_size: int,
    table_precision: str = "fp32",
    embedding_optimizer: str = "rowwise_adagrad",
    distinct_share: float = 1.0,
) -> Work:
    """The tables' backward and update inside a step's backward: each distinct looked-up row read again with its
    optimizer state and both written, random rows at the gather bandwidth. `distinct_share`: the batch's distinct
    rows over its ids (a repeated id's row is summed once and found in cache: only distinct rows are compulsory)."""
    cost = sample_cost(spec, table_precision=table_precision, optimizer=embedding_optimizer)
    state = 2 if cost.optimizer_state_bytes else 1  # a row, and its row-wise state in an array of its own
    rows = batch_size * distinct_share
    return Work(
        0.0,
        rows * (cost.embedding_bytes_read + cost.embedding_bytes_written + cost.optimizer_state_bytes),
        0.0,
        gather_rows=rows * cost.embedding_rows_read * state,
        table_bytes=stored_table_bytes(spec, table_precision),
    )


def step_phase_work(
    spec: Spec,
    batch_size: int,
    world_size: int,
    table_precision: str = "fp32",
    embedding_optimizer: str = "rowwise_adagrad",
    dense_optimizer: str = "adagrad",
    sharding: dict[str, str] | None = None,
    distinct_share: float = 1.0,
) -> dict[str, Work]:
    """One rank's training step, phase by phase (`metrics.columns.PHASES`, in the order the step runs them):
    what each phase does, so that each is bound by its own resource (`metrics.roofline.phase_floors`).

    The lookup reads the rows; the backward runs the dense part's backward GEMMs and then the tables' update, which
    reads each looked-up row again with its optimizer state and writes both (in place: fbgemm's fused backward or
    the batched update); the all-to-alls and the input distribution carry their collectives' bytes (the pooled
    exchange half forward, half backward; reduce-scatter where the tables are row-sharded); DDP's gradient
    all-reduce runs under the backward. The dense forward and backward read the weights once each, the optimizer
    streams the parameters, gradients and states. A model-parallel rank does `batch_size` samples' lookups on
    average, as the whole-step roof counts them. The lookup and the update gather the batch's distinct rows
    (`distinct_share` of its ids; a repeated id is a cache hit)."""
    cost = sample_cost(spec, table_precision=table_precision, optimizer=embedding_optimizer)
    comm = step_communication_bytes(spec, batch_size * world_size, world_size, sharding)
    pooled = comm["pooled_all_to_all"] + comm["pooled_reduce_scatter"]
    weights = 4.0 * spec.dense_parameters
    states = _DENSE_OPTIMIZER_STATES.get(dense_optimizer, 1)
    update = table_update_work(spec, batch_size, table_precision, embedding_optimizer, distinct_share)
    looked_up = batch_size * distinct_share
    return {
        "data_wait": Work(0.0, 0.0, 0.0),  # the batch is made apart (a thread, or ahead): no bound of the step's
        "input_dist": Work(0.0, 0.0, 0.0, comm["input_dist"]),
        "embedding_lookup": Work(
            0.0,
            looked_up * cost.embedding_bytes_read,
            0.0,
            gather_rows=looked_up * cost.embedding_rows_read,
            table_bytes=update.table_bytes,
        ),
        "embedding_all_to_all": Work(0.0, 0.0, 0.0, pooled / 2),
        "dense_forward": Work(batch_size * cost.forward_flops, 0.0, weights),
        "backward": Work(
            batch_size * cost.backward_flops,
            update.gather_bytes,
            2 * weights,
            comm["gradient_all_reduce"],
            update.gather_rows,
            update.table_bytes,
        ),
        "embedding_all_to_all_backward": Work(0.0, 0.0, 0.0, pooled / 2),
        "optimizer": Work(0.0, 0.0, weights * (3 + 2 * states)),
    }
