"""A model as served: its spec, its instances and its batching policy (`infer.server` serves it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dlrm_lab.config.family import family_of
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.infer.allocator import GLIBC, library_of
from dlrm_lab.infer.batch_memory import BATCH_MEMORY
from dlrm_lab.infer.builds import build_names
from dlrm_lab.infer.instance import IDLE_HOLDS, PRECISIONS
from dlrm_lab.infer.serving_parts import serving_of
from dlrm_lab.infer.snapshot import TABLE_PAGES
from dlrm_lab.infer.sut import ModelDescription
from dlrm_lab.infer.tables import TABLE_PRECISIONS
from dlrm_lab.metrics.columns import InferSummaryRow
from dlrm_lab.metrics.precision import AUTO

if TYPE_CHECKING:
    from dlrm_lab.model.checkpoint import TrainedCheckpoint

DEFAULT_MAX_QUERY_SAMPLES = 65_536  # ~100x MLPerf's largest DLRM query (700 samples)


@dataclass
class ServedModel:
    """One model as served: its instances and its batching policy."""

    name: str
    spec: Any  # its family's typed spec (families)
    instances: int = 1
    threads: int = 1  # intra-op threads per instance
    max_batch: int = 256  # samples
    max_delay_ms: float = 1.0
    max_queue: int = 4096  # waiting queries before new ones are dropped
    # Smallest piece a query is split into when instances are idle (see infer.server);
    # 0: measured at start, the batch whose per-sample time equals the per-batch fixed time.
    min_piece: int = 0
    # An idle instance busy-polls its pipe this long before blocking (see infer.instance).
    spin_ms: float = 0.0
    # An idle instance runs a 1-sample batch every this many ms to keep its working set in cache (0: off)
    keep_warm_ms: float = 0.0
    # What an idle instance holds while it waits (infer.instance.IDLE_HOLDS)
    idle_hold: str = "none"
    # Whether its instances' malloc keeps a batch's freed buffers (infer.batch_memory); auto: each instance times it
    batch_memory: str = "release"
    # The C allocator its instances run (infer.allocator): glibc, jemalloc, tcmalloc, or auto (chosen by the plan)
    allocator: str = "glibc"
    # The snapshot's pages, where its instances map the tables (infer.instance.TABLE_PAGES): base (4 KiB), huge
    # (a tmpfs of 2 MiB pages the server mounts), or auto (chosen by the plan)
    table_pages: str = "base"
    precision: str = "fp32"  # dense compute: fp32, bf16, fp16, or auto (measured: dlrm_lab.metrics.precision)
    table_precision: str = "fp32"  # fp32, fp16, int8, int4 (quantised row-wise, fbgemm)
    data_spec: str | None = None
    library_samples: int = 0  # 0: 16 x max_batch (capped at 4096), at least 8192 (HSTU: at most its eval window)
    # HSTU: keep each user's encoded history for their next request (infer.history), this many MB
    # per instance; 0: every history encoded whole
    history_cache_mb: float = 0.0
    attention: str = "auto"  # HSTU: padded, jagged, or auto (timed at start)
    # HSTU with history reuse and several instances: a user's requests go to the instance that holds
    # their history (an idle instance still takes others' requests when none of its own wait)
    history_affinity: bool = True
    # The inference form served (infer.builds): auto (timed at start, infer.build), or a build's name
    build: str = "auto"
    # Runners-up of an auto build that each instance times again in its own process before it serves
    # (`infer.finalists`), as (build, artefact) pairs; set by the plan, not by a user
    finalists: tuple[tuple[str, str], ...] = ()
    # Batch sizes the build is timed at (auto); empty: an eighth of max_batch and max_batch
    build_batches: tuple[int, ...] = ()
    # The largest query the load will send (its 99.9th percentile; 0: unknown): a query is cut only into
    # pieces that can run at once (at most one per instance), so a piece may exceed max_batch up to
    # largest_query / instances, and the instances warm up to that size (`piece_limit`)
    largest_query: int = 0
    # The largest query accepted: one query of millions of samples would hold every instance for minutes
    max_query_samples: int = DEFAULT_MAX_QUERY_SAMPLES
    # The trained weights served (`model.checkpoint.read_checkpoint` of a `train --checkpoint-dir`, resolved once
    # where the option was read: its step, sidecar and path); None: the preset's freshly initialised model
    checkpoint: TrainedCheckpoint | None = None

    def __post_init__(self) -> None:
        for name, value in (
            ("instances", self.instances),
            ("threads", self.threads),
            ("max_batch", self.max_batch),
            ("max_queue", self.max_queue),
            ("max_query_samples", self.max_query_samples),
        ):
            if not isinstance(value, int) or value < 1:
                raise FieldError(name, f"{value!r}: must be a whole number >= 1")
        if not isinstance(self.min_piece, int) or self.min_piece < 0:
            raise FieldError("min_piece", f"{self.min_piece!r}: must be a whole number >= 0 (0: measured)")
        if not 0 <= self.spin_ms <= 10_000:
            raise FieldError("spin_ms", f"{self.spin_ms!r}: must be in [0, 10000]")
        if not (self.keep_warm_ms == 0 or 1 <= self.keep_warm_ms <= 10_000):
            raise FieldError("keep_warm_ms", f"{self.keep_warm_ms!r}: must be 0 (off) or in [1, 10000]")
        if self.idle_hold not in IDLE_HOLDS:
            raise FieldError("idle_hold", f"{self.idle_hold!r}: allowed: {', '.join(IDLE_HOLDS)}")
        if self.batch_memory not in BATCH_MEMORY:
            raise FieldError("batch_memory", f"{self.batch_memory!r}: allowed: {', '.join(BATCH_MEMORY)}")
        if self.allocator not in (AUTO, GLIBC) and (self.batch_memory == "keep" or self.idle_hold == "keep-memory"):
            asked = "--batch-memory keep" if self.batch_memory == "keep" else "--idle-hold keep-memory"
            raise FieldError(
                "allocator", f"{self.allocator!r}: {asked} is told to glibc's malloc (mallopt): use glibc or auto"
            )
        if self.table_pages not in (AUTO, *TABLE_PAGES):
            raise FieldError("table_pages", f"{self.table_pages!r}: allowed: {AUTO}, {', '.join(TABLE_PAGES)}")
        if self.allocator != AUTO:
            library_of(self.allocator)  # named: allowed and installed here, or one line saying which are
        if not self.max_delay_ms >= 0:
            raise FieldError("max_delay_ms", f"{self.max_delay_ms!r}: must be >= 0")
        if self.precision not in (AUTO, *PRECISIONS):
            raise FieldError("precision", f"{self.precision!r}: allowed: {AUTO}, {', '.join(PRECISIONS)}")
        if self.table_precision not in TABLE_PRECISIONS:
            raise FieldError("table_precision", f"{self.table_precision!r}: allowed: {', '.join(TABLE_PRECISIONS)}")
        if not 0 <= self.history_cache_mb <= 1e7:
            raise FieldError("history_cache_mb", f"{self.history_cache_mb!r}: must be in [0, 1e7] MB")
        if self.build not in (AUTO, *build_names()):
            raise FieldError("build", f"{self.build!r}: allowed: {AUTO}, {', '.join(build_names())}")
        serving_of(self.spec).check_served(self)

    def describe(self) -> InferSummaryRow:
        """How it is served, as its summary rows' columns (and the run manifest's record of it)."""
        return InferSummaryRow(
            {
                "model": self.name,
                "preset": self.spec.name,
                "instances": self.instances,
                "threads_per_instance": self.threads,
                "max_batch": self.max_batch,
                "max_delay_ms": self.max_delay_ms,
                "max_queue": self.max_queue,
                "min_piece": self.min_piece,
                "spin_ms": self.spin_ms,
                "keep_warm_ms": self.keep_warm_ms,
                "idle_hold": self.idle_hold,
                "batch_memory": self.batch_memory,
                "allocator": self.allocator,
                "table_pages": self.table_pages,
                "precision": self.precision,
                "table_precision": self.table_precision,
                "history_cache_mb": self.history_cache_mb,
                "history_affinity": self.history_affinity if self.history_cache_mb else None,
                "attention": self.attention if family_of(self.spec).attention_paths else None,
                "build": self.build,
                "max_query_samples": self.max_query_samples,
                **self.checkpoint_columns(),
            }
        )

    def checkpoint_columns(self) -> InferSummaryRow:
        trained = self.checkpoint
        if trained is None:
            return InferSummaryRow(checkpoint=None, checkpoint_step=None, checkpoint_auc=None)
        return InferSummaryRow(
            checkpoint=str(trained.path),
            checkpoint_step=trained.step,
            checkpoint_auc=trained.held_out_auc,
        )

    def description(self) -> ModelDescription:
        """This model as the runner reads it (`infer.sut.ModelDescription`)."""
        return ModelDescription(
            name=self.name,
            spec=self.spec,
            instances=self.instances,
            threads=self.threads,
            max_batch=self.max_batch,
            max_delay_ms=self.max_delay_ms,
            spin_ms=self.spin_ms,
            keep_warm_ms=self.keep_warm_ms,
            min_piece=self.min_piece,
            max_queue=self.max_queue,
            largest_query=self.largest_query,
            precision=self.precision,
            table_precision=self.table_precision,
            build=self.build,
            columns=self.describe(),
        )

    def piece_limit(self) -> int:
        """The largest batch an instance serves: max_batch, or one instance's share of the largest query."""
        return max(self.max_batch, -(-self.largest_query // self.instances))

    def largest_batch(self) -> int:
        """The largest batch an instance may serve, what it warms up to and judges its memory at: its piece limit,
        or the largest its build is timed at where that is larger (Offline's auto max batch, chosen after the
        instances start, runs to its cap: `infer.lab.for_load`)."""
        return max(self.piece_limit(), *self.batches_to_time())

    def batches_to_time(self) -> list[int]:
        """The batch sizes a build is timed at: those given (`infer.lab.for_load`: what the load will batch), else an
        eighth of max_batch and max_batch."""
        return sorted({int(n) for n in self.build_batches} or {max(1, self.max_batch // 8), self.max_batch})


OVERSUBSCRIPTION_LIMIT = 4  # instance threads per core beyond which a server is refused


def check_cores(models: list[ServedModel], cores: int, device: str = "cpu") -> str | None:
    """Refuse models whose instances x threads exceed OVERSUBSCRIPTION_LIMIT x the usable cores (they would
    spend minutes starting and then measure the scheduler); a warning line when they exceed the cores
    at all (None when they fit). On a GPU the instances' host threads mostly wait: not checked."""
    if device != "cpu" or cores < 1:
        return None
    want = sum(m.instances * m.threads for m in models)
    if want <= cores:
        return None
    what = " + ".join(f"{m.name}: --instances {m.instances} x --threads {m.threads}" for m in models)
    if want > OVERSUBSCRIPTION_LIMIT * cores:
        raise UserError(
            f"{what} = {want} threads on {cores} usable cores, more than {OVERSUBSCRIPTION_LIMIT}x: "
            "use fewer --instances or --threads"
        )
    return (
        f"warning: {what} = {want} threads on {cores} usable cores: instances will wait for each other's "
        "cores, so latency measures the scheduler as much as the model"
    )
