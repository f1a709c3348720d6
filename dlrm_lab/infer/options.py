"""What `infer run`, `infer search` and `serve` are given, turned into the lab's objects.

One serving-options type for the three commands, the per-model broadcasting of options
(one value for all models, or one per model), the load streams of `infer run` (the search's own
options: `infer.search_options`). The CLI parses text into these and prints; the rules live here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from dlrm_lab.config import load_any_preset
from dlrm_lab.config.family import family_of
from dlrm_lab.config.options import ModelScaling, OptionChange, by_field, option
from dlrm_lab.config.prices import check_currency, check_price
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError

DEFAULT_MODEL = "tiny"
DEFAULT_QPS = 100.0
DEFAULT_SLA_MS = 10.0
DEFAULT_QUERY_SIZE = "fixed:1"
AUTO = "auto"


@dataclass(frozen=True)
class ServingOptions(ModelScaling):
    """How each served model is scaled, batched and placed (the same for every model served).

    Each field is also an option of `serve`, `infer run` and `infer search` (config.options)."""

    instances: int = option(1, "Co-located instances (worker processes) per model.")
    threads: int = option(1, "Intra-op threads per instance.")
    max_batch: int = option(256, "Largest batch in samples (larger queries are split across instances).")
    max_delay_ms: float = option(
        1.0,
        "Longest a query waits for its batch to fill (with an instance free, only while the arrival rate expects "
        "another query within it).",
    )
    max_queue: int = option(4096, "Waiting queries per model before new ones are dropped.")
    min_piece: int = option(
        0,
        "Smallest piece a query is split into over idle instances (0: measured at start, where a batch's fixed cost "
        "equals its samples' cost).",
    )
    spin_ms: float = option(
        0.0,
        "An idle instance polls for its next batch this long before it sleeps: a core that just slept runs the next "
        "batch slower (0: sleep at once).",
    )
    keep_warm_ms: float = option(
        0.0,
        "An idle instance runs a 1-sample batch of its own every this many ms, keeping its tables and weights in "
        "cache: on these hosts memory idle 100 ms reads ~5x slower (0: off).",
    )
    idle_hold: str = option(
        "none",
        "What an idle instance holds while it waits: none, cpu-latency (/dev/cpu_dma_latency held at 0: its core "
        "polls in the kernel's idle loop instead of halting, where a cpuidle driver obeys it; needs root) or "
        "lock-tables (its tables and sample library pre-faulted and locked in memory, mlock), keep-memory (malloc "
        "never gives freed memory back: a batch's buffers stay mapped) or halt-poll (the guest's haltpoll driver "
        "polls 10 ms before it halts an idle vCPU; machine-wide, needs root, put back when the instance ends).",
    )
    batch_memory: str = option(
        "release",
        "Whether an instance's malloc keeps a batch's freed buffers for the next batch: auto (each instance times "
        "its largest batch both ways at start; kept where 5% faster), release (glibc's defaults: blocks over its "
        "mmap threshold, 32 MiB at most, are mapped, faulted in and zeroed again every batch) or keep.",
        cli_default=AUTO,
    )
    allocator: str = option(
        "glibc",
        "The C allocator an instance runs: auto (where jemalloc or tcmalloc is installed, each timed against glibc's "
        "malloc on the model's dense layers in trial processes, once per machine; glibc's kept unless another is 5% "
        "faster), glibc, jemalloc or tcmalloc (loaded first, LD_PRELOAD).",
        cli_default=AUTO,
    )
    table_pages: str = option(
        "base",
        "The snapshot's memory pages, where every instance maps the tables: auto (2 MiB pages where this machine's "
        "embedding gather measured faster on them and this process may mount a tmpfs of them: root), base (4 KiB, "
        "/dev/shm) or huge (2 MiB: a tmpfs the server mounts with huge=within_size, unmounted when it stops).",
        cli_default=AUTO,
    )
    precision: str = option(
        AUTO,
        "Dense compute: auto (measured: a lower precision only where its GEMMs are faster), fp32, bf16 (autocast) or "
        "fp16.",
    )
    table_precision: str = option("fp32", "Embedding tables: fp32, fp16, int8 or int4 (row-wise quantised, fbgemm).")
    build: str = option(  # the inference form served (infer.builds, chosen by infer.build)
        AUTO,
        "Inference form served: auto (timed at start: the fastest whose scores pass the accuracy check), eager (the "
        "training module), fused (one fused fbgemm table lookup, weights stored in the served precision), compiled "
        "(fused, dense part compiled by Inductor in each instance), aoti (the whole batch, lookup included, one call "
        "of an AOTInductor package built once, cached on disk and loaded), aoti_frozen (aoti, the weights prepacked at "
        "build time), aoti_tuned (aoti with max_autotune), aoti_buckets (aoti_frozen, and a static max_autotune "
        "package for each small batch size where one is faster), aoti_int8 (aoti, dense part int8 by torchao's PT2E), "
        "openvino or openvino_int8 (the dense part in OpenVINO).",
    )
    data_spec: str | None = option(None, "Synthetic data spec of the samples (default: the preset's).")
    history_cache_mb: float = option(  # per-instance history reuse (infer.history)
        0.0, "HSTU presets: MB per instance of users' encoded histories, reused by their next request."
    )
    attention: str = option("auto", "HSTU presets: padded, jagged, or auto (timed at start).")
    history_affinity: bool = option(
        True, "HSTU with history reuse: send a user's requests to the instance holding their history."
    )
    data_overrides: tuple[str, ...] = option(  # on their [data]: the requests
        (),
        "HSTU presets: KEY=VALUE on the preset's [data] (its requests).",
        flags=("--set",),
        type=Optional[list[str]],
        cli_default=None,
    )
    checkpoint: tuple[str, ...] = option(  # model.checkpoint: one per --model, in order
        (),
        "Serve the weights a training run saved (its --checkpoint-dir); one per --model, in order (default: the "
        "preset's untrained model).",
        type=Optional[list[str]],
        cli_default=None,
    )
    max_query_samples: int = option(
        65_536,  # infer.served.DEFAULT_MAX_QUERY_SAMPLES
        "The largest query accepted, in samples (larger: INVALID_ARGUMENT naming the bound); a query larger than one "
        "piece per instance takes its turns behind the others.",
    )

    def served(self, models: Sequence[str] | None) -> list[Any]:
        """One ServedModel per preset named (default: tiny), DLRM or HSTU; a preset served twice is `name-2`."""
        from dlrm_lab.infer.served import ServedModel
        from dlrm_lab.model.checkpoint import read_checkpoint

        out: list[Any] = []
        seen: dict[str, int] = {}  # spec name -> how many served so far
        names = models or [DEFAULT_MODEL]
        if self.checkpoint and len(self.checkpoint) != len(names):
            raise FieldError(
                "checkpoint", f": give one per {{model}} ({len(names)}), in order; got {len(self.checkpoint)}", "model"
            )
        for name, checkpoint in zip(names, self.checkpoint or [None] * len(names), strict=True):
            spec = load_any_preset(name, table_scale=self.table_scale, max_rows=self.max_rows)
            spec = family_of(spec).with_data_overrides(spec, self.data_overrides, serving=True)
            seen[spec.name] = seen.get(spec.name, 0) + 1
            label = spec.name if seen[spec.name] == 1 else f"{spec.name}-{seen[spec.name]}"
            trained = read_checkpoint(checkpoint) if checkpoint else None  # resolved once: its step is the run's
            out.append(ServedModel(label, spec, checkpoint=trained, **{f: getattr(self, f) for f in _SERVED_FIELDS}))
        return out


# What a ServedModel takes as given: every serving option but the preset's scaling and its requests' overrides
_SERVED_FIELDS = tuple(
    f.name for f in fields(ServingOptions) if f.name not in {"table_scale", "max_rows", "data_overrides", "checkpoint"}
)


def per_model(values: Sequence[Any] | None, n: int, default: Any, field: str) -> list[Any]:
    """One value for all n models, or one per model, in order."""
    values = list(values or [default])
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise FieldError(field, f": give one value or one per {{model}} ({n}), got {len(values)}", "model")
    return values


def numbers(values: Sequence[Any], field: str) -> list[float]:
    """Option values as numbers; 'auto' is only accepted alone (the caller handles it)."""
    out = []
    for v in values:
        try:
            out.append(float(v))
        except ValueError:
            raise FieldError(field, f"{v!r}: expected a number (or auto, given alone)") from None
        if not math.isfinite(out[-1]):
            raise FieldError(field, f"{v!r}: must be a finite number (or auto, given alone)")
    return out


def number_list(text: str, kind: type, field: str) -> list[Any]:
    """A comma-separated list of numbers, e.g. `max_batch` 64,256."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise FieldError(field, f"{text!r}: expected a comma-separated list of numbers") from None
    if not values:
        raise FieldError(field, ": empty list")
    if not all(math.isfinite(v) for v in values):
        raise FieldError(field, f"{text!r}: every value must be a finite number")
    return values


