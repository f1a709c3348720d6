"""`eager`: the trained module as it is, under autocast below fp32 (no conversion: the reference build).
Tables below fp32 are TorchRec's quantised inference tables (`quantize_embeddings`)."""

from __future__ import annotations

from typing import Any

from dlrm_lab.infer.tables import quantize_tables


class EagerBuild:
    name = "eager"
    order = 0
    base = None
    about = "the trained module as it is (autocast below fp32)"
    dense_precision = None
    weight_precision = "fp32"  # the trained weights; autocast casts them per call

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        return quantize_tables(model, table_precision) if table_precision != "fp32" else model

    def skip(self, base_dense_ms: float | None, smallest: int | None = None) -> str | None:
        return None

    def for_snapshot(self, module: Any) -> Any:
        return module

    def in_instance(self, module: Any, device: Any, *, precision: str, table_precision: str) -> Any:
        if device.type == "cuda" and table_precision != "fp32":  # the snapshot of a GPU server holds float tables
            return quantize_tables(module, table_precision)
        return module

    def artefact(self, module: Any) -> str | None:
        return None  # the module itself, tables and all

    def from_artefact(self, module: Any, artefact: str) -> Any:
        raise NotImplementedError(f"{self.name} is not served from one file")


BUILD = EagerBuild()
