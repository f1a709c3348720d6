"""Serving builds, one file each behind one protocol: the inference forms an instance can serve.

A build turns the trained model into what an instance runs: `eager` (the module as it is), `fused`
(fbgemm's inference tables, weights in the served precision), `compiled` (`fused` with its dense part
compiled by Inductor in each instance), `aoti` (`fused` with its dense part an AOTInductor package made
once, cached on disk and loaded), `aoti_int8` (`aoti` with its dense part quantised to int8 by torchao's
PT2E). `infer.build` chooses between them by measurement; an instance asks
this registry for the build it serves and never names one.

A new build is a module in this package defining `BUILD` (found by `pkgutil`, as `torch._dynamo`'s
backends are: no list to edit, and this module imports none of them).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Protocol

from dlrm_lab.errors import FieldError

MARGIN = 1.05  # a build must be this much faster than the next simpler one to be chosen (beyond timing noise)


class BuildFailed(RuntimeError):
    """A build made here that does not serve: its artefact fails, or scores otherwise, at a batch size it must take
    (one line: which build, which size, what failed). `auto` skips it with this reason; asked for by name, the
    command says so and stops."""


class Build(Protocol):
    """How one serving build is made in the serving process and brought up in an instance."""

    name: str
    order: int  # simplest first: `auto` keeps a build only where it beats every simpler one by the margin
    base: str | None  # the build it is made from (sharing its tables), or None: made from the model itself
    about: str  # one line: what it is, for `--help` and the docs
    dense_precision: str | None  # the dense part's precision where the build fixes it (int8), else None: as served
    weight_precision: str | None  # what its dense weights are stored in where not the served precision (eager: fp32)

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        """The module served, from the float model (and `base`'s module, made first, where it has one)."""
        ...

    def skip(self, base_dense_ms: float | None, smallest: int | None = None) -> str | None:
        """Why `auto` does not try it here (the fused build's dense ms per largest batch given; `smallest`: the
        smallest batch size it is timed at, the median query), or None."""
        ...

    def for_snapshot(self, module: Any) -> Any:
        """The module as written to the instances' snapshot (what does not pickle left out)."""
        ...

    def in_instance(self, module: Any, device: Any, *, precision: str, table_precision: str) -> Any:
        """The module as an instance serves it, after it mapped the snapshot (on a GPU: built there)."""
        ...

    def artefact(self, module: Any) -> str | None:
        """The one file an instance loads to serve `module` in this build beside the tables it maps (a package), or
        None where the build is more than that: what lets an instance switch between builds (`infer.finalists`)."""
        ...

    def from_artefact(self, module: Any, artefact: str) -> Any:
        """In an instance: a sibling of `module` (the same tables, mapped) serving this build's `artefact`."""
        ...


@cache
def builds() -> dict[str, Build]:
    """Every build of this package by name, simplest first."""
    found: list[Build] = []
    for info in pkgutil.iter_modules(__path__):
        build = getattr(importlib.import_module(f"{__name__}.{info.name}"), "BUILD", None)
        if build is not None:
            found.append(build)
    return {b.name: b for b in sorted(found, key=lambda b: b.order)}


def simplest_fast(ms: Mapping[str, float], simplest_first: Sequence[str] | None = None) -> str:
    """Of the builds timed (build -> ms), the one served: the simplest, unless a later one is faster than the one
    kept so far by `MARGIN` (the serving process's choice and each instance's among its finalists; the instances'
    allocator, with its own `simplest_first` order)."""
    order = [b for b in (builds() if simplest_first is None else simplest_first) if b in ms]
    best = order[0]
    for b in order[1:]:
        if ms[b] * MARGIN <= ms[best]:
            best = b
    return best


def dense_weight_bytes(name: str, precision: str) -> float:
    """Bytes per dense weight a build reads each batch, for the roof: stored in `weight_precision`, else in the
    precision served (int8: 1); 4 for a build this registry does not know (a remote server's)."""
    from dlrm_lab.metrics.precision import DTYPES

    if name not in builds():
        return 4.0
    stored = builds()[name].weight_precision or precision
    return 1.0 if stored == "int8" else float(DTYPES[stored].itemsize) if stored in DTYPES else 4.0


def computes_in(build: str | None, precision: str) -> str:
    """The precision a build's GEMMs compute in: the one it fixes for its dense part (int8), else the served one (a
    build the registry does not know: the served one)."""
    known = builds().get(build or "")
    return (known.dense_precision if known is not None else None) or precision


def build_names() -> tuple[str, ...]:
    return tuple(builds())


def build_named(name: str) -> Build:
    try:
        return builds()[name]
    except KeyError:
        raise FieldError("build", f"{name!r}: allowed: auto, {', '.join(builds())}") from None
