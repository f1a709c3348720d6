"""Compare two sets of runs metric by metric (`dlrm-lab compare BASE NEW`), or the machines of one set
(`dlrm-lab compare RUNS --by-machine`: the runs split by hardware fingerprint, each machine against the base).

BASE and NEW are each a run directory or a directory holding run directories at any depth
(every directory with a `manifest.json`; the container runs of sweeps, kinds `scale` and
`sweep`, are skipped but the runs inside them count). Only runs with status `ok` are used.
Runs of the same kind on one side are taken as repeats of one measurement.

Metrics (and which way is better):

- `train`: samples_per_s (higher), step_time_ms_p50 (lower), eval_auc (higher),
  energy_per_sample_j (lower; only when both sides measured energy).
- `infer`: per model and mode (`together`/`alone`) of the summary rows: queries_per_s,
  samples_per_s (higher), latency_p50_ms, latency_p99_ms (lower).
- `infer-search` runs are not compared (their probes are not repeats of one load); a note
  says so. Other kinds are listed in the notes too.

Samples (the noise estimate), basis of each row:

- `paired in time`: the two sides' runs alternated (A B A B ..., at least 3 a side, by their start times): each
  adjacent pair gives one ratio, and the ratio's median and CI are over the pairs, so the host's drift between
  pairs cancels. A pair whose speed canaries (`canary_ratio`) differ by more than 20% is left out, and the basis says
  how many ("paired in time: 4 pairs, 1 left out").
- `repeats`: both sides have >= 3 runs with the metric, not alternated: each run's summary value is one
  sample, so the CI covers run-to-run variation.
- otherwise, within-run data of every run of the side, pooled (the same kind of sample
  on both sides, so that the two medians estimate the same thing):
  - `within-run: steps`: training, measured steps (warmup false). Throughput per step is
    the step's samples over all ranks / the slowest rank's step time; step time is the
    slowest rank's. The median per step is compared, not the summary's ratio of sums.
  - `within-run: queries`: inference latency percentiles, over the point's `ok` queries of
    the model: the statistic is the nearest-rank percentile itself (as in the summary).
  - `within-run: 1-s bins`: inference throughput, completed queries (samples) per
    1-second bin of `end_ms`, the first and last (partial) bins dropped.
  - eval_auc and energy_per_sample_j have no within-run noise: `no repeats`, a ratio
    without CI and the verdict `no noise estimate`.

Verdict: the ratio is new/base for higher-is-better metrics and base/new for
lower-is-better ones, so a ratio below 1 is always worse. With its 95% bootstrap CI
(`dlrm_lab.metrics.stats.ratio_estimate`): `regression` when the whole CI is below
1 - threshold (default 0.02), `improvement` when it is above 1 + threshold, `within noise`
otherwise, and `no noise estimate` when there is no CI (fewer than 3 samples a side).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from dlrm_lab.config.values import section
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.metrics import columns
from dlrm_lab.metrics.canary import CANARY_APART
from dlrm_lab.metrics.canary import apart as canaries_apart
from dlrm_lab.metrics.stats import (
    CONFIDENCE,
    N_RESAMPLES,
    Estimate,
    Statistic,
    estimate,
    median,
    nearest_rank_percentile,
    ratio_estimate,
)
from dlrm_lab.report.samples import (
    RunSamples,
    count_finite,
    discover_runs,
    infer_groups,
    latencies_of,
    ok_queries,
    per_second,
    summary_values,
    train_steps,
)

DEFAULT_THRESHOLD = 0.02
MIN_REPEATS = 3  # runs per side from which run-to-run variation is the noise estimate
HIGHER, LOWER = columns.HIGHER, columns.LOWER
REGRESSION, IMPROVEMENT, WITHIN_NOISE, NO_NOISE_ESTIMATE = (
    "regression",
    "improvement",
    "within noise",
    "no noise estimate",
)
COMPARED_KINDS = ("train", "infer")
REPEATS, STEPS, QUERIES, BINS, NO_REPEATS = (
    "repeats",
    "within-run: steps",
    "within-run: queries",
    "within-run: 1-s bins",
    "no repeats",
)
PAIRED = "paired in time"  # BASE and NEW alternated (`time_pairs`): one ratio a pair of adjacent runs


TRAIN_METRICS = tuple(columns.column(name) for name in columns.COMPARED["train"])
INFER_METRICS = tuple(columns.column(name) for name in columns.COMPARED["infer"])
_LATENCY_PERCENTILE = {"latency_p50_ms": 50.0, "latency_p99_ms": 99.0}
_TRAIN_CONFIG = ("preset", "device", "world_size", "global_batch_size", "precision", "table_precision")


@dataclass(frozen=True)
class MetricComparison:
    """One metric of one kind (and, for inference, one model and mode): BASE vs NEW."""

    kind: str
    group: str  # "" for training; "<model> <mode>" for inference
    metric: str
    unit: str
    direction: str  # "higher" or "lower" is better
    base: Estimate
    new: Estimate
    ratio: Estimate  # new/base, or base/new when lower is better: below 1 is worse
    verdict: str
    basis: str

    @property
    def label(self) -> str:
        return f"{self.group}: {self.metric}" if self.group else self.metric

    def to_dict(self) -> dict[str, str | float | bool | None]:
        return {
            "kind": self.kind,
            "group": self.group,
            "metric": self.metric,
            "unit": self.unit,
            "direction": self.direction,
            "verdict": self.verdict,
            "basis": self.basis,
            "statistic": self.base.statistic,
            **self.base.to_columns("base"),
            **self.new.to_columns("new"),
            **self.ratio.to_columns("ratio"),
        }


@dataclass(frozen=True)
class Comparison:
    base: Path | str  # a path, or (by machine) "PATH [machine FINGERPRINT]"
    new: Path | str
    threshold: float
    rows: list[MetricComparison]
    notes: list[str]
    base_kinds: dict[str, int]  # ok runs per kind
    new_kinds: dict[str, int]

    @property
    def regressions(self) -> list[MetricComparison]:
        return [r for r in self.rows if r.verdict == REGRESSION]


def verdict(ratio: Estimate, threshold: float = DEFAULT_THRESHOLD) -> str:
    """Regression / improvement when the whole CI of the (better-is-higher) ratio lies
    beyond 1 -/+ threshold; within noise otherwise; no noise estimate without a CI."""
    if ratio.ci_low is None or ratio.ci_high is None:
        return NO_NOISE_ESTIMATE
    if ratio.ci_high < 1 - threshold:
        return REGRESSION
    if ratio.ci_low > 1 + threshold:
        return IMPROVEMENT
    return WITHIN_NOISE


def _kinds_text(kinds: dict[str, int]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "no finished runs"


# ----------------------------------------------------------------------------- compare


class _Resampling(TypedDict):
    """How every estimate of a comparison resamples (`metrics.stats.estimate`'s keywords)."""

    confidence: float
    n_resamples: int
    seed: int


class _Comparer:
    def __init__(self, threshold: float, confidence: float, n_resamples: int, seed: int) -> None:
        self.threshold = threshold
        self.opts: _Resampling = {"confidence": confidence, "n_resamples": n_resamples, "seed": seed}
        self.rows: list[MetricComparison] = []
        self.notes: list[str] = []

    def add(
        self,
        kind: str,
        group: str,
        metric: columns.Column,
        base: np.ndarray | list[Any],
        new: np.ndarray | list[Any],
        basis: str,
        statistic: Statistic = median,
    ) -> None:
        spread = basis in (REPEATS, NO_REPEATS)  # single steps/queries scatter by nature: judge by the CI
        b = estimate(base, statistic=statistic, spread_rule=spread, **self.opts)
        w = estimate(new, statistic=statistic, spread_rule=spread, **self.opts)
        label = f"{group}: {metric.name}" if group else f"{kind} {metric.name}"
        if b.n == 0 or w.n == 0:
            if b.n or w.n:
                self.notes.append(f"{label}: only {'BASE' if b.n else 'NEW'} has values, not compared")
            return
        if metric.better == HIGHER:
            ratio = ratio_estimate(base, new, statistic=statistic, **self.opts)
        else:
            ratio = ratio_estimate(new, base, statistic=statistic, **self.opts)
        self._row(kind, group, metric, b, w, ratio, basis)

    def _row(
        self, kind: str, group: str, metric: columns.Column, b: Estimate, w: Estimate, ratio: Estimate, basis: str
    ) -> None:
        """One metric's comparison, its verdict from its ratio's interval."""
        self.rows.append(
            MetricComparison(
                kind=kind,
                group=group,
                metric=metric.name,
                unit=metric.unit,
                direction=metric.better or HIGHER,
                base=b,
                new=w,
                ratio=ratio,
                verdict=verdict(ratio, self.threshold),
                basis=basis,
            )
        )

    def add_paired(
        self, kind: str, group: str, metric: columns.Column, pairs: list[tuple[dict[str, Any], dict[str, Any]]]
    ) -> None:
        """`metric` over pairs of summary rows (BASE's, NEW's), each pair's two runs adjacent in time: the ratio is
        each pair's own, their median and CI over the pairs, so the host's drift between pairs cancels; a pair whose
        canaries are `metrics.canary.apart` (the host changed speed between its two halves) is left out, and the
        basis says how many."""
        kept, apart = [], 0
        for b, w in pairs:
            if canaries_apart(b.get("canary_ratio"), w.get("canary_ratio")):
                apart += 1
                continue
            vb, vw = b.get(metric.name), w.get(metric.name)
            if isinstance(vb, (int, float)) and isinstance(vw, (int, float)) and vb > 0 and vw > 0:
                kept.append((float(vb), float(vw)))
        if len(kept) < MIN_REPEATS:
            self.notes.append(
                f"{group or kind}: {metric.name}: {len(kept)} pairs in time ({apart} left out: canaries over "
                f"{CANARY_APART:.0%} apart), too few to compare"
            )
            return
        ratios = [w / b if metric.better == HIGHER else b / w for b, w in kept]
        basis = f"{PAIRED}: {len(kept)} pairs" + (
            f", {apart} left out (canaries over {CANARY_APART:.0%} apart)" if apart else ""
        )
        b_est, w_est = estimate([b for b, _ in kept], **self.opts), estimate([w for _, w in kept], **self.opts)
        self._row(kind, group, metric, b_est, w_est, estimate(ratios, **self.opts), basis)

    # -- training

    def train(self, base: list[RunSamples], new: list[RunSamples]) -> None:
        self._config_notes("train", base, new)
        if (pairs := time_pairs(base, new)) is not None:
            rows = [(b.summary[0], w.summary[0]) for b, w in pairs if b.summary and w.summary]
            for metric in TRAIN_METRICS:
                if metric.name != "energy_per_sample_j" or all(r[0].get(metric.name) for r in rows):
                    self.add_paired("train", "", metric, rows)
            return
        repeats = len(base) >= MIN_REPEATS and len(new) >= MIN_REPEATS
        steps = {} if repeats else {"BASE": train_steps(base), "NEW": train_steps(new)}
        for metric in TRAIN_METRICS:
            b, w = summary_values(base, metric.name), summary_values(new, metric.name)
            if metric.name in ("samples_per_s", "step_time_ms_p50") and not repeats:
                col = 0 if metric.name == "samples_per_s" else 1
                self.add("train", "", metric, steps["BASE"][col], steps["NEW"][col], STEPS)
            elif metric.name == "energy_per_sample_j" and (count_finite(b) == 0 or count_finite(w) == 0):
                continue  # measured on one side only (or neither): nothing to compare
            else:
                self.add("train", "", metric, b, w, REPEATS if repeats else NO_REPEATS)

    def _config_notes(self, kind: str, base: list[RunSamples], new: list[RunSamples]) -> None:
        for name in _TRAIN_CONFIG:
            for side, runs in (("BASE", base), ("NEW", new)):
                values = {str(r.summary[0].get(name)) for r in runs if r.summary}
                if len(values) > 1:
                    self.notes.append(f"{side} {kind} runs differ in {name} ({', '.join(sorted(values))})")
            b = {str(r.summary[0].get(name)) for r in base if r.summary}
            w = {str(r.summary[0].get(name)) for r in new if r.summary}
            if b and w and b != w:
                self.notes.append(f"{kind} {name}: BASE {', '.join(sorted(b))} vs NEW {', '.join(sorted(w))}")

    # -- inference

    def infer(self, base: list[RunSamples], new: list[RunSamples]) -> None:
        b_groups, w_groups = infer_groups(base), infer_groups(new)
        pairs = time_pairs(base, new)
        for side, only in (("BASE", b_groups.keys() - w_groups.keys()), ("NEW", w_groups.keys() - b_groups.keys())):
            for key in sorted(only):
                self.notes.append(f"infer {' '.join(key)}: only in {side}, not compared")
        for key in sorted(b_groups.keys() & w_groups.keys()):
            group = " ".join(key)
            bg, wg = b_groups[key], w_groups[key]  # [(run, summary rows of this model and mode)]
            b_rate = {r.get("target_qps") for _, rows in bg for r in rows}
            w_rate = {r.get("target_qps") for _, rows in wg for r in rows}
            if b_rate != w_rate:
                self.notes.append(
                    f"{group}: target_qps differs (BASE {_set_text(b_rate)}, NEW {_set_text(w_rate)}): "
                    "open-loop throughput follows the offered load"
                )
            if pairs is not None:
                b_of, w_of = {id(run): rows for run, rows in bg}, {id(run): rows for run, rows in wg}
                rows = [(b_of[id(b)][0], w_of[id(w)][0]) for b, w in pairs if b_of.get(id(b)) and w_of.get(id(w))]
                for metric in INFER_METRICS:
                    self.add_paired("infer", group, metric, rows)
                continue
            repeats = len(bg) >= MIN_REPEATS and len(wg) >= MIN_REPEATS
            if repeats:
                for metric in INFER_METRICS:
                    b: np.ndarray | list[Any] = [r.get(metric.name) for _, rows in bg for r in rows]
                    w: np.ndarray | list[Any] = [r.get(metric.name) for _, rows in wg for r in rows]
                    self.add("infer", group, metric, b, w, REPEATS)
                continue
            b_queries, w_queries = ok_queries(bg, key[0]), ok_queries(wg, key[0])
            for metric in INFER_METRICS:
                if metric.name in _LATENCY_PERCENTILE:
                    stat = nearest_rank_percentile(_LATENCY_PERCENTILE[metric.name])
                    b, w = latencies_of(b_queries), latencies_of(w_queries)
                    self.add("infer", group, metric, b, w, QUERIES, statistic=stat)
                else:
                    weight = metric.name == "samples_per_s"
                    b, w = per_second(b_queries, weight), per_second(w_queries, weight)
                    self.add("infer", group, metric, b, w, BINS)


def time_pairs(base: list[RunSamples], new: list[RunSamples]) -> list[tuple[RunSamples, RunSamples]] | None:
    """BASE's and NEW's runs paired in the order they ran, where they alternate (A B A B ..., or B A A B ...: each
    adjacent two are one of each side) with at least MIN_REPEATS pairs; None where they do not (then unpaired)."""
    if len(base) != len(new) or len(base) < MIN_REPEATS:
        return None
    order = [(str(r.manifest.get("start_time") or ""), side, r) for side, runs in ((0, base), (1, new)) for r in runs]
    if any(not t for t, _, _ in order):
        return None
    order.sort(key=lambda x: x[0])
    pairs = []
    for (_, s1, r1), (_, s2, r2) in zip(order[::2], order[1::2], strict=True):
        if s1 == s2:
            return None
        pairs.append((r1, r2) if s1 == 0 else (r2, r1))
    return pairs


def _set_text(values: set[Any]) -> str:
    return ", ".join(sorted(str(v) for v in values))


def compare(
    base: str | Path,
    new: str | Path,
    threshold: float = DEFAULT_THRESHOLD,
    confidence: float = CONFIDENCE,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
) -> Comparison:
    """Compare the runs under `base` with those under `new` (rules in the module docstring).

    Raises UserError for a missing path, or when the two have no compared kind in common.
    """
    if not threshold >= 0:
        raise FieldError("threshold", f"{threshold}: must be >= 0 (a fraction, 0.02 = 2%)")
    base, new = Path(base), Path(new)
    b_runs, b_notes = discover_runs(base)
    w_runs, w_notes = discover_runs(new)
    return _compare_runs(base, new, b_runs, w_runs, b_notes + w_notes, threshold, confidence, n_resamples, seed)


def machine_of(run: RunSamples) -> str:
    return str(section(run.manifest, "hardware").get("fingerprint_id") or "unknown")


def compare_machines(
    path: str | Path,
    base_machine: str | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    confidence: float = CONFIDENCE,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
) -> list[Comparison]:
    """The runs under `path` split by the machine they ran on (their manifests' hardware fingerprints), each
    other machine compared with the base machine (`base_machine`: a fingerprint prefix; default the machine of
    the oldest run) by the same rules as `compare`. Raises UserError with fewer than two machines."""
    if not threshold >= 0:
        raise FieldError("threshold", f"{threshold}: must be >= 0 (a fraction, 0.02 = 2%)")
    runs, notes = discover_runs(path)
    machines: dict[str, list[RunSamples]] = {}
    for run in runs:
        machines.setdefault(machine_of(run), []).append(run)
    if len(machines) < 2:
        raise FieldError(
            "by_machine", f": the runs under {path} come from {len(machines)} machine(s); need two or more"
        )
    if base_machine is None:
        base_id = next(iter(machines))
    else:
        hits = [m for m in machines if m.startswith(base_machine)]
        if len(hits) != 1:
            raise FieldError(
                "base_machine",
                f"{base_machine!r}: matches {len(hits)} of the machines under {path} "
                f"({', '.join(m[:8] for m in machines)})",
            )
        base_id = hits[0]
    label = {
        m: f"{path} [machine {m[:8]}: {section(rs[0].manifest, 'hardware').get('cpu_model', '?')}]"
        for m, rs in machines.items()
    }
    return [
        _compare_runs(
            label[base_id], label[m], machines[base_id], rs, list(notes), threshold, confidence, n_resamples, seed
        )
        for m, rs in machines.items()
        if m != base_id
    ]


def _compare_runs(
    base: Path | str,
    new: Path | str,
    b_runs: list[RunSamples],
    w_runs: list[RunSamples],
    notes: list[str],
    threshold: float,
    confidence: float,
    n_resamples: int,
    seed: int,
) -> Comparison:
    b_kinds, w_kinds = dict(Counter(r.kind for r in b_runs)), dict(Counter(r.kind for r in w_runs))
    common = [k for k in COMPARED_KINDS if k in b_kinds and k in w_kinds]
    if not common:
        extra = " (infer-search runs are not compared)" if "infer-search" in {*b_kinds, *w_kinds} else ""
        raise UserError(
            f"nothing to compare: BASE {base} has {_kinds_text(b_kinds)}, "
            f"NEW {new} has {_kinds_text(w_kinds)}; they need a kind in common ({', '.join(COMPARED_KINDS)}){extra}"
        )
    comparer = _Comparer(threshold, confidence, n_resamples, seed)
    comparer.notes += notes
    if "infer-search" in {*b_kinds, *w_kinds}:
        comparer.notes.append("infer-search runs are not compared (a search's probes are not repeats of one load)")
    for kind in sorted({*b_kinds, *w_kinds} - set(common) - {"infer-search"}):
        if kind in COMPARED_KINDS:
            comparer.notes.append(f"{kind} runs only in {'BASE' if kind in b_kinds else 'NEW'}, not compared")
        else:
            comparer.notes.append(f"{kind} runs are not compared")
    handlers: dict[str, Callable[[list[RunSamples], list[RunSamples]], None]] = {
        "train": comparer.train,
        "infer": comparer.infer,
    }
    for kind in common:
        handlers[kind]([r for r in b_runs if r.kind == kind], [r for r in w_runs if r.kind == kind])
    return Comparison(base, new, threshold, comparer.rows, comparer.notes, b_kinds, w_kinds)