@dataclass(frozen=True)
class LoadPlan:
    """The load of `infer run`: one stream per served model, and whether the rate and the
    bound are for the lab to choose (`qps` and `sla_ms` auto)."""

    streams: list[Any]
    qps_auto: bool
    sla_auto: bool


def default_sla_ms(spec: Any) -> float:
    """A model's latency bound when no --sla-ms is given: its preset's MLPerf Server bound ([mlperf]
    `server_latency_ms`, at p99: dlrmv3's 80 ms), else DEFAULT_SLA_MS."""
    rules = getattr(spec, "mlperf", None)  # only presets of an MLPerf benchmark declare one
    return float(rules.server_latency_ms) if rules is not None else DEFAULT_SLA_MS


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
    if sla_auto or not sla_ms:  # auto: a placeholder until the bound is chosen with the load
        slas = [default_sla_ms(m.spec) for m in served]
    else:
        slas = numbers(per_model(sla_ms, n, DEFAULT_SLA_MS, "sla_ms"), "sla_ms")
    if any(not v > 0 for v in slas):
        raise FieldError("sla_ms", f"{slas}: every bound must be > 0 ms")
    rates = [0.0] * n if qps_auto else numbers(per_model(qps, n, DEFAULT_QPS, "qps"), "qps")
    if not qps_auto and any(not r > 0 for r in rates):
        raise FieldError("qps", f"{rates}: every rate must be > 0 queries/s (or auto)")
    sizes = [QuerySizes.parse(s) for s in per_model(query_size, n, DEFAULT_QUERY_SIZE, "query_size")]
    arrivals = Arrivals.parse(arrival)
    streams = [
        Stream(m.name, r, s, arrivals, sla_ms=sla, order=order)
        for m, r, s, sla in zip(served, rates, sizes, slas, strict=True)
    ]
    return LoadPlan(streams, qps_auto, sla_auto)


