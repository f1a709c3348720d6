"""What a training run chooses by measurement before it starts: the dense precision and, for the HSTU
ranker, the attention path. Rank 0 measures (or reads the cached rates); every rank runs its choice."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypedDict, cast

import torch
import torch.distributed as dist

from dlrm_lab.config import PRECISIONS, TrainConfig
from dlrm_lab.config.family import Spec, family_of
from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.distributed.context import DistContext
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.metrics.interleaved import interleaved_medians
from dlrm_lab.metrics.precision import PrecisionChoice, choose_precision
from dlrm_lab.train.dense_weights import WAYS as WEIGHT_WAYS
from dlrm_lab.train.dense_weights import DenseWeights
from dlrm_lab.train.dense_weights import unsupported as unsupported_weights
from dlrm_lab.train.step import DENSE_UPDATE_ARGS, dense_params, make_dense
from dlrm_lab.train.step_trial import StepTrial, trial_window


def choose_run_precision(spec: Spec, cfg: TrainConfig, ctx: DistContext, log: Log | None):
    """Rank 0 measures (or reads the cached rates) and every rank runs its choice."""
    shared: list[Any] = [None]
    if ctx.is_main:
        try:
            shared[0] = choose_precision(
                cfg.precision,
                spec,
                allowed=PRECISIONS,
                device=ctx.device,
                threads=torch.get_num_threads(),
                rows=cfg.batch_size,
                log=log,
            )
        except UserError as exc:  # every rank says so (the error itself: a FieldError names its field)
            shared[0] = exc
        if log and not isinstance(shared[0], UserError):
            log(shared[0].line)
    if ctx.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], UserError):
        raise shared[0]
    choice: PrecisionChoice = shared[0]
    return choice


def choose_run_attention(spec: Any, cfg: TrainConfig, ctx: DistContext, log: Any) -> JsonObject | None:
    """The attention path of a family that has them (the HSTU ranker's, `model.hstu.choose_attention`):
    rank 0 times, every rank runs it; None for a family without attention."""
    if not family_of(spec).attention_paths:
        return None
    from dlrm_lab.model.hstu import choose_attention

    shared: list[Any] = [None]
    if ctx.is_main:
        try:
            shared[0] = choose_attention(cfg.attention, spec, cfg.batch_size, ctx.device, cfg.seed).to_dict()
        except (UserError, RuntimeError) as exc:  # every rank says so; none waits in the broadcast
            why = str(exc).splitlines()[0][:200]
            shared[0] = FieldError("attention", f"{cfg.attention}: timing the paths failed: {why}")
    if ctx.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], UserError):
        raise shared[0]
    if log and ctx.is_main and cfg.attention == "auto":
        log(f"attention {shared[0]['attention']}: {shared[0]['reason']}")
    return shared[0]


def choose_run_collectives(spec: Any, cfg: TrainConfig, launch: Any) -> dict[str, str]:
    """gloo or MPI for this run's CPU collectives (`distributed.mpi.choose_collectives`), before the
    process group exists: under mpiexec rank 0's choice reaches every rank through MPI itself."""
    from dlrm_lab.distributed.mpi import choose_collectives
    from dlrm_lab.metrics.roofline import load_profile
    from dlrm_lab.model.cost import step_communication_bytes
    from dlrm_lab.train.scaling_model import communication_seconds

    world = launch.world_size
    comm_bytes = step_communication_bytes(spec, cfg.batch_size * world, world) if world > 1 else {}
    profile = load_profile() if world > 1 and launch.launcher == "mpi" and cfg.collectives == "auto" else None
    choice = choose_collectives(
        cfg.collectives,
        launch.launcher,
        cfg.device,
        world,
        lambda transport: communication_seconds(profile, transport, comm_bytes) if profile else None,
    )
    if launch.launcher == "mpi" and world > 1:
        from mpi4py import MPI

        choice = MPI.COMM_WORLD.bcast(choice, root=0)
    return {"collectives": choice[0], "reason": choice[1]}


def choose_run_table_update(
    cfg: TrainConfig,
    ctx: DistContext,
    dmp: torch.nn.Module,
    first_batch: Callable[[], Any],
    forward: Any,
    log: Log | None,
) -> JsonObject:
    """The tables' backward-and-update path (`train.table_update`): every rank times its own table groups on
    the run's first batch (the forward is collective over ranks), rank 0's choice runs everywhere."""
    from dlrm_lab.train.table_update import choose_table_update, install

    choice = choose_table_update(cfg.table_update, dmp, lambda: forward(first_batch().to(ctx.device))).to_dict()
    shared = [choice]
    if ctx.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
        install(dmp, cast(str, shared[0]["table_update"]))  # rank 0's `TableUpdateChoice.to_dict()`
        shared[0] = {**shared[0], "this_rank": choice}
    if log and ctx.is_main:
        log(f"table update {choice['table_update']}: {choice['reason']}")
    return shared[0]


DENSE_UPDATE_REPEATS = 5  # timings of each way, interleaved, after one warm-up round
DENSE_UPDATE_STEPS = 3  # optimizer steps a timing averages


def choose_dense_update(
    cfg: TrainConfig,
    ctx: DistContext,
    model: torch.nn.Module,
    lr: float,
    recipe: Any,
    log: Log | None,
) -> JsonObject:
    """How the dense optimizer steps (`train.step.DENSE_UPDATE_ARGS`; `--dense-update` where not auto): rank 0 times
    each way on copies of this run's dense parameters with random gradients (the model untouched), medians of
    interleaved repeats; every rank runs its choice. On a GPU: torch's default there (foreach), untimed."""
    if cfg.dense_update != "auto":
        return {"dense_update": cfg.dense_update, "reason": f"--dense-update {cfg.dense_update}", "ms": {}}
    if ctx.device.type != "cpu":
        return {"dense_update": "foreach", "reason": f"torch's default on {ctx.device.type} (not timed)", "ms": {}}
    shared: list[Any] = [None]
    if ctx.is_main:
        originals = [p for p in dense_params(model).values() if p.requires_grad]
        stepped: dict[str, Any] = {}  # each way this torch, device and dtype have, stepped once
        failed: dict[str, str] = {}
        for way in DENSE_UPDATE_ARGS:
            copies = [p.detach().clone().requires_grad_() for p in originals]
            for c in copies:
                c.grad = torch.randn_like(c) * 1e-3
            try:
                stepped[way] = make_dense(copies, cfg, lr, recipe, way)
                stepped[way].step()  # its state made, out of the timing
            except (RuntimeError, ValueError) as e:  # a way this torch, device or dtype does not have
                failed[way] = str(e).splitlines()[0]
                stepped.pop(way, None)

        def timed(way: str) -> float:
            start = time.perf_counter()
            for _ in range(DENSE_UPDATE_STEPS):
                stepped[way].step()
            return (time.perf_counter() - start) * 1e3 / DENSE_UPDATE_STEPS

        med = interleaved_medians(list(stepped), timed, DENSE_UPDATE_REPEATS, warm_up=False)  # warm: stepped once
        best = min(med, key=lambda w: med[w])
        listed = ", ".join(f"{w} {m:.3f} ms" for w, m in sorted(med.items(), key=lambda wm: wm[1]))
        shared[0] = {
            "dense_update": best,
            "reason": f"the fastest of the dense {cfg.dense_optimizer} step's ways: {listed} (medians of "
            f"{DENSE_UPDATE_REPEATS} interleaved, {sum(p.numel() for p in originals):,} parameters)",
            "ms": {w: round(m, 4) for w, m in med.items()},
            "not_available": failed,
        }
    if ctx.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
    if log and ctx.is_main:
        log(f"dense update {shared[0]['dense_update']}: {shared[0]['reason']}")
    return shared[0]


INTERACTION_MARGIN = 1.10  # the Gram matrix leaves autocast when that takes at least this much longer
INTERACTION_REPEATS = 5  # timings of each way, interleaved, after one warm-up round
INTERACTION_CALLS = 3  # forward-and-backward calls a timing averages


def _interaction_timer(arch: Any, width: int, cfg: TrainConfig, device: torch.device) -> Callable[[Any], float]:
    """Milliseconds of the dot interaction's forward and backward at the run's batch as the step runs it (a bf16
    run: under bf16 autocast, the bottom MLP's output in bf16, the pooled embeddings fp32; an fp32 run: fp32 both),
    one way (`_put_gram`); the inputs made once, so only the interaction is timed."""
    bf16 = cfg.precision != "fp32"
    dense = torch.randn(
        cfg.batch_size, width, device=device, dtype=torch.bfloat16 if bf16 else torch.float32, requires_grad=True
    )
    sparse = torch.randn(cfg.batch_size, arch.F, width, device=device, requires_grad=True)
    with torch.no_grad():
        grad = torch.randn_like(arch(dense.float(), sparse))

    def once() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = arch(dense, sparse)
        out.backward(grad)

    def timed(way: str) -> float:
        before = arch.gram_dtype, arch.native
        _put_gram([arch], way)
        try:
            once()  # allocations of this way's first call out of the timing
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(INTERACTION_CALLS):
                once()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return (time.perf_counter() - start) * 1e3 / INTERACTION_CALLS
        finally:
            arch.gram_dtype, arch.native = before

    return timed


def _put_gram(arches: list[Any], way: str) -> None:
    """Every dot interaction computes its Gram matrix `way` (`DotInteractionArch.use`)."""
    for arch in arches:
        arch.use(way)


def interaction_ways(device: torch.device, precision: str) -> tuple[tuple[str, ...], str | None]:
    """The ways a dot interaction can run here, torch's own first, and why the lab's kernel is not among them (None
    where it is). An fp32 run's torch ways are one ("torch")."""
    from dlrm_lab.model import native

    torch_ways = ("torch",) if precision == "fp32" else ("autocast", "fp32")
    why = native.unavailable(device)
    return (torch_ways if why else (*torch_ways, "native")), why


def choose_run_interaction(
    spec: Spec, cfg: TrainConfig, ctx: DistContext, model: torch.nn.Module, log: Log | None
) -> JsonObject | None:
    """How a dot interaction computes its Gram matrix (`--dot-interaction`): with `auto`, rank 0 times each way at
    the run's batch (in a bf16 run: bf16 as autocast casts its `bmm`, fp32 out of autocast, the lab's kernel; in an
    fp32 run: torch's ops or the kernel), every rank runs its choice; None where there is no dot interaction, or an
    fp32 run with only torch's way."""
    from dlrm_lab.model.interaction import DotInteractionArch

    arches = DotInteractionArch.within(model)
    if not arches:
        return None
    precision = "fp32" if cfg.precision == "fp32" else "bf16"
    ways, not_native = interaction_ways(ctx.device, precision)
    if cfg.dot_interaction != "auto":
        way = cfg.dot_interaction
        if way == "native" and not_native:
            raise FieldError("dot_interaction", f"native: {not_native}")
        if precision == "fp32" and way != "native":
            way = "torch"  # autocast and fp32 are torch's fp32 ops in an fp32 run
        _put_gram(arches, way)
        return {
            "requested": cfg.dot_interaction,
            "gram_dtype": way,
            "reason": f"--dot-interaction {cfg.dot_interaction}",
        }
    if len(ways) == 1:
        return None
    shared: list[Any] = [None]
    if ctx.is_main:
        timed = _interaction_timer(arches[0], spec.tables[0].embedding_dim, cfg, ctx.device)
        med = interleaved_medians(ways, timed, INTERACTION_REPEATS)
        base = ways[0]
        # torch's own way unless another is faster by the margin; of those, the fastest
        way = min((w for w in ways if med[base] >= INTERACTION_MARGIN * med[w]), key=lambda w: med[w], default=base)
        timings = ", ".join(f"{w} {med[w]:.2f} ms" for w in ways)
        shared[0] = {
            "requested": "auto",
            "gram_dtype": way,
            "reason": f"the dot interaction's forward and backward took {timings} ({precision}; autocast: autocast's "
            f"bmm, fp32: the Gram matrix in fp32, torch: torch's ops, native: the lab's kernel) at batch "
            f"{cfg.batch_size}, medians of {INTERACTION_REPEATS} interleaved; "
            + (f"{way} kept" if way != base else f"none is {INTERACTION_MARGIN:.2f}x faster: {base} kept")
            + (f" (native not timed: {not_native})" if not_native else ""),
            "ms": {k: round(v, 3) for k, v in med.items()},
            "margin": INTERACTION_MARGIN,
        }
    if ctx.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
    _put_gram(arches, shared[0]["gram_dtype"])
    if log and ctx.is_main:
        log(f"dot interaction {shared[0]['gram_dtype']}: {shared[0]['reason']}")
    return shared[0]


def choose_dense_weights(
    cfg: TrainConfig, ctx: DistContext, dmp: torch.nn.Module, log: Log | None
) -> tuple[JsonObject, DenseWeights | None]:
    """The weights a bf16 step computes with (`train.dense_weights`), its record, and the run's `DenseWeights`
    (None where the run has only its fp32 weights). `auto` starts on fp32 and leaves the choice to a trial over the
    run's own steps (`run_step_trials`): the two ways' gain depends on the widths, the batch and the class."""
    record: JsonObject = {"requested": cfg.dense_weights}
    if cfg.dense_weights == "fp32":
        return {**record, "dense_weights": "fp32", "reason": "--dense-weights fp32"}, None
    if (why := unsupported_weights(dmp, cfg, ctx.world_size)) is not None:
        return {**record, "dense_weights": "fp32", "reason": f"fp32 weights under autocast: {why}"}, None
    weights = DenseWeights(dmp, list(dense_params(dmp)))
    if cfg.dense_weights == "bf16":
        weights.use("bf16")
        record |= {"dense_weights": "bf16", "reason": "--dense-weights bf16"}
    else:
        record |= {"dense_weights": "fp32", "reason": "auto: fp32 until the run's own steps decide (trial)"}
    if log and ctx.is_main:
        log(f"dense weights {record['dense_weights']}: {record['reason']}")
    return record, weights


def run_step_trials(
    cfg: TrainConfig,
    ctx: DistContext,
    dmp: torch.nn.Module,
    start_step: int,
    table_update: JsonObject,
    interaction: JsonObject | None,
    dense_weights: tuple[JsonObject, DenseWeights | None] = ({}, None),
) -> list[StepTrial]:
    """The choices this run decides again on its own steps (`train.step_trial`): the table update and the dot
    interaction's Gram dtype, each first timed apart (one phase alone, before the run), are tried over a window of
    the run's real steps with every rank running them, one rank included: apart, the update's lookups with a zero
    gradient miss much of what the path costs in a real step (kaggle 100k rows, a thread a rank: fbgemm 0.86-1.18x
    the batched update apart at one rank, 4 of 5 kept by the margin; 1.12-1.29x in two ranks' real steps). Each
    record says which conditions it was timed under."""
    from dlrm_lab.model.interaction import DotInteractionArch
    from dlrm_lab.train.table_update import install

    conditions: JsonObject = {
        "ranks": ctx.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "launcher": ctx.launcher,
        "backend": ctx.backend,
        "pinned": cfg.pin_cores,
    }
    # each choice to try: its name, its record and that record's key in the manifest's config, its ways (the one to
    # prove first), and how to put one in place
    wanted: list[tuple[str, JsonObject, str, tuple[str, str], Callable[[str], None]]] = []
    if table_update.get("backward_ms") and table_update.get("requested") == "auto":
        wanted.append(
            ("table_update", table_update, "table_update_choice", ("batched", "fbgemm"), lambda way: install(dmp, way))
        )
    if interaction is not None and "ms" in interaction:
        arches = DotInteractionArch.within(dmp)
        # the way timed apart proved against torch's own; that one chosen apart: the next fastest proved against it
        timed_ms: dict[str, float] = interaction["ms"]  # type: ignore[assignment]
        base = "torch" if "torch" in timed_ms else "autocast"
        chosen = str(interaction["gram_dtype"])
        proved = chosen if chosen != base else min((w for w in timed_ms if w != base), key=lambda w: timed_ms[w])
        wanted.append(
            ("gram_dtype", interaction, "interaction_choice", (proved, base), lambda way: _put_gram(arches, way))
        )
    weights_record, weights = dense_weights
    if weights is not None and weights_record.get("requested") == "auto":
        wanted.append(("dense_weights", weights_record, "dense_weights_choice", WEIGHT_WAYS, weights.use))
    for record in (table_update, interaction):
        if record is not None:
            record["conditions"] = {**conditions, "timed": "apart: this rank's phase alone, before the run"}
    if not wanted:
        return []
    firsts = trial_window(start_step, cfg.steps, len(wanted))
    if firsts is None:
        for _, record, *_ in wanted:
            record["trial"] = (
                f"none: {cfg.steps - start_step} steps are too few for a trial over the run's own "
                "steps and as many measured after it; the choice timed apart stands"
            )
        return []

    def gather(mine: dict[str, float]) -> list[dict[str, float]]:
        if ctx.world_size == 1:
            return [mine]
        out: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(out, mine)
        return out

    return [
        StepTrial(name, key, ways, apply, first, gather, conditions)
        for (name, _, key, ways, apply), first in zip(wanted, firsts, strict=True)
    ]


class PagesChoice(TypedDict):
    """The CPU tables' pages (`--table-pages`), why, and what was put on them (the manifest's `table_pages_choice`)."""

    requested: str
    table_pages: str
    reason: str
    huge_bytes: int
    collapse_ms: float


def choose_table_pages(cfg: TrainConfig, ctx: DistContext, dmp: torch.nn.Module, log: Log | None) -> PagesChoice:
    """Put this rank's CPU tables (rows and row-wise optimizer state) on 2 MiB pages where asked, or, with
    "auto", where this machine's embedding gather measured at least PAGES_MARGIN faster on them. Rank 0 decides,
    every rank applies; collapsing is in place (`metrics.huge_pages`), so TorchRec's views stay valid."""
    from dlrm_lab.metrics.gather_pages import pages_faster
    from dlrm_lab.metrics.huge_pages import back_with_huge_pages, unsupported
    from dlrm_lab.train.table_update import fused_table_groups

    groups = [t for t in fused_table_groups(dmp) if getattr(t, "use_cpu", False)]
    shared: list[Any] = [None]
    if ctx.is_main:
        if cfg.table_pages == "base":
            shared[0] = ("base", "--table-pages base")
        elif ctx.device.type == "cuda":
            shared[0] = ("base", "the tables are in the GPU's memory")
        elif (why := unsupported()) is not None:
            shared[0] = ("base", f"{why}" + (" (--table-pages huge asked)" if cfg.table_pages == "huge" else ""))
        elif cfg.table_pages == "huge":
            shared[0] = ("huge", "--table-pages huge")
        else:
            faster, said = pages_faster(torch.get_num_threads())
            shared[0] = ("huge" if faster else "base", said)
    if ctx.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
    pages, reason = shared[0]
    choice = PagesChoice(requested=cfg.table_pages, table_pages=pages, reason=reason, huge_bytes=0, collapse_ms=0.0)
    if pages == "huge":
        tensors = [t for g in groups for t in (g.weights_host, getattr(g, "momentum1_host", None)) if t is not None]
        done = back_with_huge_pages(tensors)
        choice["huge_bytes"], choice["collapse_ms"] = done.huge_bytes, round(done.ms, 1)
        if not done.huge_bytes:  # asked, and nothing is on huge pages: the record says base, and why
            choice["table_pages"] = "base"
            choice["reason"] += f"; {done.error}"
        elif done.error:
            choice["reason"] += f"; {done.asked_bytes - done.huge_bytes:,} bytes stay on 4 KiB pages: {done.error}"
    if log and ctx.is_main:
        log(f"table pages {choice['table_pages']}: {choice['reason']}")
    return choice
