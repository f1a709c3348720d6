"""`compiled`: the `fused` build with its dense part (bottom MLP, interaction, top MLP) compiled by Inductor
with freezing, so oneDNN prepacks the weights and the interaction is fused. Each instance compiles its own
(a compiled graph does not pickle): seconds at start, which `aoti` spends once instead."""

from __future__ import annotations

from typing import Any

from dlrm_lab.infer.builds.fused import BUILD as FUSED

# Below this much dense time per batch (measured under `fused`), compiling cannot repay the seconds it takes
# an instance to start: `auto` does not try the build.
COMPILE_MIN_DENSE_MS = 0.5


def too_small_to_compile(base_dense_ms: float | None, cost: str) -> str | None:
    """Why `auto` does not try a build that compiles the dense part (`cost`: what compiling costs), or None."""
    if base_dense_ms is None or base_dense_ms >= COMPILE_MIN_DENSE_MS:
        return None
    return (
        f"the dense part takes {base_dense_ms:.3f} ms of the largest batch: compiling cannot repay {cost} "
        f"(tried from {COMPILE_MIN_DENSE_MS} ms)"
    )


class CompiledBuild:
    name = "compiled"
    order = 2
    base = "fused"
    about = "fused, its dense part compiled by Inductor in each instance"
    dense_precision = None
    weight_precision = None

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        module = base.sibling()  # the same tables, not a copy
        module.compile_dense()
        return module

    def skip(self, base_dense_ms: float | None, smallest: int | None = None) -> str | None:
        return too_small_to_compile(base_dense_ms, "an instance's start")

    def for_snapshot(self, module: Any) -> Any:
        module.compiled = None  # each instance compiles its own
        return module

    def in_instance(self, module: Any, device: Any, *, precision: str, table_precision: str) -> Any:
        module = FUSED.in_instance(module, device, precision=precision, table_precision=table_precision)
        module.compile_dense()  # compiled by the instance's warm-up, before it says it is ready
        return module

    def artefact(self, module: Any) -> str | None:
        return None  # compiled in each instance, not loaded

    def from_artefact(self, module: Any, artefact: str) -> Any:
        raise NotImplementedError(f"{self.name} is not served from one file")


BUILD = CompiledBuild()
