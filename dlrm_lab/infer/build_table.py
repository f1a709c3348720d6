"""Every serving build of one model side by side on this machine (`dlrm-lab infer builds`).

Which engine serves this model best here: each build's batch time at a few sizes (interleaved medians, at
the instance's threads, `infer.build.time_builds`), split into a cost per batch and a cost per sample, the
largest batch's fraction of its roof (its FLOPs at the profile's GEMM peak in the precision it computes in,
its embedding rows at the gather bandwidth), and its accuracy rule on held-out samples (`infer.accuracy`).
A build that cannot be made here (an optional engine missing) is listed with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypedDict

from dlrm_lab.config.family import family_of
from dlrm_lab.config.values import Log
from dlrm_lab.errors import FieldError
from dlrm_lab.infer.accuracy import check_accuracy
from dlrm_lab.infer.batching import BatchCost
from dlrm_lab.infer.build import BuildSet, Measure, judged_precision, time_builds
from dlrm_lab.infer.builds import dense_weight_bytes
from dlrm_lab.infer.instance import PRECISIONS
from dlrm_lab.infer.memory import library_samples
from dlrm_lab.infer.records import batch_roof, build_peaks
from dlrm_lab.infer.requests import generate_library
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.serving_parts import serving_of
from dlrm_lab.metrics.precision import choose_precision
from dlrm_lab.metrics.roofline import load_profile


class _BuildNamed(TypedDict):
    build: str
    skipped: str | None  # why it was not made here (an optional engine missing); None: timed


class BuildRow(_BuildNamed, total=False):
    """One build's row of `compare_builds` (a build not made has only its name and why)."""

    precision: str  # what it computes in
    table_precision: str
    threads: int
    batch_ms: dict[int, float]  # batch size -> median ms
    per_batch_ms: float
    per_sample_us: float
    roof_ms: float | None
    fraction_of_roof: float | None
    auc: float
    auc_fp32: float
    auc_kept: float
    rule: str
    accuracy_passed: bool
    labels: str


def compare_builds(
    served: ServedModel,
    *,
    builds: Sequence[str] | None = None,
    sizes: Sequence[int] = (1, 32, 256),
    repeats: int = 7,
    seed: int = 0,
    measure: Measure | None = None,
    log: Log | None = None,
) -> list[BuildRow]:
    """One row per build of `served` (all its family's, or `builds`): batch ms at each of `sizes`, cost per batch
    and per sample, fraction of roof at the largest size, and the accuracy check."""
    say = log or (lambda _line: None)
    family = family_of(served.spec)
    names = list(builds or family.builds)
    if unknown := [b for b in names if b not in family.builds]:
        raise FieldError("builds", f"{unknown[0]!r}: {family.called} has builds {', '.join(family.builds)}")
    sizes = sorted({max(1, int(n)) for n in sizes})
    if len(sizes) < 2:
        raise FieldError("sizes", f"{','.join(map(str, sizes))}: give two batch sizes or more (cost per sample)")
    choice = choose_precision(
        served.precision, served.spec, allowed=PRECISIONS, threads=served.threads, rows=max(sizes), log=say
    )
    precision = choice.precision
    say(f"{served.name}: {choice.line}")
    served = replace(served, precision=precision, max_batch=max(served.max_batch, max(sizes)))
    serving = serving_of(served.spec)
    model, attention, _ = serving.serving_model(served, seed, say)
    served = served if attention is None else replace(served, attention=attention)
    library = generate_library(served, seed, library_samples(served.max_batch, served.library_samples))
    held_out = serving.held_out(served, library, seed)
    made = BuildSet(model, precision, served.table_precision)
    rows: list[BuildRow] = []
    timed = []
    for name in names:
        try:
            made[name]
            timed.append(name)
        except (RuntimeError, ImportError) as exc:  # an optional engine absent: listed, not timed
            rows.append(BuildRow(build=name, skipped=str(exc).splitlines()[0]))
    failed: dict[str, str] = {}  # a build made that then failed its warm-up: listed with why, not timed
    rates = (measure or (lambda m, s, t: time_builds(m, s, t, library, precision, repeats, failed)))(
        made.subset(timed), sizes, served.threads
    )
    for b, why in failed.items():
        rows.append(BuildRow(build=b, skipped=why))
        say(f"{b}: not timed: {why}")
    timed = [b for b in timed if b not in failed]
    profile = load_profile()
    labels = "data" if served.checkpoint else "teacher"
    small, large = sizes[0], sizes[-1]
    for name in timed:
        ms = {n: rates[name][n] for n in sizes}
        cost = BatchCost.between(small, ms[small], large, ms[large])
        computes_in = judged_precision(name, precision)
        peaks = build_peaks(profile, "cpu", name, precision, served.threads, fallback="bf16")
        roof = batch_roof(served.spec, served.table_precision, peaks, dense_weight_bytes(name, precision))(large)
        check = check_accuracy(
            model,
            made[name],
            name,
            held_out,
            precision=judged_precision(name, precision),
            table_precision=served.table_precision,
            labels=labels,
        )
        rows.append(
            BuildRow(
                build=name,
                precision=computes_in,
                table_precision=served.table_precision,
                threads=served.threads,
                batch_ms=ms,
                per_batch_ms=cost.fixed_ms,
                per_sample_us=cost.per_sample_ms * 1e3,
                roof_ms=roof,
                fraction_of_roof=roof / ms[large] if roof else None,
                auc=check.auc,
                auc_fp32=check.auc_fp32,
                auc_kept=check.kept,
                rule=check.rule,
                accuracy_passed=check.passed,
                labels=labels,
                skipped=None,
            )
        )
        say(f"{name}: {rows[-1]['per_batch_ms']:.3f} ms a batch + {rows[-1]['per_sample_us']:.2f} us a sample")
    order = {b: i for i, b in enumerate(names)}
    return sorted(rows, key=lambda r: order[r["build"]])
