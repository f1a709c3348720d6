"""Does fbgemm's CPU table backward use the cores it is given? (issue 37, "the table backward and update on
all cores").

    python benchmarks/tbe_threads.py [--preset kaggle] [--max-rows 1000000] [--batch-size 2048]

One fused table-batched embedding (fbgemm's `SplitTableBatchedEmbeddingBagsCodegen`, row-wise Adagrad, the
kernel TorchRec trains the lab's tables with) over the preset's tables, fed one synthetic batch; forward and
backward-with-update timed at 1 thread and at every core, interleaved, medians. A kernel that scales shows
backward time falling with threads. Beside it, the same update written as a few batched torch ops over all
tables at once (`torch_rowwise_adagrad`: one unique, one index_add, one update; a candidate route, not used by
the lab), checked against fbgemm's updated rows; results/results-tbe_threads-<date>.json.
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


def torch_rowwise_adagrad(
    weights: torch.Tensor, state: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor, lr: float, eps: float
) -> None:
    """Exact row-wise Adagrad over the rows `ids` (global row numbers, repeats allowed) with one gradient row per
    id, as fbgemm's EXACT_ROWWISE_ADAGRAD computes it: duplicates summed, state += mean(g^2) per row,
    row -= lr g / (sqrt(state) + eps). Written by hand to time what batched torch ops do on all cores."""
    rows, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(len(rows), grads.shape[1]).index_add_(0, inverse, grads)
    new_state = state.index_select(0, rows) + summed.pow(2).mean(1)
    state.index_copy_(0, rows, new_state)
    weights.index_add_(0, rows, summed * (-lr / (new_state.sqrt() + eps)).unsqueeze(1))


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
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        tables, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-8
    )
    batch = next(iter(SyntheticSource(synthetic_generator(spec, seed=0), opts.batch_size, 0, 1)))
    ids, offsets = batch.sparse_features.values(), batch.sparse_features.offsets()
    # the same update by batched torch ops: all tables' rows in one tensor, each id offset by its table's start
    lengths = batch.sparse_features.lengths().view(len(tables), opts.batch_size)
    starts = torch.tensor([0] + [t[0] for t in tables]).cumsum(0)
    global_ids = ids + torch.repeat_interleave(starts[:-1], lengths.sum(1))
    weights = torch.cat([w.detach().clone() for w in tbe.split_embedding_weights()])
    state = torch.zeros(len(weights))
    dim = tables[0][1]
    lr, eps = 0.05, 1e-8

    def torch_step() -> None:
        pooled_grad = torch.ones(opts.batch_size, len(tables) * dim)  # as the fbgemm backward below is given
        per_id = pooled_grad.view(opts.batch_size, len(tables), dim).transpose(0, 1).reshape(-1, dim)
        torch_rowwise_adagrad(weights, state, global_ids, per_id.repeat_interleave(lengths.flatten(), dim=0),
                              lr, eps)  # fmt: skip

    counts = sorted({1, os.cpu_count() or 1})
    # one step of each from the same rows: the updates agree (fbgemm's first step, then the torch one's)
    before = weights.clone()
    tbe(ids, offsets).backward(torch.ones(opts.batch_size, len(tables) * dim))
    torch_step()
    after = torch.cat([w.detach() for w in tbe.split_embedding_weights()])
    agree = float((after - weights).abs().max())
    moved = float((after - before).abs().max())
    times: dict[int, dict[str, list[float]]] = {
        n: {"forward_ms": [], "backward_update_ms": [], "torch_update_ms": []} for n in counts
    }
    for k in range(opts.repeats + 2):
        for n in counts if k % 2 == 0 else reversed(counts):  # interleaved
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            out = tbe(ids, offsets)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            torch_step()
            t3 = time.perf_counter()
            if k >= 2:  # the first two: warm-up
                times[n]["forward_ms"].append((t1 - t0) * 1e3)
                times[n]["backward_update_ms"].append((t2 - t1) * 1e3)
                times[n]["torch_update_ms"].append((t3 - t2) * 1e3)
    medians = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    for n, m in medians.items():
        print(
            f"{n} thread(s): fbgemm forward {m['forward_ms']:.2f} ms, backward and update "
            f"{m['backward_update_ms']:.2f} ms; batched torch update {m['torch_update_ms']:.2f} ms"
        )
    print(f"first step: rows moved up to {moved:.3g}, the two updates differ by at most {agree:.3g}")
    write_results(results_path("tbe_threads", opts.out),
                  header(preset=opts.preset, max_rows=opts.max_rows, batch_size=opts.batch_size, ids=ids.numel(),
                         tables=len(tables), medians=medians, first_step_max_move=moved,
                         first_step_max_difference=agree))  # fmt: skip


if __name__ == "__main__":
    main()
