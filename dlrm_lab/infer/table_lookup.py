"""How a whole-batch package looks its tables up: fbgemm's inference op (`int_nbit_split_embedding_codegen_lookup_
function`) or the lab's (`model.native`'s `pooled_lookup`: the same layout, inputs and outputs, every feature's bags in
one loop), chosen in the serving process by timing both on the model's own tables at the batches it will serve.

fbgemm's CPU op pays about a microsecond a feature a call whatever its bags (a JIT kernel looked up and run a
table), which is a fifth of a one-sample kaggle package; the lab's kernel pays it once. Chosen once per model and
table precision, before its packages are made: the packages' cache key says which op a package calls. The eager
builds (`fused`, `compiled`) keep fbgemm's module.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.infer.batches import QueryRef, gather_batch, kernel_batch, next_samples
from dlrm_lab.metrics.interleaved import medians_by_size
from dlrm_lab.model import native

FBGEMM, NATIVE = "fbgemm", "native"
LOOKUPS = (FBGEMM, NATIVE)
MARGIN = 1.05  # the lab's op serves where fbgemm's takes at least this much longer over the served batches
REPEATS = 5  # timings of each op at each size, interleaved, after one warm-up round
CALLS_PER_SIZE = 2048  # samples a timing covers (at least one call)
DISTINCT_BATCHES = 16  # batches a timing cycles through: rows as cold as serving's, not one batch's cached
# the TBE's layout (which table is where, in which type): small, constant, frozen into the package
LAYOUT_BUFFERS = ("weights_placements", "weights_offsets", "weights_tys", "D_offsets")
LAYOUT_INTS = (
    "total_D",
    "max_int2_D",
    "max_int4_D",
    "max_int8_D",
    "max_float16_D",
    "max_float32_D",
    "output_dtype",
    "row_alignment",
    "max_float8_D",
    "fp8_exponent_bits",
    "fp8_exponent_bias",
)


class PooledLookup(nn.Module):
    """An inference TBE's layout held as buffers, and the pooled lookup of a batch over its bytes: `forward(weights
    uint8, ids int32, offsets int32 [F * B + 1]) -> [B, total_D]` in the TBE's output type, by `way`.

    The op is called directly, not through the TBE module: the module carries fbgemm's `AtomicCounter` and
    `TensorQueue` script objects, which export only with torchrec's fake classes and AOTInductor then has to carry;
    the op alone needs neither. The weights are an input, so instances share the tensor they mapped."""

    def __init__(self, tables: Any, way: str = FBGEMM) -> None:
        super().__init__()
        if way not in LOOKUPS:
            raise ValueError(f"table lookup {way!r}: allowed: {', '.join(LOOKUPS)}")
        self.way = way
        for name in LAYOUT_BUFFERS:
            self.register_buffer(name, getattr(tables, name).clone())
        self.layout = {name: getattr(tables, name) for name in LAYOUT_INTS}
        self.pooling_mode = int(tables.pooling_mode)

    def forward(self, weights: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.way == NATIVE:
            return torch.ops.dlrm_lab.pooled_lookup(
                weights,
                self.weights_offsets,
                self.weights_tys,
                self.D_offsets,
                ids,
                offsets,
                self.layout["total_D"],
                self.pooling_mode,
                self.layout["row_alignment"],
                self.layout["output_dtype"],
            )
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=weights,
            uvm_weights=weights.new_empty(0),
            weights_placements=self.weights_placements,
            weights_offsets=self.weights_offsets,
            weights_tys=self.weights_tys,
            D_offsets=self.D_offsets,
            indices=ids,
            offsets=offsets,
            pooling_mode=self.pooling_mode,
            indice_weights=None,
            lxu_cache_weights=None,
            lxu_cache_locations=None,
            **self.layout,
        )


def table_weights(tables: Any) -> torch.Tensor:
    """The bytes of every table of a fused lookup (fbgemm's inference TBE on the host): what a package takes as an
    input, the tensor the instances share."""
    return tables.weights_host if tables.host_size > 0 else tables.weights_dev


def _batches(library: Any, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, offsets) of DISTINCT_BATCHES batches of `size` of the library's samples, one after another: the bags and
    rows the model will serve (a multi-hot model's long bags favour another kernel than Criteo's one id a bag)."""
    starts = next_samples([size] * DISTINCT_BATCHES, library.size)
    return [kernel_batch(*gather_batch(library, [QueryRef(-1, size, at)]))[1:] for at in starts]


def _timer(ways: dict[str, PooledLookup], weights: torch.Tensor, library: Any, size: int) -> Any:
    """ms a call of a way over `size`-sample batches of the library, taken in turn."""
    batches = _batches(library, size)
    calls = max(1, CALLS_PER_SIZE // size)

    def timed(way: str) -> float:
        start = time.perf_counter()
        for c in range(calls):
            ways[way](weights, *batches[c % len(batches)])
        return (time.perf_counter() - start) * 1e3 / calls

    return timed


def choose_lookup(module: Any, library: Any, *, sizes: list[int], threads: int, log: Log | None = None) -> JsonObject:
    """Time both lookups on `module`'s own tables (a FusedDLRM) over batches of `library`'s samples at each of
    `sizes` on `threads` threads and set the faster as its packages' (`module.lookup_way`; the lab's only where
    fbgemm's takes MARGIN longer, summed over the sizes); its record."""
    record: JsonObject = {"lookup": FBGEMM, "margin": MARGIN}
    if (why := native.load()) is not None:
        record["reason"] = why
    else:
        weights = table_weights(module.tables)
        ways = {way: PooledLookup(module.tables, way) for way in LOOKUPS}
        with torch.inference_mode():
            med = medians_by_size(
                LOOKUPS, lambda size: _timer(ways, weights, library, size), sizes, REPEATS, threads=threads
            )
        total = {way: sum(by.values()) for way, by in med.items()}
        way = NATIVE if total[FBGEMM] >= MARGIN * total[NATIVE] else FBGEMM
        at = ", ".join(f"{n}: {med[NATIVE][n]:.4f} against {med[FBGEMM][n]:.4f} ms" for n in sizes)
        record.update(
            lookup=way,
            reason=f"the lab's lookup against fbgemm's, {module.table_precision} tables, {threads} thread(s), by "
            f"batch ({at}; medians of {REPEATS} interleaved): "
            + ("the lab's serves" if way == NATIVE else f"the lab's is not {MARGIN:.2f}x faster: fbgemm's serves"),
            ms={w: {str(n): round(v, 4) for n, v in by.items()} for w, by in med.items()},
        )
    module.lookup_way = record["lookup"]
    if log is not None:
        log(f"table lookup {record['lookup']}: {record['reason']}")
    return record
