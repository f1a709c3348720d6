"""The serving build chosen by measurement, like precision (the builds themselves: `infer.builds`).

Production servers do not serve the training module: TorchRec's inference path puts the tables in
fused fbgemm lookups, MLPerf's CPU submissions serve converted models with prepacked weights, and
compiled artefacts are built once and loaded. Each build is one file of `infer.builds`; a family says
which it has (`ModelFamily.builds`: the HSTU ranker's jagged batches are not compiled).

`auto` times the candidates on this machine, at the instance's threads and the batch sizes it will
serve, and keeps the fastest (the rates are cached in the machine profile): a build is kept only where
it beats every simpler one by MARGIN. An explicit build that measures slower still runs, with one
warning line naming both rates. Every build's scores are checked when it is made
(`infer.accuracy.check_accuracy`); a build that fails its check is not chosen by `auto`.

Hand-written: no library times inference forms of a model against each other on a given machine.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import torch
from torch import nn

from dlrm_lab.config.family import family_of
from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import FieldError, first_line
from dlrm_lab.infer.accuracy import AccuracyCheck, check_accuracy
from dlrm_lab.infer.batches import QueryRef, next_samples
from dlrm_lab.infer.builds import (
    MARGIN,
    BuildFailed,
    build_named,
    builds,
    computes_in,
    simplest_fast,
)
from dlrm_lab.infer.finalists import finalists_of, same_tables
from dlrm_lab.infer.gemm_widths import choose_widths
from dlrm_lab.infer.serving_parts import make_runner
from dlrm_lab.infer.table_lookup import choose_lookup, table_weights

AUTO = "auto"


def make_build(model: nn.Module, build: str, *, precision: str, table_precision: str) -> nn.Module:
    """The module an instance serves for `build` (made from its base build first, where it has one), as
    the serving process holds it before its snapshot."""
    family = family_of(model.spec)
    if build not in family.builds:
        raise FieldError("build", f"{build}: {family.called} has builds {', '.join(family.builds)}")
    return BuildSet(model, precision, table_precision)[build]


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
    # auto: runners-up its instances time again, each in its own process (`infer.finalists`): build -> artefact
    finalists: dict[str, str] = field(default_factory=dict)
    lookup: JsonObject | None = None  # the packages' table lookup and why (`infer.table_lookup`); None: not chosen
    widths: JsonObject | None = None  # the packages' GEMM input widths and why (`infer.gemm_widths`); None: not chosen

    @property
    def line(self) -> str:
        return f"warning: {self.warning}" if self.warning else f"build {self.build}: {self.reason}"

    def to_dict(self) -> JsonObject:
        return {
            "requested": self.requested,
            "build": self.build,
            "reason": self.reason,
            "batch_ms": {b: {str(n): round(ms, 4) for n, ms in sizes.items()} for b, sizes in self.batch_ms.items()},
            "source": self.source,
            "warning": self.warning,
            "threads": self.threads,
            "margin": MARGIN,
            "skipped": dict(self.skipped),
            "finalists": dict(self.finalists),
            "accuracy": self.accuracy.to_dict() if self.accuracy else None,
            "lookup": self.lookup,
            "widths": self.widths,
        }


class _Common(TypedDict):
    """The fields of a `BuildChoice` every answer of `choose_build` shares."""

    requested: str
    threads: int


# (build, module) -> {batch size: ms per batch}; `dense_ms` of the fused build at the largest size
Measure = Callable[[Mapping[str, nn.Module], Sequence[int], int], dict[str, dict[int, float]]]


def time_builds(
    modules: Mapping[str, nn.Module],
    sizes: Sequence[int],
    threads: int,
    library: Any,
    precision: str,
    repeats: int = 5,
    failed: dict[str, str] | None = None,
) -> dict[str, dict[int, float]]:
    """Median ms per batch of each build at each batch size (library samples, taken in turn so that
    drift hits every build alike), at `threads` threads; `dense_ms` of the fused build is
    reported under the key -1 (its dense part alone at the largest size, its fastest repeat: what the part
    costs undisturbed, which decides whether compiling can repay itself; a busy minute's median opened that
    gate to tens of seconds of packages that could not). A build that fails to be made or to run a batch size
    (`BuildFailed`, or its warm-up raising) is not timed: `failed` gets why."""
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        runners = {}
        for b in modules:
            try:  # a build that cannot serve every size is left out, and why kept (`failed`), not the run ended
                runner = make_runner(modules[b], library, torch.device("cpu"), precision)
                runner.warm_up(max(sizes))
            except BuildFailed as e:
                _fail(failed, b, str(e))
                continue
            except RuntimeError as e:
                if b in BASES:  # what every later build is made from: nothing to fall back to
                    raise
                _fail(failed, b, f"{b}: fails in its warm-up (batches of 1 to {max(sizes)}): {first_line(e)}")
                continue
            runners[b] = runner
        times: dict[str, dict[int, list[float]]] = {b: {n: [] for n in sizes} for b in runners}
        dense: list[float] = []
        # each repeat takes the library's next samples; every build sees the same ones
        starts = next_samples([n for _ in range(repeats) for n in sizes], library.size)
        for rep in range(repeats):
            for b, r in runners.items():
                for i, n in enumerate(sizes):
                    t = time.perf_counter()
                    r([QueryRef(-1, n, starts[rep * len(sizes) + i])])
                    times[b][n].append((time.perf_counter() - t) * 1e3)
                    if b == "fused" and n == max(sizes) and r.stages is not None:
                        dense.append((r.stages[2] or 0.0) + (r.stages[3] or 0.0))
        out = {b: {n: statistics.median(v) for n, v in per.items()} for b, per in times.items()}
        for b, per in times.items():  # how noisy the machine was: the interquartile range over the median, largest
            ordered = sorted(per[max(sizes)])
            q1, q3 = ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]
            out[b][SPREAD] = (q3 - q1) / max(statistics.median(ordered), 1e-9)
        if dense:
            out["fused"][-1] = min(dense)
        return out
    finally:
        torch.set_num_threads(saved)


BASES = ("eager", "fused")  # the builds every other is made from: the first timed, never left out


def _fail(failed: dict[str, str] | None, build: str, why: str) -> None:
    if failed is None:
        raise BuildFailed(why)
    failed[build] = why


def _key(spec: Any, precision: str, table_precision: str, threads: int, sizes: Sequence[int], variant: str = "") -> str:
    """The machine profile's key of builds timed for this shape (`variant`: what else the builds' speed depends on)."""
    spec_key = spec.to_dict() if hasattr(spec, "to_dict") else repr(spec)
    shape = repr((spec_key, precision, table_precision, list(sizes), *([variant] if variant else [])))
    return f"cpu/{threads}t/{hashlib.sha1(shape.encode()).hexdigest()[:12]}"


def check_build_request(requested: str, spec: Any) -> None:
    """A build asked for by name that this model's family has not, or that cannot be made here (its engine missing):
    one line, which the commands give before their run directory exists."""
    family = family_of(spec)
    if requested != AUTO and requested not in family.builds:
        raise FieldError("build", f"{requested!r}: allowed for {family.called}: {AUTO}, {', '.join(family.builds)}")
    if requested != AUTO and (missing := build_named(requested).skip(None)):  # None: no size rule, what it needs
        raise FieldError("build", f"{requested}: cannot be made here: {missing}")


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
    labels: str = "teacher",
) -> tuple[BuildChoice, nn.Module]:
    """Resolve `requested` (auto or a build of `infer.builds`) for a model served at `sizes` samples (the HSTU
    ranker: requests) per batch: the choice, and the module to serve (checked for accuracy on
    `check_block`: samples, or the ranker's requests, against `labels`: `infer.accuracy.check_accuracy`)."""
    family = family_of(model.spec)
    check_build_request(requested, model.spec)
    common: _Common = {"requested": requested, "threads": threads}
    if device != "cpu":  # the fused inference tables on a GPU are built in the instance; not timed here
        build = "eager" if requested == AUTO else requested
        reason = (
            "auto on a GPU: the eager model (the fused builds are timed on CPU only)"
            if requested == AUTO
            else f"asked for (--build {build}); not timed on a GPU"
        )
        return BuildChoice(build=build, reason=reason, **common), model
    sizes = sorted({max(1, int(n)) for n in sizes})
    modules = BuildSet(model, precision, table_precision)
    skipped: dict[str, str] = {
        b: f"not a build of {family.called}: {family.no_compiled_build}" for b in builds() if b not in family.builds
    }
    first = [b for b in BASES if b in family.builds]  # the fused build's dense time gates the rest
    rates, source = _rates(first, modules, sizes, threads, library, measure, log)
    dense_ms = rates.get("fused", {}).get(-1)
    later = []
    for name in (b for b in builds() if b in family.builds and b not in first):
        why = None if requested == name else build_named(name).skip(dense_ms, smallest=min(sizes))
        if why:
            skipped[name] = why
        else:
            later.append(name)
    lookup = widths = None
    if "fused" in first and any(getattr(build_named(b), "whole_batch", False) for b in later):
        # before the packages are made: their cache key, and their timings', say which lookup they call and at
        # which widths their GEMMs compute
        lookup = choose_lookup(modules["fused"], library, sizes=list(sizes), threads=threads, log=log)
        widths = choose_widths(modules["fused"], sizes=list(sizes), threads=threads, log=log)
    if later:
        variant = f"lookup {lookup['lookup']}" if lookup else ""
        variant += f"; widths {sorted(modules['fused'].gemm_widths.items())}" if widths and widths["widths"] else ""
        more, later_source = _rates(later, modules, sizes, threads, library, measure, log, variant)
        rates.update(more)
        if later_source != source:
            source = f"{source}; {', '.join(later)}: {later_source}"
    for name, why in modules.failed.items():
        if requested == name:
            raise FieldError("build", f"{why}; --build auto serves another")
        skipped[name] = why
        if log:
            log(f"build {name}: not served: {why}")
    timed = {b: {n: v for n, v in per.items() if n > 0} for b, per in rates.items()}  # batch sizes only
    total = {b: sum(per.values()) for b, per in timed.items()}

    measured: Any = {
        "batch_ms": _public(rates),
        "source": source,
        "skipped": skipped,
        "lookup": lookup,
        "widths": widths,
        **common,
    }

    def checked(b: str) -> AccuracyCheck:
        return check_accuracy(
            model,
            modules[b],
            b,
            check_block,
            precision=judged_precision(b, precision),
            table_precision=table_precision,
            labels=labels,
        )

    ordered = [b for b in builds() if b in total]  # simplest first (the choice among them: `simplest_fast`)

    def vs(b: str, other: str) -> str:
        return f"{b} {total[b]:.3f} ms vs {other} {total[other]:.3f} ms over batches of {', '.join(map(str, sizes))}"

    accuracy: AccuracyCheck | None = None
    if requested != AUTO:
        build, warning = requested, None
        fastest = min(total, key=lambda b: total[b])
        if build in total and total[fastest] * MARGIN < total[build]:
            warning = (
                f"--build {build} is slower than {fastest} on this machine for {model.spec.name} "
                f"({vs(build, fastest)}, {threads} thread{'s' if threads != 1 else ''}); running {build} "
                "as asked (--build auto picks the faster)"
            )
        try:
            accuracy = checked(build)
        except BuildFailed as e:  # timed before (the profile's rates), found failing now it is made
            raise FieldError("build", f"{e}; --build auto serves another") from None
        reason = (
            f"asked for (--build {build}: {total[build]:.3f} ms)" if build in total else f"asked for (--build {build})"
        )
        return BuildChoice(
            build=build, reason=reason, warning=warning, accuracy=accuracy, **measured
        ), modules.snapshot(build)
    best = simplest_fast(total)
    # the fastest that keeps the scores right; else the next fastest
    for b in [best] + sorted((o for o in ordered if o != best), key=lambda o: total[o]):
        try:
            accuracy = checked(b)
        except BuildFailed as e:  # timed before (the profile's rates), found failing now it is made
            skipped[b] = str(e)
            continue
        if accuracy.passed or b == "eager":
            best = b
            break
        skipped[b] = f"failed its accuracy check ({accuracy.rule}): {accuracy.to_dict()}"
        if log:
            log(f"build {b}: failed its accuracy check ({accuracy.rule}); not served")
    finalists = _finalists(best, total, timed, modules, skipped, checked)
    failed = [b for b in ordered if b in skipped and b != best]
    reason = f"auto: {best} is the fastest" + ("" if best == "eager" else f" ({vs(best, 'eager')})")
    # a later build within the margin of it, or faster by less: the simpler kept, and said so (not "the fastest")
    close = [b for b in ordered if b != best and b not in skipped and total[b] < total[best]]
    if close:
        reason = (
            f"auto: {best}, the simplest of the fastest ({vs(best, 'eager')}); "
            + ", ".join(f"{b} {total[b]:.3f} ms" for b in close)
            + f" faster by less than {MARGIN:g}x: not worth a more complex build"
        )
    if failed:
        reason = (
            f"auto: {best}, the fastest that passed its accuracy check ({', '.join(failed)} failed it; "
            + ", ".join(f"{b} {total[b]:.3f} ms" for b in ordered)
            + ")"
        )
    elif best == "eager":
        reason = (
            "auto: no build beats the eager model by "
            + f"{MARGIN:g}x ({', '.join(f'{b} {total[b]:.3f} ms' for b in ordered)})"
        )
    if finalists:
        reason += f"; its instances time it again against {', '.join(finalists)} (infer.finalists)"
    return BuildChoice(build=best, reason=reason, accuracy=accuracy, finalists=finalists, **measured), modules.snapshot(
        best
    )


def _finalists(
    best: str,
    total: Mapping[str, float],
    timed: Mapping[str, Mapping[int, float]],
    modules: BuildSet,
    skipped: dict[str, str],
    checked: Callable[[str], AccuracyCheck],
) -> dict[str, str]:
    """The runners-up of `best` its instances time again (`infer.finalists`): close to it or faster at a size timed
    (`timed`: build -> size -> ms), each a file an instance loads that reads the very table bytes `best` serves (the
    instance hands it the tables it mapped), and each passing its own accuracy check (`checked`)."""

    def artefact(b: str) -> str | None:
        try:
            path = build_named(b).artefact(modules[b])
        except BuildFailed as e:  # timed before (the profile's rates), found failing now it is made
            skipped[b] = str(e)
            return None
        if path is None or not same_tables(table_weights(modules[best].tables), table_weights(modules[b].tables)):
            return None
        return path

    finalists = finalists_of(best, {b: t for b, t in total.items() if b not in skipped}, artefact, timed)
    for b in list(finalists):
        try:
            check = checked(b)
        except BuildFailed as e:
            skipped[b] = str(e)
            del finalists[b]
            continue
        if not check.passed:
            skipped[b] = f"failed its accuracy check ({check.rule}): {check.to_dict()}"
            del finalists[b]
    return finalists


def judged_precision(build: str, precision: str) -> str:
    """The precision a build's accuracy rule judges: the one it fixes for its dense part (int8), else the served one."""
    return computes_in(build, precision)


class BuildSet(dict):
    """Each build of one model, made when first asked for (compiling takes seconds), each from its base."""

    def __init__(self, model: nn.Module, precision: str, table_precision: str) -> None:
        super().__init__()
        self.model, self.precision, self.table_precision = model, precision, table_precision
        self.failed: dict[str, str] = {}  # build -> why it does not serve here (`BuildFailed`), once found

    def __missing__(self, name: str) -> nn.Module:
        if name in self.failed:
            raise BuildFailed(self.failed[name])
        build = build_named(name)
        base = self[build.base] if build.base else None
        try:
            module = build.make(self.model, base, precision=self.precision, table_precision=self.table_precision)
        except BuildFailed as e:
            self.failed[name] = str(e)
            raise
        self[name] = module
        return module

    def subset(self, names: Sequence[str]) -> Mapping[str, nn.Module]:
        """The builds `names`, each made when first read (the timing reads them; a fake one need not)."""
        return _Subset(self, names)

    def snapshot(self, name: str) -> nn.Module:
        """The module of build `name` as its instances' snapshot holds it."""
        return build_named(name).for_snapshot(self[name])


class _Subset(Mapping):
    """Some builds of a `BuildSet`, each made when first read."""

    def __init__(self, builds: BuildSet, names: Sequence[str]) -> None:
        self.builds, self.names = builds, list(names)

    def __getitem__(self, name: str) -> nn.Module:
        if name not in self.names:
            raise KeyError(name)
        return self.builds[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


SPREAD = -2  # key of a build's timing spread in `time_builds`' result (-1: the fused build's dense ms)
NOISY_SPREAD = 0.25  # a timing whose interquartile range exceeds this share of its median is used, not cached


def _public(rates: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    return {b: {n: v for n, v in per.items() if n > 0} for b, per in rates.items()}


def _rates(
    names: Sequence[str],
    builds: BuildSet,
    sizes: Sequence[int],
    threads: int,
    library: Any,
    measure: Measure | None,
    log: Log | None = None,
    variant: str = "",
) -> tuple[dict[str, dict[int, float]], str]:
    """Batch times of the builds `names`, from this machine's profile when measured before there."""
    from dlrm_lab.metrics.measured import batch_times, measured_choice, stored_batch_times
    from dlrm_lab.metrics.roofline import load_profile

    def time_now() -> dict[str, dict[int, float]]:
        modules = builds.subset(names)  # made as the timing asks for them (compiling takes seconds)
        if measure is not None:
            return measure(modules, sizes, threads)
        return time_builds(modules, sizes, threads, library, builds.precision, failed=builds.failed)

    def entry(rates: dict[str, dict[int, float]], cached: JsonObject | None) -> JsonObject | str:
        noisy = {b: per[SPREAD] for b, per in rates.items() if per.get(SPREAD, 0.0) > NOISY_SPREAD}
        if noisy:  # a choice made in a noisy minute must not stick to the machine: measured again next time
            worst = max(noisy, key=lambda b: noisy[b])
            return (
                f"the machine was noisy ({worst}'s batch times spread {noisy[worst]:.0%} of their median, over "
                f"{NOISY_SPREAD:.0%})"
            )
        # the builds measured before and not now stay beside the new ones; a build that failed here is kept with why,
        # so that a later run does not make it and time every build again to find the same
        failed = {**_failed_in(cached), **{b: builds.failed[b] for b in names if b in builds.failed}}
        earlier = cast(dict[str, Any], (cached or {}).get("batch_ms", {}))
        timed = {b: t for b, t in {**earlier, **stored_batch_times(rates)}.items() if b not in failed}
        return {"batch_ms": timed, "sizes": list(sizes), **({"failed": failed} if failed else {})}

    def read(cached: JsonObject) -> dict[str, dict[int, float]] | None:
        failed = {b: why for b, why in _failed_in(cached).items() if b in names}
        times = batch_times([b for b in names if b not in failed])(cached)
        if times is not None:
            builds.failed.update(failed)  # `choose_build` skips them with the reason they failed with
        return times

    # read from disk: a dynamic shape (`metrics.measured.cached_problem` checks the entry's)
    key = _key(builds.model.spec, builds.precision, builds.table_precision, threads, sizes, variant)
    return measured_choice(load_profile(), "build_rates", key, read=read, measure=time_now, entry=entry, log=log)


def _failed_in(entry: JsonObject | None) -> dict[str, str]:
    """The builds a `build_rates` entry says failed here, and why (none where it says nothing readable)."""
    failed = (entry or {}).get("failed")
    return {str(b): why for b, why in failed.items() if isinstance(why, str)} if isinstance(failed, dict) else {}
