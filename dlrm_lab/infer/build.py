"""The inference form of a served model ("the build"), chosen by measurement like precision.

Production servers do not serve the training module: TorchRec's inference path puts the tables in
fused fbgemm lookups, MLPerf's CPU submissions serve converted models with prepacked weights. So
an instance serves one of these builds of a DLRM:

- `eager`: the training module as it is, under autocast (no conversion; the reference);
- `fused`: every table in one fused fbgemm lookup (TorchRec's quantised inference tables at the
  table precision, fp32 included), the dense weights stored in the precision served (no casts per
  call), and the batch handed to the kernels as they take it (dense rows, ids and offsets: no
  KeyedJaggedTensor, no per-table calls);
- `compiled`: `fused`, with the dense part (bottom MLP, interaction, top MLP) compiled by Inductor
  with freezing, so oneDNN prepacks the weights and the interaction is fused.

The HSTU ranker has `eager` and `fused` builds: `fused` puts its sequence tables in one fused fbgemm
lookup (TorchRec's quantised `EmbeddingCollection`, fp32 included, its output in the precision
served) and stores every other weight in that precision (no autocast). It is not compiled: its
batches are jagged sequences of every length, and its attention path is chosen by measurement
already (`model.hstu.choose_attention`).

`auto` times the candidates on this machine, at the instance's threads and the batch sizes it will
serve, and keeps the fastest (the rates are cached in the machine profile); an explicit build that
measures slower still runs, with one warning line naming both rates. Every build's scores are
checked against the fp32 eager model when it is made (`check_accuracy`): an fp32 build within
1e-5 per score, a reduced-precision one within 0.1% (relative) of fp32's AUC on held-out samples,
MLPerf's accuracy rule. A build that fails its check is not chosen by `auto`.

Hand-written: no library times inference forms of a model against each other on a given machine.
"""

from __future__ import annotations

import copy
import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
from torch import nn

from dlrm_lab.errors import FieldError
from dlrm_lab.families import family_of
from dlrm_lab.metrics.precision import DTYPES

AUTO = "auto"
BUILDS = ("eager", "fused", "compiled")
MARGIN = 1.05  # a build must be this much faster than the next simpler one to be chosen (beyond timing noise)
# Below this much dense time per batch (measured under `fused`), compiling cannot repay the seconds it takes
# an instance to start: the compiled build is not tried.
COMPILE_MIN_DENSE_MS = 0.5
FP32_SCORE_TOLERANCE = 1e-5  # an fp32 build's scores against the eager model's
AUC_RELATIVE_TOLERANCE = 1e-3  # a reduced-precision build's AUC against fp32's (MLPerf: 99.9% of the reference)
CHECK_SAMPLES = 16384  # held-out samples of the accuracy check

Log = Callable[[str], None]


# ----------------------------------------------------------------------------- the fused module


