"""Sharding chosen by measurement (`--sharding auto` on several CPU ranks).

Which plan is fast is a property of the machine. TorchRec's planner ranks plans with a cost
model calibrated for GPUs (NVLink-class links, fused CUDA kernels). On CPU ranks over gloo it
picked table-row-wise for most tables, whose id bucketing and reduce-scattered outputs cost
more here than the load imbalance it avoids: table-wise was 11-21% faster in every
interleaved pair (docs/benchmarks-history.md, issue 18). Feeding the planner this machine's bandwidths did
not change its choice, because its model has no term for those costs. So on CPU the lab
times each candidate plan for a few steps on the real ranks and keeps the fastest:

- candidates: the planner's plan and every sharding type for all tables (`--shard`
  overrides apply to each); a plan identical to one already timed is not timed again; a
  type whose tables do not fit is skipped with the planner's reason;
- each candidate runs `WARMUP_STEPS` untimed and `TIMED_STEPS` timed training steps on the
  same batches; a step's time is the slowest rank's, and the candidate's the median;
- each candidate runs with the tables' update the run asks for (`--table-update`; auto: timed on
  that candidate's model, since the batched update costs by the ids a rank holds, which
  column-wise plans double);
- the times are cached in this machine's profile under the job's shape (device, ranks,
  threads, batch per rank, table precision, optimizer and update, model), so later runs of the
  same shape reuse them; the manifest records the times, the choice and where they came from.

On GPUs `auto` is the planner's plan (its cost model was made for them); on one rank every
type keeps every table local, so nothing is tried.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from dlrm_lab.config import SHARDING_TYPES, TrainConfig
from dlrm_lab.config.family import Spec
from dlrm_lab.config.train import dense_lr_for
from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.data import BatchSource
from dlrm_lab.distributed.context import DistContext
from dlrm_lab.distributed.plan import describe_plan
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.train.step import dense_optimizer, model_inputs, train_step
from dlrm_lab.train.table_update import choose_table_update

WARMUP_STEPS, TIMED_STEPS = 2, 4
CANDIDATES = ("planner", *SHARDING_TYPES)

# One candidate's trial: ("timed", step ms per timed step), ("same", the candidate with the identical
# plan) or ("refused", why).
Trial = tuple[str, Any]


@dataclass(frozen=True)
class ShardingChoice:
    """The sharding a run plans with, and why."""

    sharding: str  # "planner" or one sharding type
    reason: str
    step_ms: dict[str, float] = field(default_factory=dict)  # candidate -> median step ms (slowest rank)
    skipped: dict[str, str] = field(default_factory=dict)  # candidate -> why it was not timed
    source: str | None = None  # measured now / cached in the profile

    @property
    def line(self) -> str:
        cached = " (times cached in this machine's profile)" if (self.source or "").startswith("cached") else ""
        return f"sharding {self.sharding}: {self.reason}{cached}"

    def to_dict(self) -> JsonObject:
        return {
            "sharding": self.sharding,
            "reason": self.reason,
            "step_ms": self.step_ms,
            "skipped": self.skipped,
            "source": self.source,
            "warmup_steps": WARMUP_STEPS,
            "timed_steps": TIMED_STEPS,
        }


def pick(step_ms: dict[str, float], skipped: dict[str, str], source: str) -> ShardingChoice:
    """The fastest timed candidate (the planner's on a tie), with the times beside it."""
    if not step_ms:
        raise FieldError("sharding", f"auto: no sharding plan could be tried on these ranks ({skipped})")
    order = {c: i for i, c in enumerate(CANDIDATES)}
    best = min(step_ms, key=lambda c: (step_ms[c], order.get(c, len(order))))
    others = sorted((ms, c) for c, ms in step_ms.items() if c != best)
    shown = ", ".join(f"{c} {ms:.1f}" for ms, c in others[:3])
    reason = f"fastest of {len(step_ms)} plans tried on this machine: {step_ms[best]:.1f} ms a step"
    reason += f" (next: {shown} ms)" if shown else ""
    return ShardingChoice(best, reason, dict(step_ms), dict(skipped), source)


def trial_key(
    spec: Any, device: torch.device, world_size: int, local_world_size: int, cfg: Any, backend: str = "gloo"
) -> str:
    """The job shape the cached times belong to (the collectives' backend too: over MPI another plan wins)."""
    digest = hashlib.sha1(json.dumps(spec.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:12]
    where = "cpu" if device.type == "cpu" else f"{device.type}"
    shard = ",".join(sorted(cfg.shard)) or "-"
    data = "synthetic" if cfg.data == "synthetic" else "dataset"
    return (
        f"{where}/{backend}/{world_size}r{local_world_size}l/{torch.get_num_threads()}t/b{cfg.batch_size}/"
        f"{cfg.table_precision}/{cfg.embedding_optimizer}/{cfg.dense_optimizer}/{cfg.precision}/{data}/"
        f"attention={cfg.attention}/pipeline={cfg.pipeline}/shard={shard}/update={cfg.table_update}/"
        f"{spec.name}-{digest}"
    )


def slowest_rank_ms(times_ms: Sequence[float], world_size: int) -> list[float]:
    """Each step's time on the slowest rank (a collective: every rank calls it with its own times)."""
    t = torch.tensor(list(times_ms), dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_trials(
    candidates: Sequence[str],
    build: Callable[[str], tuple[Any, Any, str]],
    step: Callable[[Any, Any, Any], None],
    batches: Sequence[Any],
    world_size: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, Trial]:
    """Time each candidate on the same batches. `build(candidate)` -> (model, optimizer, plan signature),
    raising UserError where the plan is refused; `step(model, optimizer, batch)` is one training step."""
    out: dict[str, Trial] = {}
    seen: dict[str, str] = {}
    for candidate in candidates:
        try:
            model, optimizer, signature = build(candidate)
        except UserError as exc:
            out[candidate] = ("refused", str(exc).split(" [planner: ")[-1].rstrip("]")[:160])
            continue
        if signature in seen:
            out[candidate] = ("same", seen[signature])
            del model, optimizer
            gc.collect()
            continue
        seen[signature] = candidate
        times = []
        for i, batch in enumerate(batches[: WARMUP_STEPS + TIMED_STEPS]):
            t0 = time.perf_counter()
            step(model, optimizer, batch)
            sync()
            if i >= WARMUP_STEPS:
                times.append((time.perf_counter() - t0) * 1000)
        out[candidate] = ("timed", slowest_rank_ms(times, world_size))
        del model, optimizer
        gc.collect()  # the sharded model lives in reference cycles (hooks, DDP): freed before the next is planned
    return out


def summarize_trials(trials: dict[str, Trial]) -> tuple[dict[str, float], dict[str, str]]:
    """(median ms per timed candidate, why each other one was not timed)."""
    step_ms = {c: statistics.median(v) for c, (kind, v) in trials.items() if kind == "timed" and v}
    skipped = {}
    for c, (kind, v) in trials.items():
        if kind == "same":
            skipped[c] = f"the same plan as {v}"
        elif kind == "refused":
            skipped[c] = f"refused: {v}"
    return step_ms, skipped


def cached_trials(key: str, log: Log | None = None) -> tuple[JsonObject | None, str | None]:
    """The cached entry for `key` in this machine's profile (None where it is damaged: `log` hears why), and the
    profile's path."""
    from dlrm_lab.metrics.measured import cached_choice
    from dlrm_lab.metrics.roofline import load_profile, profile_path

    profile = load_profile()
    if profile is None:
        return None, None
    fingerprint_id = cast(str, profile["fingerprint_id"])  # a loaded profile's id: a string
    return cached_choice(profile, "sharding_trials", key, log), str(profile_path(fingerprint_id))


def store_trials(key: str, step_ms: dict[str, float], skipped: dict[str, str]) -> str:
    """Cache the times in this machine's profile (when there is one); where they went."""
    from dlrm_lab.metrics.measured import record_measured
    from dlrm_lab.metrics.roofline import load_profile

    entry: JsonObject = {"step_ms": step_ms, "skipped": skipped}
    return record_measured(load_profile(), "sharding_trials", key, entry, on="these ranks")


def choose_sharding(
    requested: str, ctx: Any, key: str, trial: Callable[[], dict[str, Trial]], log: Log | None = None
) -> ShardingChoice:
    """Resolve `--sharding` into what the planner is asked for. `trial()` times the candidates (`run_trials`);
    it runs on every rank (a collective), only for `auto` on several CPU ranks and when nothing is cached."""
    if requested != "auto":
        what = "TorchRec's planner" if requested == "planner" else "every table"
        return ShardingChoice(requested, f"asked for (--sharding {requested}: {what}); not measured")
    if ctx.world_size == 1:
        return ShardingChoice("planner", "one rank: every table is local whichever the type (planned table-wise)")
    if ctx.device.type != "cpu":
        return ShardingChoice("planner", f"TorchRec's planner: its cost model is made for {ctx.device.type} devices")
    shared: list[Any] = [None]
    if ctx.rank == 0:
        try:
            shared[0] = cached_trials(key, log)
        except UserError as exc:  # a corrupt profile: every rank says so, none waits in the broadcast
            shared[0] = str(exc)
    dist.broadcast_object_list(shared, src=0)  # every rank takes the same path
    if isinstance(shared[0], str):
        raise UserError(shared[0])
    entry, where = shared[0]
    if entry:
        return pick(entry["step_ms"], entry["skipped"], f"cached in {where} (measured {entry['measured_at']})")
    if log:
        log(f"sharding auto: timing up to {len(CANDIDATES)} plans for {WARMUP_STEPS}+{TIMED_STEPS} steps each")
    step_ms, skipped = summarize_trials(trial())
    source = "measured now"
    if ctx.rank == 0:
        try:
            source = store_trials(key, step_ms, skipped)
        except (UserError, OSError) as exc:  # the times stand; only the cache is lost
            source = f"measured now (not cached: {exc})"
    return pick(step_ms, skipped, source)


def resolve_sharding(
    spec: Spec,
    cfg: TrainConfig,
    ctx: DistContext,
    first_batches: Callable[[], BatchSource],
    build: Callable[..., Any],
    log: Any,
) -> ShardingChoice:
    """`--sharding` resolved for a run: for `auto` on several CPU ranks, the candidate plans are
    built and timed on the run's first batches (`first_batches()`, every rank), unless this machine's
    profile has their times."""

    def trial() -> dict[str, Trial]:
        batches = [b.to(ctx.device) for b in itertools.islice(iter(first_batches()), WARMUP_STEPS + TIMED_STEPS)]

        def built(candidate: str) -> tuple[Any, Any, str]:
            dmp, plan = build(candidate)
            # each plan timed with the table update it would run (its ids per rank decide the batched one's cost)
            choose_table_update(cfg.table_update, dmp, lambda: dmp(*model_inputs(batches[0])))
            layout = describe_plan(plan, spec, ctx.world_size)["tables"]
            return dmp, dense_optimizer(dmp, cfg, dense_lr_for(spec, cfg, ctx.world_size)[0]), repr(layout)

        def step(dmp: Any, optimizer: Any, batch: Batch) -> None:
            train_step(dmp, optimizer, batch, ctx, cfg, lambda _: None)

        sync = (lambda: torch.cuda.synchronize(ctx.device)) if ctx.device.type == "cuda" else (lambda: None)
        return run_trials(CANDIDATES, built, step, batches, ctx.world_size, sync)

    key = trial_key(spec, ctx.device, ctx.world_size, ctx.local_world_size, cfg, ctx.backend)
    choice = choose_sharding(cfg.sharding, ctx, key, trial, log if ctx.is_main else None)
    if log and ctx.is_main and cfg.sharding == "auto" and ctx.world_size > 1:
        log(choice.line)
    return choice
