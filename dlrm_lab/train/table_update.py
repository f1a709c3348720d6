"""The tables' backward and fused update on the CPU: fbgemm's kernel, or the same exact update as batched torch
ops on every core, chosen by timing both on the run's first batch (`--table-update`).

fbgemm's CPU backward for the fused row-wise Adagrad and SGD tables (the kernel TorchRec trains them with) runs
on one core whatever the thread count (benchmarks/tbe_threads.py: 7.75 ms on 1 thread, 8.01 on 2, the kaggle
tables at batch 2048), and on a machine whose GEMMs are fast it is a third of a step. The update it applies is
a few gather-reduce-scatter steps over the batch's rows, which torch's own ops run on all the cores: written by
hand here because neither fbgemm nor torch ships a multi-threaded CPU table update (fbgemm's is the one being
replaced). Where the lab's kernels build (`model.native`), the ids are grouped by row with a hash of the rows seen
(the update 1.1x a radix sort's, 1.3-1.4x torch's sort's), then the duplicates' sum and the row-wise update run as
one pass over the distinct rows, unscaled ids in the same call (rows fetched ahead, on every core: 1.6-2.6x torch's
five passes over kaggle's rows on 2 MiB pages; benchmarks/table_update_ab.py); torch's ops where they do not (or a
table beyond 2^32 rows). The forward stays fbgemm's; only the backward differs, and it writes the same tensors (the
rows and the row-wise state TorchRec's fused optimizer, state dict and checkpoints read), so nothing else changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    OptimType,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from dlrm_lab.config.values import JsonObject
from dlrm_lab.metrics.interleaved import interleaved_medians
from dlrm_lab.model import native
from dlrm_lab.train.timing import on_table_update

MARGIN = 1.10  # the batched update is chosen when fbgemm's takes at least this much longer
PROFILE_LABEL = "dlrm_lab::batched_table_update"
REPEATS = 5  # timed lookups-with-backward of each path, interleaved, after one warm-up each


def unsupported(tbe: Any) -> str | None:
    """Why the batched update cannot stand in for this fused table group's kernel, or None where it can."""
    if not isinstance(tbe, SplitTableBatchedEmbeddingBagsCodegen):
        return f"{type(tbe).__name__} is not fbgemm's fused training module"
    if not tbe.use_cpu:
        return "its tables are on a GPU, where fbgemm's kernels use the device"
    if tbe.optimizer not in (OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.EXACT_SGD):
        return f"its optimizer is {tbe.optimizer.name}"
    if tbe.weights_host.dtype != torch.float32:
        return f"its rows are {tbe.weights_host.dtype} (the batched update writes fp32 rows)"
    args = tbe.optimizer_args
    if args.weight_decay or args.gradient_clipping or args.max_norm or args.weight_decay_mode:
        return "it decays, clips or renormalises rows"
    if tbe.pooling_mode not in (PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE):
        return f"its pooling is {tbe.pooling_mode.name}"
    widths = tbe.D_offsets.diff().unique()
    if len(widths) != 1:
        return "its tables have different widths"
    width = int(widths[0])
    row_starts = tbe.weights_offsets.cpu()
    if bool((row_starts % width).any()):
        return "its rows do not start at whole rows"
    if tbe.optimizer == OptimType.EXACT_ROWWISE_ADAGRAD and not torch.equal(
        row_starts // width, tbe.momentum1_offsets.cpu()
    ):
        return "its row-wise state is not laid out row for row"
    return None