class _DensePart(nn.Module):
    """Bottom MLP, interaction and top MLP over the pooled embeddings (B X F X D, or flat for cat)."""

    def __init__(self, model: nn.Module, pooled_shape: tuple[int, int] | None) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = model.dense_arch, model.inter_arch, model.over_arch
        self.pooled_shape = pooled_shape  # (F, D); None: the cat interaction takes them flat

    def interact(self, embedded: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        sparse = pooled if self.pooled_shape is None else pooled.view(-1, *self.pooled_shape)
        return self.inter_arch(embedded, sparse)

    def top(self, interaction: torch.Tensor) -> torch.Tensor:
        return self.over_arch(interaction).squeeze(-1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.top(self.interact(self.dense_arch(dense), pooled))


class FusedDLRM(nn.Module):
    """A DLRM as served by the `fused` and `compiled` builds.

    `forward(dense: B X num_dense float32, ids: int32 [all ids, feature-major], offsets: int32
    [F * B + 1]) -> scores: B float32` (click probabilities). The tables are one fbgemm
    inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`, made by TorchRec's
    `quantize_embeddings`, whose output is already in the served precision); the dense weights
    are stored in `precision`. `stages` times lookup, dense and interaction separately
    (`score_in_stages`); compiled, the dense part and the interaction are one graph.
    """

    def __init__(self, model: nn.Module, *, precision: str, table_precision: str) -> None:
        super().__init__()
        from dlrm_lab.infer.instance import quantize_tables

        self.precision, self.table_precision = precision, table_precision
        self.spec = model.spec  # what a sample is: its family scores and serves it
        dtype = DTYPES[precision]
        quantised = quantize_tables(model, table_precision, output_dtype=dtype)
        modules = quantised.sparse_arch.embedding_bag_collection._emb_modules
        if len(modules) != 1:  # one storage type and pooling for all tables: one TBE
            raise ValueError(f"expected one fused table module, got {len(modules)}")
        self.tables = modules[0]
        sparse = model.sparse_arch
        names = [n for conf in sparse.embedding_bag_collection.embedding_bag_configs() for n in conf.feature_names]
        if names != list(model.spec.feature_names):
            raise ValueError("the tables' features are not in the spec's order: ids would meet the wrong table")
        shape = None if sparse.D is None else (sparse.F, sparse.D)
        model.sparse_arch = None  # copied without its tables (they live in the TBE only): no second copy of them
        try:
            dense = copy.deepcopy(model)
        finally:
            model.sparse_arch = sparse
        self.dense = _DensePart(dense, shape).to(dtype)
        self.dtype = dtype
        self.compiled: Callable[..., torch.Tensor] | None = None

    def compile_dense(self) -> None:
        """Compile the dense part with Inductor (freezing: weights are constants, prepacked by oneDNN;
        dynamic batch: one graph for every batch size). In the instance process: a compiled
        graph does not pickle."""
        self.compiled = torch.compile(self.dense, dynamic=True, options={"freezing": True})

    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.tables(ids, offsets)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pooled = self.lookup(ids, offsets)
        part = self.dense if self.compiled is None else self.compiled
        return torch.sigmoid(part(dense.to(self.dtype), pooled).float())

    def score_in_stages(
        self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[float, float, float | None]]:
        """Scores, and the seconds of (lookup, dense MLPs, interaction); the interaction is None
        when compiled (fused into the dense graph)."""
        t0 = time.perf_counter()
        pooled = self.lookup(ids, offsets)
        t1 = time.perf_counter()
        x = dense.to(self.dtype)
        if self.compiled is not None:
            scores = torch.sigmoid(self.compiled(x, pooled).float())
            return scores, (t1 - t0, time.perf_counter() - t1, None)
        embedded = self.dense.dense_arch(x)
        t2 = time.perf_counter()
        inter = self.dense.interact(embedded, pooled)
        t3 = time.perf_counter()
        scores = torch.sigmoid(self.dense.top(inter).float())
        t4 = time.perf_counter()
        return scores, (t1 - t0, (t2 - t1) + (t4 - t3), t3 - t2)


def kernel_batch(dense: np.ndarray, lengths: np.ndarray, values: np.ndarray) -> tuple[torch.Tensor, ...]:
    """A gathered batch (dense [n, d], lengths feature-major [F * n], ids feature-major) as the fused
    lookup takes it: (dense, int32 ids, int32 offsets [F * n + 1])."""
    offsets = np.empty(len(lengths) + 1, dtype=np.int32)
    offsets[0] = 0
    np.cumsum(lengths, out=offsets[1:])
    return (torch.from_numpy(np.ascontiguousarray(dense)), torch.from_numpy(values.astype(np.int32)),
            torch.from_numpy(offsets))  # fmt: skip


def pad_kernel_batch(
    dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, features: int, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a kernel batch to `size` samples with samples of zero dense features and no ids."""
    n = dense.shape[0]
    if size == n:
        return dense, ids, offsets
    per_feature = offsets[1:].view(features, n)  # each bag's end
    padded = torch.cat([per_feature, per_feature[:, -1:].expand(features, size - n)], dim=1).flatten()
    return torch.cat([dense, dense.new_zeros(size - n, dense.shape[1])]), ids, torch.cat([offsets[:1], padded])


def make_build(model: nn.Module, build: str, *, precision: str, table_precision: str) -> nn.Module:
    """The module an instance serves for `build`: the `eager` build is the model itself, its tables
    quantised below fp32 (TorchRec's `quantize_embeddings`); `compiled` is snapshotted as `fused` and
    compiled in the instance (`FusedDLRM.compile_dense`: a compiled graph does not pickle)."""
    if build == "eager":
        from dlrm_lab.infer.instance import quantize_tables

        return quantize_tables(model, table_precision) if table_precision != "fp32" else model
    family = family_of(model.spec)
    if build not in family.builds:
        raise FieldError("build", f"{build}: {family.called} has builds {', '.join(family.builds)}")
    return family.make_fused(model, precision=precision, table_precision=table_precision).eval()


# ----------------------------------------------------------------------------- the HSTU ranker

CHECK_REQUESTS = 512  # held-out requests of the ranker's accuracy check (a few thousand candidates)


def fused_ranker(model: nn.Module, *, precision: str, table_precision: str) -> nn.Module:
    """The HSTU ranker as the `fused` build serves it: its sequence tables in one fused fbgemm lookup
    (TorchRec's `QuantEmbeddingCollection` at `table_precision`, fp32 included, its output in
    `precision`) and every other weight stored in `precision`. `served_precision` tells the runner
    not to autocast. The model is copied without its float tables: no second copy of them."""
    from dlrm_lab.infer.instance import quantize_tables

    dtype = DTYPES[precision]
    tables = model.tables
    holder = nn.Module()  # quantize_embeddings swaps children, never the module it is given
    holder.tables = tables
    try:
        quantised = quantize_tables(holder, table_precision, output_dtype=dtype, inplace=True).tables
    finally:  # in place, the float tables keep the qconfig it set, and a later build would reuse it
        for module in tables.modules():
            module.__dict__.pop("qconfig", None)
    model.tables = None
    try:
        served = copy.deepcopy(model).to(dtype)
    finally:
        model.tables = tables
    served.tables = quantised
    served.served_precision = precision
    return served


# ----------------------------------------------------------------------------- scoring outside the server


def score_build(module: nn.Module, samples: Any, precision: str) -> np.ndarray:
    """A build's scores of held-out samples, as its family scores them (a DLRM: a PackedLibrary or a
    SampleBlock in one batch as an instance assembles it; the HSTU ranker: one per candidate of a
    RequestBlock's requests); the eager model under autocast below fp32."""
    autocast = precision != "fp32" and getattr(module, "served_precision", None) is None
    return family_of(module.spec).score(module, samples, precision, autocast)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.from_numpy(scores.astype(np.float32)), torch.from_numpy(labels).long()).item())


@dataclass(frozen=True)
class AccuracyCheck:
    """A build's scores against the fp32 eager model's on held-out samples."""

    build: str
    precision: str
    table_precision: str
    samples: int
    max_abs_diff: float
    auc: float  # the build's, on labels drawn from the fp32 model's ranking (`reference_labels`)
    auc_fp32: float  # the fp32 eager model's on the same labels
    rule: str
    passed: bool
    data_auc: float | None = None  # the build's on the samples' own labels (an untrained model: ~0.5)
    data_auc_fp32: float | None = None
    # under a preset's MLPerf rule ([mlperf]): NE, accuracy and per-request AUC, the build's and fp32's
    mlperf: dict[str, dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "build": self.build, "precision": self.precision, "table_precision": self.table_precision,
            "samples": self.samples, "max_abs_score_diff": self.max_abs_diff, "auc": self.auc,
            "auc_fp32_eager": self.auc_fp32, "auc_relative_diff": abs(self.auc - self.auc_fp32) / self.auc_fp32,
            "labels": f"drawn from the fp32 model's standardised logits at sharpness {TEACHER_SHARPNESS:g}",
            "data_label_auc": self.data_auc, "data_label_auc_fp32_eager": self.data_auc_fp32,
            "mlperf_metrics": self.mlperf, "rule": self.rule, "passed": self.passed,
        }  # fmt: skip


# The served model is freshly initialised: its AUC on the data's labels is ~0.51, and a bf16 cast of the
# eager model moved it by 0.101% (kaggle, 16,384 samples): the 0.1% rule would be decided by near-ties.
# So the rule's labels are drawn from the fp32 model's own ranking with the skill of a trained CTR model:
# y ~ Bernoulli(sigmoid(TEACHER_SHARPNESS x standardised fp32 logit)), an fp32 AUC of ~0.89 on kaggle
# (above the 0.80 of Criteo's published DLRMs: the stricter test); a build then passes when it keeps the
# ranking that skill depends on (kaggle bf16: 0.065-0.071% of AUC lost, int8 tables 0.04%).
TEACHER_SHARPNESS = 2.5


def reference_labels(reference: np.ndarray, seed: int = 0) -> np.ndarray:
    """Labels drawn from the fp32 model's scores as a teacher of a trained model's skill (see above)."""
    p = np.clip(reference.astype(np.float64), 1e-7, 1 - 1e-7)
    logit = np.log(p / (1 - p))
    spread = logit.std()
    u = (logit - logit.mean()) / (spread if spread > 0 else 1.0)
    rng = np.random.default_rng(seed)
    return (rng.random(len(u)) < 1 / (1 + np.exp(-TEACHER_SHARPNESS * u))).astype(np.float32)


def check_accuracy(
    model: nn.Module, module: nn.Module, build: str, block: Any, *, precision: str, table_precision: str
) -> AccuracyCheck:
    """`module` (a build of `model`) against the fp32 eager model on the samples of `block`: an fp32
    build (dense and tables) within FP32_SCORE_TOLERANCE per score; any other within
    AUC_RELATIVE_TOLERANCE of fp32's AUC, on labels drawn from the fp32 model's ranking
    (`reference_labels`), or, where the preset declares an MLPerf rule ([mlperf]: dlrmv3), within its share
    of fp32's NE, accuracy and per-request AUC on those labels; the AUCs on the samples' own labels are
    recorded beside them."""
    packed = family_of(model.spec).check_samples(block)  # once, for both models
    reference = score_build(model, packed, "fp32")
    scores = score_build(module, packed, precision)
    diff = float(np.abs(scores.astype(np.float64) - reference).max())
    labels = reference_labels(reference)
    ours, fp32 = auc(scores, labels), auc(reference, labels)
    data = np.asarray(block.labels)
    data_ours, data_fp32 = auc(scores, data), auc(reference, data)
    rules, mlperf = getattr(model.spec, "mlperf", None), None  # only presets of an MLPerf benchmark declare one
    if precision == "fp32" and table_precision == "fp32":
        rule = f"fp32: every score within {FP32_SCORE_TOLERANCE:g} of the eager model's"
        passed = diff <= FP32_SCORE_TOLERANCE
    elif rules is not None:  # a ranker's requests: the per-request AUC groups each request's candidates
        from dlrm_lab.metrics.ranking import ranking_metrics

        candidates = np.asarray(block.candidate_lengths)
        mlperf = {"build": ranking_metrics(scores, labels, candidates),
                  "fp32": ranking_metrics(reference, labels, candidates)}  # fmt: skip
        mlperf["kept"] = rules.accuracy_kept(mlperf["build"], mlperf["fp32"])
        rule, passed = rules.accuracy_rule, all(mlperf["kept"].values())
    else:
        rule = f"AUC within {AUC_RELATIVE_TOLERANCE:.1%} (relative) of the fp32 eager model's"
        passed = abs(ours - fp32) <= AUC_RELATIVE_TOLERANCE * fp32
    return AccuracyCheck(build, precision, table_precision, len(labels), diff, ours, fp32, rule, bool(passed),
                         data_ours, data_fp32, mlperf)  # fmt: skip


# ----------------------------------------------------------------------------- the choice


@dataclass(frozen=True)
class BuildChoice:
    """What an instance serves, what was asked, and the measurements behind it."""

    requested: str
    build: str
    reason: str
    batch_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # build -> batch size -> ms (median)
    source: str = ""
    warning: str | None = None
    threads: int = 1
    accuracy: AccuracyCheck | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # build -> why it was not timed or not chosen

    @property
    def line(self) -> str:
        return f"warning: {self.warning}" if self.warning else f"build {self.build}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested, "build": self.build, "reason": self.reason,
            "batch_ms": {b: {str(n): round(ms, 4) for n, ms in sizes.items()} for b, sizes in self.batch_ms.items()},
            "source": self.source, "warning": self.warning, "threads": self.threads, "margin": MARGIN,
            "skipped": dict(self.skipped), "accuracy": self.accuracy.to_dict() if self.accuracy else None,
        }  # fmt: skip


# (build, module) -> {batch size: ms per batch}; `dense_ms` of the fused build at the largest size
Measure = Callable[[dict[str, nn.Module], Sequence[int], int], dict[str, dict[int, float]]]


def time_builds(modules: dict[str, nn.Module], sizes: Sequence[int], threads: int, library: Any, precision: str,
                repeats: int = 5) -> dict[str, dict[int, float]]:  # fmt: skip
    """Median ms per batch of each build at each batch size (library samples, taken in turn so that
    drift hits every build alike), at `threads` threads; `dense_ms` of the fused build is
    reported under the key -1 (its dense part alone at the largest size)."""
    from dlrm_lab.infer.instance import QueryRef, make_runner

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        runners = {b: make_runner(m, library, torch.device("cpu"), precision) for b, m in modules.items()}
        for r in runners.values():
            r.warm_up(max(sizes))
        times: dict[str, dict[int, list[float]]] = {b: {n: [] for n in sizes} for b in runners}
        dense: list[float] = []
        for _ in range(repeats):
            for b, r in runners.items():
                for n in sizes:
                    t = time.perf_counter()
                    r([QueryRef(-1, n, 0)])
                    times[b][n].append((time.perf_counter() - t) * 1e3)
                    if b == "fused" and n == max(sizes) and r.stages is not None:
                        dense.append(r.stages[2] + (r.stages[3] or 0.0))
        out = {b: {n: statistics.median(v) for n, v in per.items()} for b, per in times.items()}
        if dense:
            out["fused"][-1] = statistics.median(dense)
        return out
    finally:
        torch.set_num_threads(saved)


def _key(spec: Any, precision: str, table_precision: str, threads: int, sizes: Sequence[int]) -> str:
    shape = repr((spec.to_dict() if hasattr(spec, "to_dict") else repr(spec), precision, table_precision, list(sizes)))
    return f"cpu/{threads}t/{hashlib.sha1(shape.encode()).hexdigest()[:12]}"


def choose_build(
    requested: str,
    model: nn.Module,
    *,
    precision: str,
    table_precision: str,
    threads: int,
    sizes: Sequence[int],
    library: Any,
    check_block: Any,
    device: str = "cpu",
    measure: Measure | None = None,
    log: Log | None = None,
) -> tuple[BuildChoice, nn.Module]:
    """Resolve `requested` (auto or one of BUILDS) for a model served at `sizes` samples (the HSTU
    ranker: requests) per batch: the choice, and the module to serve (checked for accuracy on
    `check_block`: samples, or the ranker's requests)."""
    family = family_of(model.spec)
    if requested != AUTO and requested not in family.builds:
        raise FieldError("build", f"{requested!r}: allowed for {family.called}: {AUTO}, {', '.join(family.builds)}")
    common = {"requested": requested, "threads": threads}
    if device != "cpu":  # the fused inference tables on a GPU are built in the instance; not timed here
        build = "eager" if requested == AUTO else requested
        reason = "auto on a GPU: the eager model (the fused builds are timed on CPU only)" if requested == AUTO \
            else f"asked for (--build {build}); not timed on a GPU"  # fmt: skip
        return BuildChoice(build=build, reason=reason, **common), model
    sizes = sorted({max(1, int(n)) for n in sizes})
    modules = _Builds(model, precision, table_precision)
    skipped: dict[str, str] = {}
    rates, source = _rates(["eager", "fused"], modules, sizes, threads, library, measure)
    dense_ms = rates["fused"].get(-1)
    want_compiled = requested == "compiled" or (dense_ms is not None and dense_ms >= COMPILE_MIN_DENSE_MS)
    if "compiled" not in family.builds:
        skipped["compiled"] = f"not a build of {family.called}: {family.no_compiled_build}"
    elif requested == AUTO and not want_compiled:
        skipped["compiled"] = (f"the dense part takes {dense_ms:.3f} ms of a {max(sizes)}-sample batch: compiling "
                               f"cannot repay an instance's start (tried from {COMPILE_MIN_DENSE_MS} ms)")  # fmt: skip
    if want_compiled:
        more, compiled_source = _rates(["compiled"], modules, sizes, threads, library, measure)
        rates.update(more)
        if compiled_source != source:
            source = f"{source}; compiled: {compiled_source}"
    total = {b: sum(v for n, v in per.items() if n > 0) for b, per in rates.items()}
    ordered = [b for b in BUILDS if b in total]  # simplest first: each must beat the one before by MARGIN

    def vs(b: str, other: str) -> str:
        return f"{b} {total[b]:.3f} ms vs {other} {total[other]:.3f} ms over batches of {', '.join(map(str, sizes))}"

    accuracy: AccuracyCheck | None = None
    if requested != AUTO:
        build, warning = requested, None
        fastest = min(total, key=lambda b: total[b])
        if build in total and total[fastest] * MARGIN < total[build]:
            warning = (f"--build {build} is slower than {fastest} on this machine for {model.spec.name} "
                       f"({vs(build, fastest)}, {threads} thread{'s' if threads != 1 else ''}); running {build} "
                       "as asked (--build auto picks the faster)")  # fmt: skip
        module = modules[build]
        accuracy = check_accuracy(
            model, module, build, check_block, precision=precision, table_precision=table_precision
        )
        reason = (
            f"asked for (--build {build}: {total[build]:.3f} ms)" if build in total else f"asked for (--build {build})"
        )
        return BuildChoice(build=build, reason=reason, batch_ms=_public(rates), source=source, warning=warning,
                           accuracy=accuracy, skipped=skipped, **common), _to_snapshot(module)  # fmt: skip
    best = "eager"
    for b in ordered[1:]:
        if total[b] * MARGIN <= total[best]:
            best = b
    # the fastest that keeps the scores right; else the next fastest
    for b in [best] + sorted((o for o in ordered if o != best), key=lambda o: total[o]):
        module = modules[b]
        accuracy = check_accuracy(model, module, b, check_block, precision=precision, table_precision=table_precision)
        if accuracy.passed or b == "eager":
            best = b
            break
        skipped[b] = f"failed its accuracy check ({accuracy.rule}): {accuracy.to_dict()}"
        if log:
            log(f"build {b}: failed its accuracy check ({accuracy.rule}); not served")
    failed = [b for b in ordered if b in skipped and b != best]
    reason = f"auto: {best} is the fastest" + ("" if best == "eager" else f" ({vs(best, 'eager')})")
    if failed:
        reason = (f"auto: {best}, the fastest that passed its accuracy check ({', '.join(failed)} failed it; "
                  + ", ".join(f"{b} {total[b]:.3f} ms" for b in ordered) + ")")  # fmt: skip
    elif best == "eager":
        reason = (
            "auto: no build beats the eager model by "
            + f"{MARGIN:g}x ({', '.join(f'{b} {total[b]:.3f} ms' for b in ordered)})"
        )
    return BuildChoice(build=best, reason=reason, batch_ms=_public(rates), source=source, accuracy=accuracy,
                       skipped=skipped, **common), _to_snapshot(module)  # fmt: skip


class _Builds(dict):
    """Each build of one model, made when first asked for (compiling takes seconds)."""

    def __init__(self, model: nn.Module, precision: str, table_precision: str) -> None:
        super().__init__()
        self.model, self.precision, self.table_precision = model, precision, table_precision

    def __missing__(self, build: str) -> nn.Module:
        if build == "compiled":  # the fused build with its dense part compiled: the same tables, not a copy
            module = copy.copy(self["fused"])
            module.compile_dense()
        else:
            module = make_build(self.model, build, precision=self.precision, table_precision=self.table_precision)
        self[build] = module
        return module


def _to_snapshot(module: nn.Module) -> nn.Module:
    """The module to snapshot: a compiled build goes as `fused`, each instance compiles its own."""
    if isinstance(module, FusedDLRM):
        module.compiled = None
    return module


def _public(rates: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    return {b: {n: v for n, v in per.items() if n > 0} for b, per in rates.items()}


def _rates(
    names: Sequence[str], builds: _Builds, sizes: Sequence[int], threads: int, library: Any, measure: Measure | None
) -> tuple[dict[str, dict[int, float]], str]:
    """Batch times of the builds `names`, from this machine's profile when measured before there."""
    from dlrm_lab.metrics.roofline import load_profile, profile_path, store_measured

    profile = load_profile()
    key = _key(builds.model.spec, builds.precision, builds.table_precision, threads, sizes)
    cached = (profile or {}).get("build_rates", {}).get(key)
    if cached and all(b in cached["batch_ms"] for b in names):
        where = profile_path(profile["fingerprint_id"]) if profile else "?"
        rates = {b: {int(n): v for n, v in cached["batch_ms"][b].items()} for b in names}
        return rates, f"cached in {where} (measured {cached['measured_at']})"
    modules = {b: builds[b] for b in names}
    rates = (measure or (lambda m, s, t: time_builds(m, s, t, library, builds.precision)))(modules, sizes, threads)
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    source = f"measured now ({measured_at}) on this machine"
    if profile is not None:
        merged = {
            **(cached or {}).get("batch_ms", {}),
            **{b: {str(n): v for n, v in per.items()} for b, per in rates.items()},
        }
        entry = {"batch_ms": merged, "sizes": list(sizes), "measured_at": measured_at}
        source += f", stored in {store_measured(profile, 'build_rates', key, entry)}"
    return rates, source
