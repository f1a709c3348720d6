"""`train --profile-steps N`: torch.profiler over N measured steps, per operator.

The phase timers cannot split a phase into the collectives it waits on and the local work
around them (fbgemm's row bucketising inside the input distribution, a reduce-scatter inside
backward). This records, on every rank, each operator's calls and CPU time per profiled
step (self: its own; total: with what it calls), so the gap of a multi-rank run can be named
operator by operator (docs/benchmarks-history.md, issue 18). Written to the run's profile.parquet, and rank 0's
operators as a Chrome/Perfetto trace (trace.json, `metrics.trace.training_trace`) in which each
profiled step is a `step <n>` span carrying its phases.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from dlrm_lab.metrics.columns import ProfileRow, StepRow, schema_of

PROFILE_SCHEMA = schema_of("profile")  # `metrics.columns`
TOP_OPS = 60  # per rank, by self time


class StepProfiler:
    """Profiles steps [first, first + count) of a run; `step(i)` is called before step i runs."""

    def __init__(self, first: int, count: int, cuda: bool = False) -> None:
        self.first, self.count = first, count
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof: Any = None
        self._span: Any = None  # the running step's record_function
        self.profiled = 0
        self.rows: list[ProfileRow] = []  # this rank's operators (their rank set as they are written)
        self.trace: Path | None = None  # the profiler's own Chrome trace export, once stopped

    def step(self, i: int) -> None:
        if i == self.first and self.count:
            self._prof = profile(activities=self.activities)
            self._prof.__enter__()
        elif self._prof is not None and i == self.first + self.count:
            self.stop()
        if self._prof is not None:
            self._end_span()
            self._span = record_function(f"step {i}")
            self._span.__enter__()

    def _end_span(self) -> None:
        if self._span is not None:
            span, self._span = self._span, None
            span.__exit__(None, None, None)

    def stop(self) -> None:
        """End profiling (at the window's end, or early when the run stops first)."""
        if self._prof is None:
            return
        self._end_span()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.profiled = self.count
        self._summarise(prof)
        with tempfile.NamedTemporaryFile(prefix="dlrm-lab-trace-", suffix=".json", delete=False) as f:
            self.trace = Path(f.name)
        prof.export_chrome_trace(str(self.trace))

    def _summarise(self, prof: Any) -> None:
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
        n = max(1, self.profiled)
        self.rows = [
            ProfileRow(
                op=e.key,
                calls_per_step=e.count / n,
                self_ms_per_step=e.self_cpu_time_total / 1e3 / n,
                total_ms_per_step=e.cpu_time_total / 1e3 / n,
                steps=n,
            )
            for e in events
        ]


def profile_window(start_step: int, steps: int, count: int, after: int | None = None) -> tuple[int, int]:
    """The profiled steps: `count` steps after a short warm-up (5 steps, fewer in short runs), and after step
    `after` where given (the last step of the run's choice trials: a profile of the steps that alternate two ways
    would mix them)."""
    start = max(start_step, after + 1) if after is not None and after + 1 < steps else start_step
    count = min(count, steps - start)
    first = start + min(5, max(0, steps - start - count))
    return first, count


def write_profile(
    run: Any, rows: list[ProfileRow], ctx: Any, trace: Path | None = None, steps: list[StepRow] | None = None
) -> None:
    """Every rank's operator rows into rank 0's profile.parquet (a collective: every rank calls it), and
    rank 0's trace (`trace`: the profiler's export; `steps`: the run's step rows) into trace.json."""
    mine = [ProfileRow(rank=ctx.rank, **r) for r in rows]
    every = mine
    if ctx.world_size > 1:
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        every = [r for part in gathered for r in part]
    if run is not None and ctx.is_main and every:
        pq.write_table(pa.Table.from_pylist(every, schema=PROFILE_SCHEMA), run.dir / "profile.parquet")
    if trace is not None:
        if run is not None and ctx.is_main:
            from dlrm_lab.metrics.trace import training_trace

            my_steps = [s for s in steps or [] if s.get("rank", 0) == ctx.rank]
            run.update_manifest(trace=training_trace(trace, my_steps, run.dir / "trace.json"))
        trace.unlink(missing_ok=True)