class BatchedTableUpdate(SplitTableBatchedEmbeddingBagsCodegen):
    """fbgemm's fused table group whose backward applies the exact update as batched torch ops (`install` swaps
    an existing module's class; nothing is constructed). Lookups other than a plain training one (variable
    batch per feature, per-feature gradients, no gradient) are fbgemm's own."""

    # a fixed-width batch's gradient row per id and its offsets, by shape (and the offsets' dtype)
    _bag_rows: dict[tuple[int, int, int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]]

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        feature_requires_grad: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: Any = None,
        **rest: Any,
    ) -> torch.Tensor:
        if (
            batch_size_per_feature_per_rank is not None
            or feature_requires_grad is not None
            or not torch.is_grad_enabled()
            or any(v is not None for v in rest.values())
        ):
            return super().forward(
                indices, offsets, per_sample_weights, feature_requires_grad, batch_size_per_feature_per_rank, **rest
            )
        return _LookupWithBatchedUpdate.apply(
            self.placeholder_autograd_tensor, self, indices, offsets, per_sample_weights
        )

    def lookup(self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """fbgemm's forward alone (no autograd record: called with gradients off)."""
        return super().forward(indices, offsets, weights)

    def _layout(self) -> tuple[int, int, torch.Tensor, bool]:
        """(features, row width, each feature's first row, pooled): fixed for the module, worked out once (`install`
        swaps the class of a module made by fbgemm: no __init__ of ours ran, so kept as it is first asked for)."""
        layout = self.__dict__.get("_update_layout")
        if layout is None:
            width = int(self.D_offsets[1] - self.D_offsets[0])
            # fbgemm keeps each feature's first element (its table's): a feature's first row is that over the width
            first_row = torch.div(self.weights_offsets, width, rounding_mode="floor")
            layout = (len(self.feature_table_map), width, first_row, self.pooling_mode != PoolingMode.NONE)
            self.__dict__["_update_layout"] = layout
        return layout

    @torch.no_grad()
    def apply_update(
        self, grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None
    ) -> None:
        """The exact update fbgemm's backward applies, from the pooled gradient (`grad`, batch x features'
        widths; nobag: one row per id): duplicates summed, then row-wise Adagrad (state += mean(g^2), row -= lr
        g / (sqrt(state) + eps)) or SGD (row -= lr g)."""
        if indices.numel() == 0:
            return
        features, width, first_row, pooled = self._layout()
        grad_rows, per_sample = _gradient_rows(grad, width, features, pooled=pooled)
        table = self.weights_host.view(-1, width)
        lr = float(self.learning_rate_tensor)
        kernels = native.load() is None and len(table) <= 2**32
        state = self.momentum1_host if self.optimizer == OptimType.EXACT_ROWWISE_ADAGRAD else None
        eps = float(self.optimizer_args.eps)
        if kernels and pooled and weights is None:
            # bags all the same length (Criteo's one id a bag): each id's bag and gradient row follow from its
            # place (an id's row: the id plus its feature's first row), the offsets checked, grouped and updated
            # in one call (the Python between them was an eighth of a kaggle update); False where the bags differ
            mean = self.pooling_mode == PoolingMode.MEAN
            if torch.ops.dlrm_lab.group_and_update_bags(table, state, indices, first_row, offsets, per_sample,
                                                        grad_rows, lr, eps, mean):  # fmt: skip
                return
        # ragged bags, weighted ids, nobag tables or no kernels: each id's bag and gradient row from the offsets
        scale = weights.float() if weights is not None else None
        batch = (offsets.numel() - 1) // features
        if self.pooling_mode == PoolingMode.NONE:
            source = torch.arange(indices.numel())
            feature = torch.repeat_interleave(offsets.diff().view(features, -1).sum(1))
        else:
            lengths = offsets.diff()
            segment = torch.repeat_interleave(lengths)  # each id's bag, feature-major
            feature = torch.div(segment, batch, rounding_mode="floor")
            source = (segment - feature * batch) * per_sample + feature  # its bag's row of the sample-major grad
            if self.pooling_mode == PoolingMode.MEAN and scale is None:  # weighted: fbgemm takes no mean
                scale = 1.0 / lengths.index_select(0, segment).float()
        ids = first_row.index_select(0, feature) + indices.long()
        if kernels:
            # the ids grouped by row (a hash of the rows seen), then one pass over the distinct rows (`model.native`);
            # unscaled, both in one call
            if scale is None:
                torch.ops.dlrm_lab.group_and_update(table, state, ids, None, source, grad_rows, lr, eps)
                return
            unique, starts, order = torch.ops.dlrm_lab.group_rows(ids, None, len(table))
            torch.ops.dlrm_lab.rowwise_update(
                table,
                state,
                unique,
                starts,
                source.index_select(0, order),
                grad_rows,
                scale.index_select(0, order),
                lr,
                eps,
            )
            return
        # Duplicates summed by sorting the rows and pooling each run of equal rows with embedding_bag (fbgemm's
        # multi-threaded CPU sum): 0.78 ms against 1.55 for unique + index_add_ (kaggle's 53k ids, 2 threads);
        # 32-bit keys sort faster than 64-bit (0.41 against 0.73 ms)
        keys, order = torch.sort(ids.int() if len(table) < 2**31 else ids)
        unique, counts = torch.unique_consecutive(keys, return_counts=True)
        unique = unique.long()
        sources = source.index_select(0, order)  # each sorted id's gradient row
        scales = scale.index_select(0, order) if scale is not None else None
        summed = torch.nn.functional.embedding_bag(
            sources, grad_rows, counts.cumsum(0) - counts, mode="sum", per_sample_weights=scales
        )
        # each unique row read once, updated, written back: index_add_ over the whole table's rows runs as a
        # scatter_add (0.37 ms for kaggle's 10k rows) where index_select + index_copy_ take a third of it
        if self.optimizer == OptimType.EXACT_SGD:
            table.index_copy_(0, unique, table.index_select(0, unique).add_(summed, alpha=-lr))
            return
        moment = self.momentum1_host.index_select(0, unique).add_((summed * summed).mean(1))
        self.momentum1_host.index_copy_(0, unique, moment)
        step = moment.sqrt_().add_(eps).reciprocal_().mul_(-lr).unsqueeze(1)
        table.index_copy_(0, unique, table.index_select(0, unique).addcmul_(summed, step))


def _gradient_rows(grad: torch.Tensor, width: int, features: int, pooled: bool) -> tuple[torch.Tensor, int]:
    """The pooled gradient as rows of `width` (fp32), and how many rows apart two samples' first features lie.
    The lookup's gradient is usually a column slice of the interaction's (the dense output comes first): read in
    place as rows of the wider tensor, not copied (the copy was a tenth of a kaggle update). nobag: a row per id."""
    if (
        pooled
        and grad.dtype == torch.float32
        and grad.dim() == 2
        and grad.size(0) > 0
        and grad.size(1) == features * width
        and grad.stride(1) == 1
        and grad.stride(0) >= grad.size(1)
        and grad.stride(0) % width == 0
    ):
        per_sample = grad.stride(0) // width
        return grad.as_strided(((grad.size(0) - 1) * per_sample + features, width), (width, 1)), per_sample
    return grad.float().reshape(-1, width), features


class _LookupWithBatchedUpdate(torch.autograd.Function):
    """fbgemm's lookup forward; backward applies the update in place and returns no gradient (as fbgemm's own
    fused backward: no gradient of a table ever exists). `anchor` is fbgemm's placeholder that needs grad."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        tbe: BatchedTableUpdate,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.tbe = tbe
        ctx.save_for_backward(indices, offsets, weights)
        return tbe.lookup(indices, offsets, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        indices, offsets, weights = ctx.saved_tensors
        with torch.profiler.record_function(PROFILE_LABEL):  # a profile names the update as it names fbgemm's
            ctx.tbe.apply_update(grad, indices, offsets, weights)
        return None, None, None, None, None


def fused_table_groups(model: torch.nn.Module) -> list[Any]:
    """This rank's fbgemm fused table groups (one per group TorchRec batched), in module order. A sharded
    collection keeps its lookups in a plain list (`_lookups`), out of `modules()`, so they are walked too."""
    found: dict[int, Any] = {}
    for module in model.modules():
        for inner in [module, *(m for lookup in getattr(module, "_lookups", []) for m in lookup.modules())]:
            if isinstance(inner, SplitTableBatchedEmbeddingBagsCodegen):
                found.setdefault(id(inner), inner)
    return list(found.values())


def install(model: torch.nn.Module, path: str) -> None:
    """Put every fused table group of `model` (this rank's) on `path`: "batched" where `unsupported` allows it,
    else fbgemm's kernel."""
    for tbe in fused_table_groups(model):
        if path == "batched" and unsupported(tbe) is None:
            tbe.__class__ = BatchedTableUpdate
        elif isinstance(tbe, BatchedTableUpdate):
            tbe.__class__ = SplitTableBatchedEmbeddingBagsCodegen


def fbgemm_fallback(tbe: Any, grad_dtype: torch.dtype) -> str | None:
    """Why fbgemm's CPU backward leaves its fast path for this table group, fed a gradient of `grad_dtype` (None:
    it takes it). The fast path (a parallel csr2csc, a JIT SpMDM coalescing the gradients, a JIT row-wise Adagrad
    in blocks) runs only for row-wise Adagrad on fp32 rows fed an fp32 gradient, table by table where no table is
    shared by two features; anything else runs a serial scalar loop (fbgemm_gpu's
    `embedding_backward_split_cpu_template.cpp`, `use_fbgemm && !is_shared_table`)."""
    if tbe.optimizer != OptimType.EXACT_ROWWISE_ADAGRAD:
        return f"its optimizer is {tbe.optimizer.name} (only row-wise Adagrad has the fast path)"
    if tbe.weights_host.dtype != torch.float32:
        return f"its rows are {tbe.weights_host.dtype}"
    if grad_dtype != tbe.weights_host.dtype:
        return f"its gradient arrives in {grad_dtype}, its rows are {tbe.weights_host.dtype}"
    tables = list(tbe.feature_table_map)
    if len(set(tables)) < len(tables):
        shared = sorted({t for t in tables if tables.count(t) > 1})
        return f"table {shared[0]} is shared by {tables.count(shared[0])} features"
    return None


class UpdatePathWatch:
    """Which path each fused table group's backward took in a real step, observed (the gradient's dtype as it
    reached the group's update), not assumed: `record()` after the step, for the manifest's
    `table_update_choice.update_path`."""

    def __init__(self, tables: list[Any]) -> None:
        self.tables = tables
        self.seen: dict[int, Any] = {}  # id of a table group: the dtype of its gradient (a torch.dtype)
        self.handles = on_table_update(tables, lambda group, grads: self.seen.setdefault(id(group), grads[0].dtype))

    def record(self) -> JsonObject:
        """Per group, the path taken: "batched" (the lab's), "fbgemm fast path", or "fbgemm serial fallback: why";
        the hooks removed."""
        for handle in self.handles:
            handle.remove()
        paths = []
        for tbe in self.tables:
            if (dtype := self.seen.get(id(tbe))) is None:
                paths.append("not observed (no gradient reached it)")
            elif isinstance(tbe, BatchedTableUpdate):
                rows = "its ids grouped and its rows updated in one pass by the lab's kernels"
                rows = rows if native.load() is None else "torch's ops"
                paths.append(f"batched (the lab's, {rows}; gradient {str(dtype).removeprefix('torch.')})")
            elif not tbe.use_cpu:
                paths.append("fbgemm on the GPU")
            elif (why := fbgemm_fallback(tbe, dtype)) is None:
                paths.append("fbgemm fast path (fp32 rows, fp32 gradient, no shared table)")
            else:
                paths.append(f"fbgemm serial fallback: {why}")
        counts = {path: paths.count(path) for path in dict.fromkeys(paths)}
        return {"groups": paths, "summary": "; ".join(f"{n} x {path}" for path, n in counts.items())}


@dataclass
class TableUpdateChoice:
    """What ran, what was asked, why, and the timings behind it (the manifest's `table_update_choice`)."""

    requested: str
    path: str
    reason: str
    backward_ms: dict[str, float] = field(default_factory=dict)  # per path, a step's lookups with backward

    def to_dict(self) -> JsonObject:
        return {
            "requested": self.requested,
            "table_update": self.path,
            "reason": self.reason,
            "backward_ms": {k: round(v, 3) for k, v in self.backward_ms.items()},
            "margin": MARGIN,
        }


def capture_lookups(model: torch.nn.Module, forward: Any) -> list[tuple[Any, tuple[Any, ...]]]:
    """Each fused table group's inputs in one forward of the model (`forward()`, gradients off)."""
    seen: list[tuple[Any, tuple[Any, ...]]] = []
    hooks = [
        tbe.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((m, _lookup_args(args, kwargs))), with_kwargs=True
        )
        for tbe in fused_table_groups(model)
    ]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in hooks:
            h.remove()
    return seen


def _lookup_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    named = dict(zip(("indices", "offsets", "per_sample_weights"), args, strict=False), **kwargs)
    return named["indices"], named["offsets"], named.get("per_sample_weights")


def time_paths(lookups: list[tuple[Any, tuple[Any, ...]]], repeats: int = REPEATS) -> dict[str, float]:
    """Milliseconds of a step's lookups with backward-and-update on each path, medians of interleaved repeats.
    The gradient is zero, so both updates leave every row and state as it was (row-wise Adagrad adds 0 to
    the state and subtracts lr * 0 / (sqrt(state) + eps); SGD subtracts 0): the model is untouched."""

    def timed(path: str) -> float:
        start = time.perf_counter()
        for tbe, (indices, offsets, weights) in lookups:
            tbe.__class__ = BatchedTableUpdate if path == "batched" else SplitTableBatchedEmbeddingBagsCodegen
            out = tbe(indices, offsets, weights)
            out.backward(torch.zeros_like(out))
        return (time.perf_counter() - start) * 1e3

    medians = interleaved_medians(("fbgemm", "batched"), timed, repeats)
    for tbe, _ in lookups:
        tbe.__class__ = SplitTableBatchedEmbeddingBagsCodegen
    return medians


def choose_table_update(requested: str, model: torch.nn.Module, forward: Any) -> TableUpdateChoice:
    """The path this rank's tables take (`requested` one of `config.train.TABLE_UPDATES`), installed before
    returning. "auto" times both on the batch `forward()` feeds the model, with the model unchanged
    (`time_paths`)."""
    # "auto" runs the forward on every rank whatever its tables (it is collective over ranks)
    lookups = capture_lookups(model, forward) if requested == "auto" else []
    groups = fused_table_groups(model)
    why_not = [w for w in (unsupported(t) for t in groups) if w]
    if not groups:
        choice = TableUpdateChoice(requested, "fbgemm", "no fused fbgemm table group on this rank")
    elif requested == "fbgemm":
        choice = TableUpdateChoice(requested, "fbgemm", "--table-update fbgemm")
    elif len(why_not) == len(groups):
        choice = TableUpdateChoice(requested, "fbgemm", f"the batched update does not apply: {why_not[0]}")
    elif requested == "batched":
        choice = TableUpdateChoice(requested, "batched", "--table-update batched" + _partly(why_not, groups))
    else:
        ms = time_paths([(t, a) for t, a in lookups if unsupported(t) is None])
        faster = ms["fbgemm"] >= MARGIN * ms["batched"]
        path = "batched" if faster else "fbgemm"
        reason = (
            f"the tables' backward and update took {ms['batched']:.2f} ms batched on all cores against "
            f"{ms['fbgemm']:.2f} ms in fbgemm's kernel (this run's first batch, medians of {REPEATS} "
            f"interleaved, a zero gradient: the model unchanged); "
            + ("batched is faster" if faster else f"batched is not {MARGIN:.2f}x faster: fbgemm kept")
            + (_partly(why_not, groups) if faster else "")
        )
        choice = TableUpdateChoice(requested, path, reason, ms)
    install(model, choice.path)
    return choice


def _partly(why_not: list[str], groups: list[Any]) -> str:
    return f" ({len(why_not)} of {len(groups)} table groups stay on fbgemm: {why_not[0]})" if why_not else ""
