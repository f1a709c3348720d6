"""The serving plan: every choice of how a model is served, made before a server starts.

A system under test executes a plan; it does not choose policy. `plan_serving(models)` resolves what
was left `auto` by measurement on this machine and checks it, in this order per model:

- precision (`metrics.precision.choose_precision`: a lower precision only where its GEMMs are faster);
- the HSTU ranker's attention path (`model.hstu.choose_attention`, timed over the first requests);
- the inference build (`infer.build.choose_build`: timed at the batches it will serve, checked for
  accuracy on held-out samples; an `auto` precision that fails the accuracy rule in every build falls
  back to fp32);
- the C allocator its instances run (`infer.allocator.choose`: each installed one timed on the model's dense
  layers in trial processes, once per machine and shape);
- the snapshot's pages (`Planner.choose_table_pages`: 2 MiB where the machine's gather measured faster on them).

The plan holds each model as it will be served (no `auto` left), the module its instances serve, its
sample library, and the record of every choice (the manifest's `precision_choices`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from dlrm_lab.config.family import family_of
from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.distributed.context import resolve_device
from dlrm_lab.errors import UserError
from dlrm_lab.infer import allocator
from dlrm_lab.infer.instance import PRECISIONS
from dlrm_lab.infer.interaction import choose_interaction
from dlrm_lab.infer.memory import check_fits, library_samples
from dlrm_lab.infer.requests import generate_library
from dlrm_lab.infer.served import ServedModel, check_cores
from dlrm_lab.infer.serving_parts import serving_of
from dlrm_lab.metrics.cpu import usable_cores
from dlrm_lab.metrics.gather_pages import auto_pages
from dlrm_lab.metrics.precision import AUTO, choose_precision

if TYPE_CHECKING:
    from dlrm_lab.infer.library import LoadedSamples


@dataclass
class ServingPlan:
    """What a server serves, every choice made (module docstring)."""

    models: dict[str, ServedModel]  # as served: no `auto` left
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)  # the build each model's instances serve
    # each model's sample library (`generate_library`: of its family's kind)
    libraries: dict[str, LoadedSamples] = field(default_factory=dict)
    precision_choices: dict[str, JsonObject] = field(default_factory=dict)  # per model: what and why (manifest)
    device: str = "cpu"
    seed: int = 0


def plan_serving(
    models: list[ServedModel], *, device: str = "cpu", seed: int = 0, log: Log | None = None
) -> ServingPlan:
    """Resolve and check how `models` are served on this machine (module docstring); refuses, before any table is
    allocated, models that do not fit or whose instances oversubscribe the cores (one line each)."""
    resolve_device(device)  # one-line error for an unknown device or a missing GPU
    names = [m.name for m in models]
    if not models or len(set(names)) != len(names):
        raise UserError(f"served models need distinct names, got {names}")
    planner = Planner(models, device=device, seed=seed, log=log)
    usable = len(usable_cores() or range(os.cpu_count() or 1))
    if warning := check_cores(list(planner.models.values()), usable, device):
        planner.log(warning)
    check_fits(planner.models.values(), device=device)
    planner.choose_precisions()
    for name in list(planner.models):
        m = planner.models[name]
        # the one sample library of this model: generated here, snapshotted and mapped by the server's instances
        library = generate_library(m, seed, library_samples(m.max_batch, m.library_samples))
        module = planner.build_model(m)
        m = planner.models[name]  # with its attention path resolved (the HSTU ranker)
        planner.plan.modules[name] = planner.serving_build(m, module, library)
        planner.plan.libraries[name] = library
        planner.choose_allocator(planner.models[name])
        planner.choose_table_pages(planner.models[name])
    return planner.plan


class Planner:
    """The choices of `plan_serving`, one model at a time, recorded in `plan` as they are made."""

    def __init__(self, models: list[ServedModel], *, device: str, seed: int, log: Log | None = None) -> None:
        self.plan = ServingPlan({m.name: m for m in models}, device=device, seed=seed)
        self.models, self.precision_choices = self.plan.models, self.plan.precision_choices
        self.device, self.seed, self.log = device, seed, log or (lambda _msg: None)

    def choose_precisions(self) -> None:
        """Resolve `auto` by measurement at each model's instance threads and batch size;
        warn about an explicit precision that measures slower than fp32."""
        for name, m in list(self.models.items()):
            choice = choose_precision(
                m.precision,
                m.spec,
                allowed=PRECISIONS,
                device=self.device,
                threads=m.threads,
                rows=m.max_batch,
                log=self.log,
            )
            self.log(choice.line if choice.warning else f"{name}: {choice.line}")
            self.precision_choices[name] = choice.to_dict()
            self.models[name] = replace(m, precision=choice.precision)

    def choose_allocator(self, m: ServedModel) -> None:
        """The C allocator `m`'s instances run (`infer.allocator`): auto timed at one row and at its max batch of
        its dense layers, in the precision and threads it is served at."""
        only_glibc = None
        if self.device != "cpu":
            only_glibc = f"served on {self.device}: the trial times host layers"
        elif m.batch_memory == "keep" or m.idle_hold == "keep-memory":
            only_glibc = "keeping a batch's memory is told to glibc's malloc (mallopt)"
        shapes = family_of(m.spec).gemm_shapes(m.spec, m.max_batch, m.max_batch)
        choice = allocator.choose(
            m.allocator,
            [(k, n) for _, k, n in shapes],
            m.precision,
            m.threads,
            sorted({1, m.max_batch}),
            only_glibc=only_glibc,
            log=self.log,
        )
        if m.allocator == AUTO:
            self.log(f"{m.name}: allocator {choice.reason}")
        self.precision_choices[m.name]["allocator_choice"] = choice.to_dict()
        self.models[m.name] = replace(m, allocator=choice.allocator)

    def choose_table_pages(self, m: ServedModel) -> None:
        """The pages of `m`'s snapshot, where its instances map the tables: auto takes 2 MiB pages where Linux has
        transparent huge pages and this machine's profile measured an embedding gather at least
        `metrics.gather_pages.PAGES_MARGIN` faster on them (never measured here: a server's start stays short); the
        server then mounts them (`infer.snapshot.write_snapshot`), and serves on base pages, saying why, where it
        may not."""
        if m.table_pages != AUTO:
            pages, reason = m.table_pages, f"--table-pages {m.table_pages}"
        elif self.device != "cpu":
            pages, reason = "base", f"served on {self.device}: the instances build their tables there"
        else:
            pages, reason = auto_pages(m.threads, measure=False)
        if m.table_pages == AUTO:
            self.log(f"{m.name}: table pages {pages}: {reason}")
        self.precision_choices[m.name]["table_pages_choice"] = {
            "requested": m.table_pages,
            "table_pages": pages,
            "reason": reason,
        }
        self.models[m.name] = replace(m, table_pages=pages)

    def build_model(self, m: ServedModel) -> torch.nn.Module:
        """The served model with the server's seed, as its family builds it (the HSTU ranker with its attention
        path: `auto` times both over the first requests the model will serve, forward only)."""
        model, attention, chosen = serving_of(m.spec).serving_model(m, self.seed, self.log)
        if attention is not None:
            self.models[m.name] = replace(m, attention=attention)
        if chosen is not None:
            self.precision_choices[m.name]["attention_choice"] = chosen
        return model

    def serving_build(self, m: ServedModel, model: torch.nn.Module, library: Any) -> torch.nn.Module:
        """The inference form of the model its instances serve (`infer.build`), chosen and checked here,
        once; recorded with the precision choice."""
        held_out = serving_of(m.spec).held_out(m, library, self.seed)
        if not m.checkpoint:
            self.log(
                f"{m.name}: no --checkpoint: serving an untrained model, its builds' accuracy judged on labels "
                "drawn from its own ranking"
            )
        interaction = choose_interaction(
            model, precision=m.precision, sizes=m.batches_to_time(), threads=m.threads, device=self.device, log=self.log
        )
        if interaction is not None:
            self.precision_choices[m.name]["interaction_choice"] = interaction
        choice, model, m = self._checked_build(m, model, library, held_out)
        if choice.accuracy is not None and not choice.accuracy.passed:
            self.log(
                f"warning: {m.name}: build {choice.build} failed its accuracy check "
                f"({choice.accuracy.rule}); served as asked"
            )
        self.log(choice.line if choice.warning else f"{m.name}: {choice.line}")
        self.precision_choices[m.name]["build_choice"] = choice.to_dict()
        self.models[m.name] = replace(m, build=choice.build, finalists=tuple(choice.finalists.items()))
        return model

    def _checked_build(
        self, m: ServedModel, source: torch.nn.Module, library: Any, held_out: Any
    ) -> tuple[Any, torch.nn.Module, ServedModel]:
        """`choose_build` at the model's precision; a reduced precision that `--precision auto` chose for its
        speed but that fails the accuracy rule in every build falls back to fp32 (said, and recorded with the
        precision choice). The choice, the module to serve and the model as served."""
        from dlrm_lab.infer.build import choose_build

        def choose(precision: str) -> tuple[Any, torch.nn.Module]:
            return choose_build(
                m.build,
                source,
                precision=precision,
                table_precision=m.table_precision,
                threads=m.threads,
                sizes=m.batches_to_time(),
                library=library,
                check_block=held_out,
                device=self.device,
                log=self.log,
                labels="data" if m.checkpoint else "teacher",
            )

        choice, model = choose(m.precision)
        record = self.precision_choices[m.name]
        check = choice.accuracy
        if check is None or check.passed or m.precision == "fp32" or record.get("requested") != "auto":
            return choice, model, m
        where = "in every build" if m.build == "auto" else f"with --build {m.build}"
        self.log(
            f"{m.name}: precision {m.precision} fails the accuracy rule {where} ({check.rule}: AUC "
            f"{check.auc:.5f} vs fp32 {check.auc_fp32:.5f}); served in fp32"
        )
        record.update(
            precision="fp32",
            accuracy_fallback=check.to_dict(),
            reason=f"{record['reason']}; then fp32: {m.precision} failed the accuracy rule",
        )
        m = replace(m, precision="fp32")
        self.models[m.name] = m
        del model
        choice, model = choose("fp32")
        return choice, model, m