@dataclass(frozen=True)
class LoadOptions:
    """The load of `infer run` as given: the models served and, for each (one value for all, or
    one per model), its rate, query sizes and latency bound; `plan` turns them into streams."""

    model: list[str] | None = option(
        None, "Model preset to serve; repeat to co-locate several.", flags=("--model", "-m", "--preset", "-p")
    )
    qps: list[str] | None = option(
        None,
        "Target queries/s (one, or one per --model), or auto: the lab measures capacity and picks a rate meeting "
        "the bound (one model).",
    )
    query_size: list[str] | None = option(
        None,
        "Samples per query: fixed:N, normal:MEAN,STD, lognormal:MEDIAN,SIGMA, uniform:LO,HI or mlperf "
        "(MLPerf DLRMv2's table: 100-700, mean 270). One, or one per --model. Default: fixed:1.",
    )
    arrival: str = option(
        "poisson",
        "Open-loop arrivals: poisson, constant, or bursty[:FACTOR,SHARE,LENGTH_MS] (bursts at FACTOR x the mean rate "
        "for SHARE of the time, LENGTH_MS long on average; default 4,0.1,50).",
    )
    sla_ms: list[str] | None = option(
        None,
        "Latency bound in ms (one, or one per model), or auto with --qps auto: 2.5x the latency of one query at a "
        "time. Default: the preset's MLPerf Server bound where it declares one (dlrmv3: 80 ms), else 10.",
    )
    order: str = option(
        "random", "Which samples queries take: random, or time (the library's order; HSTU requests by time)."
    )

    def plan(self, served: Sequence[Any]) -> LoadPlan:
        return plan_load(served, self.qps, self.query_size, self.sla_ms, self.arrival, self.order)


