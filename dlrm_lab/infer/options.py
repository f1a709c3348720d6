"""What `infer run`, `infer search` and `serve` are given, turned into the lab's objects.

One serving-options type for the three commands, the per-model broadcasting of options
(one value for all models, or one per model), the load streams of `infer run`, and the
search grid's layouts. The CLI parses text into these and prints; the rules live here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlrm_lab.config import HSTUSpec, load_any_preset
from dlrm_lab.errors import UserError

DEFAULT_MODEL = "tiny"
DEFAULT_QPS = 100.0
DEFAULT_SLA_MS = 10.0
DEFAULT_QUERY_SIZE = "fixed:1"
AUTO = "auto"


@dataclass(frozen=True)
class ServingOptions:
    """How each served model is scaled, batched and placed (the same for every model served)."""

    instances: int = 1
    threads: int = 1
    max_batch: int = 256
    max_delay_ms: float = 1.0
    max_queue: int = 4096
    min_piece: int = 0
    spin_ms: float = 0.0
    precision: str = AUTO
    table_precision: str = "fp32"
    build: str = AUTO  # the inference form served (infer.build)
    data_spec: str | None = None
    table_scale: float | None = None
    max_rows: int | None = None
    history_cache_mb: float = 0.0  # HSTU presets: per-instance history reuse (infer.history)
    attention: str = "auto"  # HSTU presets
    history_affinity: bool = True  # HSTU presets with history reuse
    data_overrides: tuple[str, ...] = ()  # HSTU presets: --set KEY=VALUE on their [data] (the requests)
    max_query_samples: int = 65_536  # infer.served.DEFAULT_MAX_QUERY_SAMPLES

    def served(self, models: Sequence[str] | None) -> list[Any]:
        """One ServedModel per preset named (default: tiny), DLRM or HSTU; a preset served twice is `name-2`."""
        from dlrm_lab.data.sequences import with_overrides
        from dlrm_lab.infer.served import ServedModel

        out, seen = [], {}
        for name in models or [DEFAULT_MODEL]:
            spec = load_any_preset(name, table_scale=self.table_scale, max_rows=self.max_rows)
            if isinstance(spec, HSTUSpec):
                spec = with_overrides(spec, self.data_overrides)
            elif self.data_overrides:
                raise UserError(f"--set {self.data_overrides[0]}: --set changes an HSTU preset's requests; "
                                f"{spec.name} is a DLRM (its samples: --data-spec)")  # fmt: skip
            seen[spec.name] = seen.get(spec.name, 0) + 1
            label = spec.name if seen[spec.name] == 1 else f"{spec.name}-{seen[spec.name]}"
            out.append(
                ServedModel(
                    label,
                    spec,
                    instances=self.instances,
                    threads=self.threads,
                    max_batch=self.max_batch,
                    max_delay_ms=self.max_delay_ms,
                    max_queue=self.max_queue,
                    min_piece=self.min_piece,
                    spin_ms=self.spin_ms,
                    precision=self.precision,
                    table_precision=self.table_precision,
                    build=self.build,
                    data_spec=self.data_spec,
                    history_cache_mb=self.history_cache_mb,
                    attention=self.attention,
                    history_affinity=self.history_affinity,
                    max_query_samples=self.max_query_samples,
                )  # fmt: skip
            )
        return out


def per_model(values: Sequence[Any] | None, n: int, default: Any, option: str) -> list[Any]:
    """One value for all n models, or one per model, in order."""
    values = list(values or [default])
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise UserError(f"{option}: give one value or one per --model ({n}), got {len(values)}")
    return values


def numbers(values: Sequence[Any], option: str) -> list[float]:
    """Option values as numbers; 'auto' is only accepted alone (the caller handles it)."""
    out = []
    for v in values:
        try:
            out.append(float(v))
        except ValueError:
            raise UserError(f"{option} {v!r}: expected a number (or auto, given alone)") from None
    return out


def number_list(text: str, kind: type, option: str) -> list[Any]:
    """A comma-separated list of numbers, e.g. `--max-batch 64,256`."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{option} {text!r}: expected a comma-separated list of numbers") from None
    if not values:
        raise UserError(f"{option}: empty list")
    return values


@dataclass(frozen=True)
class LoadPlan:
    """The load of `infer run`: one stream per served model, and whether the rate and the
    bound are for the lab to choose (`--qps auto`, `--sla-ms auto`)."""

    streams: list[Any]
    qps_auto: bool
    sla_auto: bool


def plan_load(
    served: Sequence[Any],
    qps: Sequence[str] | None,
    query_size: Sequence[str] | None,
    sla_ms: Sequence[str] | None,
    arrival: str,
    order: str = "random",
) -> LoadPlan:
    """Streams from the per-model rates, query sizes and bounds (each one value or one per model),
    their samples in `order` (random, or time: the library's order, as MLPerf's DLRMv3 issues requests)."""
    from dlrm_lab.infer.load import Arrivals, QuerySizes, Stream

    n = len(served)
    qps_auto, sla_auto = list(qps or []) == [AUTO], list(sla_ms or []) == [AUTO]
    slas = [DEFAULT_SLA_MS] * n if sla_auto else numbers(per_model(sla_ms, n, DEFAULT_SLA_MS, "--sla-ms"), "--sla-ms")
    if any(not v > 0 for v in slas):
        raise UserError(f"--sla-ms {slas}: every bound must be > 0 ms")
    rates = [0.0] * n if qps_auto else numbers(per_model(qps, n, DEFAULT_QPS, "--qps"), "--qps")
    if not qps_auto and any(not r > 0 for r in rates):
        raise UserError(f"--qps {rates}: every rate must be > 0 queries/s (or auto)")
    sizes = [QuerySizes.parse(s) for s in per_model(query_size, n, DEFAULT_QUERY_SIZE, "--query-size")]
    arrivals = Arrivals.parse(arrival)
    streams = [
        Stream(m.name, r, s, arrivals, sla_ms=sla, order=order)
        for m, r, s, sla in zip(served, rates, sizes, slas, strict=True)
    ]
    return LoadPlan(streams, qps_auto, sla_auto)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_layouts(cores: int) -> list[tuple[int, int]]:
    """Every instances x threads that uses at most the cores, fewest instances first (arXiv
    1908.04705: more co-located instances beat more threads per instance for small-batch DLRM
    inference, and oversubscribing cores only adds interference)."""
    return [(i, t) for i in range(1, cores + 1) for t in range(1, cores // i + 1)]


def parse_layouts(text: str | None, cores: int | None = None) -> list[tuple[int, int]]:
    """`--layouts 1x2,2x1` as (instances, threads) pairs; none given: `default_layouts`."""
    if not text:
        return default_layouts(cores or available_cores())
    parsed = []
    for item in text.split(","):
        i, _, t = item.strip().partition("x")
        if not (i.isdigit() and t.isdigit() and int(i) >= 1 and int(t) >= 1):
            raise UserError(f"--layouts {item!r}: expected INSTANCESxTHREADS, e.g. 2x1")
        parsed.append((int(i), int(t)))
    return parsed
