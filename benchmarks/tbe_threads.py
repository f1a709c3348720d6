"""Does fbgemm's CPU table backward use the cores it is given? (issue 37, "the table backward and update on
all cores").

    python benchmarks/tbe_threads.py [--preset kaggle] [--max-rows 1000000] [--batch-size 2048]

One fused table-batched embedding (fbgemm's `SplitTableBatchedEmbeddingBagsCodegen`, row-wise Adagrad, the
kernel TorchRec trains the lab's tables with) over the preset's tables, fed one synthetic batch; forward and
backward-with-update timed at 1 thread and at every core, interleaved, medians. A kernel that scales shows
backward time falling with threads; results/results-tbe_threads-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import header, results_path, write_results
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    OptimType,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from dlrm_lab.config import load_preset
from dlrm_lab.data import SyntheticSource, synthetic_generator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kaggle")
    ap.add_argument("--max-rows", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    spec = load_preset(opts.preset, max_rows=opts.max_rows)
    tables = [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in spec.tables]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(tables, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05)
    batch = next(iter(SyntheticSource(synthetic_generator(spec, seed=0), opts.batch_size, 0, 1)))
    ids, offsets = batch.sparse_features.values(), batch.sparse_features.offsets()
    counts = sorted({1, os.cpu_count() or 1})
    times: dict[int, dict[str, list[float]]] = {n: {"forward_ms": [], "backward_update_ms": []} for n in counts}
    for k in range(opts.repeats + 2):
        for n in counts if k % 2 == 0 else reversed(counts):  # interleaved
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            out = tbe(ids, offsets)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            if k >= 2:  # the first two: warm-up
                times[n]["forward_ms"].append((t1 - t0) * 1e3)
                times[n]["backward_update_ms"].append((t2 - t1) * 1e3)
    medians = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    for n, m in medians.items():
        print(f"{n} thread(s): forward {m['forward_ms']:.2f} ms, backward and update {m['backward_update_ms']:.2f} ms")
    write_results(results_path("tbe_threads", opts.out),
                  header(preset=opts.preset, max_rows=opts.max_rows, batch_size=opts.batch_size, ids=ids.numel(),
                         tables=len(tables), medians=medians))  # fmt: skip


if __name__ == "__main__":
    main()