@dataclass
class InferConfig:
    """How load is driven against the system under test and recorded (`infer.lab.run_inference`).

    Each field with a help text is also an option of `infer run` (and of `infer search`), declared once here."""

    scenario: str = option(
        "open-loop",
        "open-loop (our generator), closed-loop (--concurrency queries outstanding) or MLPerf LoadGen: server, "
        "offline, single-stream, multi-stream.",
    )
    # The system under test (`infer.targets`): in process, or a server at a URL reached over
    # `concurrency` client connections (a closed loop keeps that many queries outstanding in process too)
    target: str = option(
        "in-process",
        "The system under test: in-process (the lab's server, here), grpc://HOST:PORT (a dlrm-lab serve), "
        "kserve://HOST:PORT[/MODEL] (any Open Inference Protocol v2 gRPC server: Triton, KServe, ours) or "
        "http://HOST:PORT[/MODEL] (the same over HTTP/REST). Remote targets "
        "serve with their own settings: --instances, --threads, --precision ... apply in process only.",
    )
    rpc: str | None = option(
        None,
        "grpc:// targets: stream (one InferStream per connection, the default) or unary (an Infer call per query); "
        "kserve:// targets: oip (a ModelInfer call per query); http:// targets: rest (binary tensors, Triton's "
        "extension; the default where the server lists it) or rest-json (JSON tensors).",
    )
    concurrency: int = option(
        1,
        "Remote targets: client connections, each beyond one in a process of its own; a closed loop (--scenario "
        "closed-loop) keeps this many queries outstanding.",
    )
    # remote: a query's deadline
    timeout_s: float = option(30.0, "Remote targets: seconds a query may take (its deadline).", flags=("--timeout",))
    connect_timeout_s: float = option(
        10.0, "Remote targets: seconds to wait for the server at start.", flags=("--connect-timeout",)
    )
    # remote: only UNAVAILABLE answers this long and the server counts as lost
    unavailable_s: float = option(3.0, "Remote targets: the server is lost after only UNAVAILABLE this long.")
    # The machine's price per hour for the cost columns (None: the price stored with its profile, if any)
    price_per_hour: float | None = option(
        None,
        "The machine's price per hour for the cost columns (default: the price stored with `dlrm-lab machine "
        "price`, if any; a remote server's machine: give it here).",
    )
    currency: str | None = option(None, "Currency of --price-per-hour (default: USD).")
    duration_s: float = option(5.0, "Seconds of load per point.", flags=("--duration",))  # at each point
    # Untimed load before each point, at most a quarter of its duration: the point's own
    # streams, open loop, records dropped (MLPerf allows untimed warm-up queries). Without it
    # the first queries of a point meet instances idle since their start.
    warmup_s: float = option(
        0.5,
        "Seconds of untimed load before each point (its own rate and sizes; at most a quarter of the point).",
        flags=("--warmup",),
    )
    sla_ms: float = 10.0  # the load's bound (LoadOptions.sla_ms: one per model)
    sla_percentile: float = option(99.0, "Latency percentile the bound applies to.", flags=("--percentile",))
    # open loop: stop issuing once this far behind the schedule
    max_issue_lag_ms: float = option(
        1000.0,
        "Open loop: stop the load (rows kept, exit 1) once a query is this many ms past its arrival time before it "
        "could be issued: the issuer, not the server, has fallen behind.",
    )
    device: str = option("cpu", "cpu or cuda.")
    pin_cores: bool = option(True, "Pin each instance to its own cores.")
    # several models: also serve each alone at the same load
    compare_alone: bool = option(True, "With several models, also serve each alone (interference).", flags=("--alone",))
    seed: int = option(0, "Seed of the load, the samples and the weights.")
    # Write a Chrome/Perfetto trace of the first point (`metrics.trace`): every instance's torch.profiler
    # operators and the lab's queries and batches, on the server's clock, in the run's trace.json
    trace: bool = option(
        False,
        "Write trace.json: a Chrome/Perfetto trace of the (first) point, torch.profiler's operators in every "
        "instance with the lab's queries and batches (open it in ui.perfetto.dev).",
    )
    qps_auto: bool = False  # the lab chooses the rate it can honour (infer.calibrate.choose_load); one model
    sla_auto: bool = False  # ... and the bound too, from the latency of a query meeting an idle server
    calibrate_s: float = 2.0  # seconds of each calibration step of qps_auto (capacity, unloaded, probes)
    drain_timeout_s: float = 30.0  # after the load, wait this long for the last queries
    # Knobs given as auto (`infer.tune.KNOBS`): chosen on the running server once the load is known
    tune: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from dlrm_lab.infer.drivers import SCENARIOS, scenario
        from dlrm_lab.infer.targets import check_connection, parse_target
        from dlrm_lab.infer.tune import KNOBS, PROBED

        if self.scenario not in SCENARIOS:
            raise FieldError("scenario", f"{self.scenario!r}: allowed: {', '.join(SCENARIOS)}")
        if not self.duration_s > 0:
            raise FieldError("duration_s", f"{self.duration_s!r}: must be > 0 seconds")
        if not self.sla_ms > 0:
            raise FieldError("sla_ms", f"{self.sla_ms!r}: must be > 0")
        if not 0 < self.sla_percentile <= 100:
            raise FieldError("sla_percentile", f"{self.sla_percentile!r}: must be in (0, 100]")
        if not self.max_issue_lag_ms > 0:
            raise FieldError("max_issue_lag_ms", f"{self.max_issue_lag_ms!r}: must be > 0 ms")
        if not 0 <= self.warmup_s <= 600:
            raise FieldError("warmup_s", f"{self.warmup_s!r}: must be in [0, 600] seconds")
        if not self.calibrate_s > 0:
            raise FieldError("calibrate_s", f"{self.calibrate_s!r}: must be > 0 seconds")
        if unknown := sorted(set(self.tune) - set(KNOBS)):
            raise FieldError("tune", f"{unknown[0]!r}: allowed: {', '.join(KNOBS)}")
        if self.price_per_hour is not None:
            by_field("price_per_hour", check_price, self.price_per_hour)
        if self.currency is not None:
            by_field("currency", check_currency, self.currency)
        target = parse_target(self.target)
        check_connection(target, self.connection())
        if not target.sets_policy and self.tune:
            raise FieldError(
                self.tune[0],
                f"auto: {{target}} {self.target}: the server's own serving policy applies "
                "(auto knobs are chosen on a server in this process)",
                "target",
            )
        if not target.sets_policy and self.trace:
            raise FieldError(
                "trace", f": {{target}} {self.target}: a trace profiles instances in this process", "target"
            )
        probed = [k for k in PROBED if k in self.tune]
        if probed and not scenario(self.scenario).probes_rate:
            raise FieldError(
                probed[0],
                "auto: needs open-loop or server load (chosen at the point's rate); "
                f"{{scenario}} {self.scenario}: give a number",
                "scenario",
            )

    def to_dict(self) -> JsonObject:
        return asdict(self)

    def connection(self) -> Any:
        """How the load's clients reach a remote target (`infer.targets.Connection`)."""
        from dlrm_lab.infer.targets import Connection

        return Connection(
            rpc=self.rpc,
            concurrency=self.concurrency,
            timeout_s=self.timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            unavailable_s=self.unavailable_s,
            seed=self.seed,
        )


