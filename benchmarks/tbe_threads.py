"""Does the tables' backward-and-update use the cores it is given? fbgemm's CPU kernel against the lab's
batched update (`--table-update`, issue 37's "the table backward and update on all cores").

    python benchmarks/tbe_threads.py [--preset kaggle] [--max-rows 1000000] [--batch-size 2048]

One fused table-batched embedding (fbgemm's `SplitTableBatchedEmbeddingBagsCodegen`, row-wise Adagrad, the
module TorchRec trains the lab's tables with) over the preset's tables, fed one synthetic batch, and a twin
with the same rows on the lab's batched update (`dlrm_lab.train.table_update.BatchedTableUpdate`): forward
and backward-with-update of each timed at 1 thread and at every core, interleaved, medians; the two twins'
rows and row-wise state compared after every step; results/results-tbe_threads-<date>.json.
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
from dlrm_lab.train.table_update import install


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
    twins = {}
    for path in ("fbgemm", "batched"):
        torch.manual_seed(0)
        twins[path] = SplitTableBatchedEmbeddingBagsCodegen(
            tables, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-8
        )
        # fbgemm leaves its rows untouched: a forward over them would read the kernel's one zero page, not the tables
        with torch.no_grad():
            twins[path].weights_host.uniform_(-0.01, 0.01, generator=torch.Generator().manual_seed(0))
        install(torch.nn.ModuleList([twins[path]]), path)
    batch = next(iter(SyntheticSource(synthetic_generator(spec, seed=0), opts.batch_size, 0, 1)))
    ids, offsets = batch.sparse_features.values(), batch.sparse_features.offsets()
    grad = torch.randn(opts.batch_size, sum(t[1] for t in tables), generator=torch.Generator().manual_seed(1))
    counts = sorted({1, os.cpu_count() or 1})
    times: dict[int, dict[str, list[float]]] = {n: {} for n in counts}
    for k in range(opts.repeats + 2):
        for n in counts if k % 2 == 0 else reversed(counts):  # interleaved
            torch.set_num_threads(n)
            for path, tbe in twins.items() if k % 2 == 0 else reversed(twins.items()):
                t0 = time.perf_counter()
                out = tbe(ids, offsets)
                t1 = time.perf_counter()
                out.backward(grad)
                t2 = time.perf_counter()
                if k >= 2:  # the first two: warm-up
                    times[n].setdefault(f"{path}_forward_ms", []).append((t1 - t0) * 1e3)
                    times[n].setdefault(f"{path}_backward_update_ms", []).append((t2 - t1) * 1e3)
    rows = [t.weights_host for t in twins.values()]
    state = [t.momentum1_host for t in twins.values()]
    agree = float((rows[0] - rows[1]).abs().max())
    agree_state = float(((state[0] - state[1]).abs() / state[0].abs().clamp(min=1e-12)).max())
    medians = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    for n, m in medians.items():
        print(
            f"{n} thread(s): fbgemm forward {m['fbgemm_forward_ms']:.2f} ms, backward and update "
            f"{m['fbgemm_backward_update_ms']:.2f} ms; batched backward and update "
            f"{m['batched_backward_update_ms']:.2f} ms"
        )
    print(f"after {2 * (opts.repeats + 2)} steps on each: rows differ by at most {agree:.3g}, row-wise state by "
          f"{agree_state:.3g} relative")  # fmt: skip
    write_results(results_path("tbe_threads", opts.out),
                  header(preset=opts.preset, max_rows=opts.max_rows, batch_size=opts.batch_size, ids=ids.numel(),
                         tables=len(tables), medians=medians, max_row_difference=agree,
                         max_state_relative_difference=agree_state))  # fmt: skip


if __name__ == "__main__":
    main()