@dataclass(frozen=True)
class BuildTableOptions:
    """What `infer builds` compares (`infer.build_table.compare_builds`); each field is also its option."""

    builds: str | None = option(None, "Comma-separated builds to compare (default: every build of the model).")
    sizes: str = option("1,32,256", "Batch sizes (samples) each build is timed at: cost per batch and per sample.")
    repeats: int = option(7, "Timed batches per build and size (interleaved; the median is kept).")

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise FieldError("repeats", f"{self.repeats}: must be >= 1")

    def build_list(self) -> list[str] | None:
        return [b.strip() for b in self.builds.split(",") if b.strip()] if self.builds else None

    def size_list(self) -> list[int]:
        sizes = number_list(self.sizes, int, "sizes")
        if min(sizes) < 1:
            raise FieldError("sizes", f"{self.sizes}: batch sizes must be >= 1")
        if len(set(sizes)) < 2:
            raise FieldError("sizes", f"{self.sizes}: give two batch sizes or more (a cost per batch and per sample)")
        return sizes


# `infer run` also takes auto for these serving options (infer.tune.KNOBS): chosen on the running server
RUN_KNOBS: dict[str, OptionChange] = {
    "max_batch": {
        "type": str,
        "default": AUTO,
        "help": (
            "Largest batch in samples, or auto: from the batch cost the instances measure, large enough that the "
            "per-batch cost is at most 10% of a batch, a full batch at most a quarter of the bound."
        ),
    },
    "max_delay_ms": {
        "type": str,
        "default": "1",
        "help": (
            "Longest a query waits for its batch to fill, or auto: the delay of 0-2 ms with the lowest latency "
            "percentile in short probes at the point's own load."
        ),
    },
    "spin_ms": {
        "type": str,
        "default": "0",
        "help": (
            "An idle instance polls for its next batch this long before it sleeps (a core that slept runs the next "
            "batch slower), or auto: chosen like --max-delay-ms, kept only where it beats no spin by 5%."
        ),
    },
    "keep_warm_ms": {
        "type": str,
        "default": "0",
        "help": (
            "An idle instance runs a 1-sample batch of its own every this many ms (0: off), or auto: none against "
            "every 10 ms, probed like --spin-ms, kept only where it beats none by 5% (DLRM presets)."
        ),
    },
}
