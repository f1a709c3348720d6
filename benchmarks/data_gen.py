"""Synthetic data throughput: generation in memory, Parquet write and read, loader stall.

    python benchmarks/data_gen.py            # kaggle and rm2, medians of 3 repeats
    python benchmarks/data_gen.py --quick
    python benchmarks/data_gen.py --only ranks   # one rank's data time per batch at 1, 2, 4, 8 ranks

Generation runs on one thread (numpy kernels), so samples/s here are per core. The
loader stall is the data-wait share of a training step at batch 2048 (kaggle, tables
capped at 1M rows), fed from Parquet and from the generator, with and without the
prefetch thread; it is measured by the training loop itself (`data_wait_share`), beside each
way's samples/s and the thread's over inline's per interleaved repeat: where batches and compute
share the cores, the thread lowers the wait and can slow the step.
The per-rank data time is what the synthetic source costs one rank of a weak-scaling job
(kaggle, tables capped at 100k rows, batch 2048 per rank, batches made and turned into
tensors, 64 batches): a rank generates only its share of each block, but draws every random
stream of the block, so it grows with the ranks (issue 18).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import header, write_results

import dlrm_lab
from dlrm_lab.config import TrainConfig
from dlrm_lab.data import ParquetSource, synthetic_generator
from dlrm_lab.data.parquet import write_dataset
from dlrm_lab.data.source import SyntheticSource
from dlrm_lab.train import preflight, train


def generation_rate(preset: str, samples: int, max_rows: int | None) -> float:
    gen = synthetic_generator(dlrm_lab.load_preset(preset, max_rows=max_rows), seed=0)
    gen.block(0)  # tables of the Zipf heads are built once per (rows, alpha): not timed
    t0 = time.perf_counter()
    blocks = max(1, samples // gen.block_size)
    for b in range(1, blocks + 1):
        gen.block(b)
    return blocks * gen.block_size / (time.perf_counter() - t0)


def parquet_rates(preset: str, samples: int, max_rows: int | None, tmp: Path) -> tuple[float, float, float]:
    model = dlrm_lab.load_preset(preset, max_rows=max_rows)
    gen = synthetic_generator(model, seed=0)
    gen.block(0)
    out = tmp / f"{preset}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    write_dataset(gen, samples, out)
    write = samples / (time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in out.glob("*.parquet"))
    t0 = time.perf_counter()
    n = sum(b.labels.numel() for b in ParquetSource(out, model, 2048, epochs=1))
    read = n / (time.perf_counter() - t0)
    return write, read, size / samples


def loader_share(data: str, prefetch: int, steps: int) -> dict[str, Any]:
    model = dlrm_lab.load_preset("kaggle", max_rows=1_000_000)
    cfg = TrainConfig(steps=steps, batch_size=2048, precision="bf16", data=data, prefetch=prefetch, eval_batches=1)
    s = train(preflight(model, cfg)).summary
    return {"data_wait_share": s["data_wait_share"], "samples_per_s": s["samples_per_s"]}


def rank_data_ms(world: int, batches: int = 64) -> float:
    """Rank 0's ms per batch of a `world`-rank job's synthetic source."""
    gen = synthetic_generator(dlrm_lab.load_preset("kaggle", max_rows=100_000), seed=0)
    gen.block(0)  # tables of the Zipf heads: not timed
    source = iter(SyntheticSource(gen, 2048, 0, world, offset=gen.block_size))
    t0 = time.perf_counter()
    for _ in range(batches):
        next(source)
    return (time.perf_counter() - t0) / batches * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1 << 19, help="samples per generation / Parquet measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="training steps per loader measurement")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--only", choices=["ranks"], help="only the per-rank data time at 1, 2, 4, 8 ranks")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.repeats, args.steps = 1 << 15, 1, 10
    results: dict[str, Any] = header()
    results["rank_data_ms_per_batch"] = {
        world: statistics.median(rank_data_ms(world) for _ in range(args.repeats)) for world in (1, 2, 4, 8)
    }
    print(json.dumps({"rank data ms per batch": results["rank_data_ms_per_batch"]}), flush=True)
    if args.only == "ranks":
        if args.json:
            write_results(Path(args.json), results)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for preset, max_rows, n in (("kaggle", None, args.samples), ("rm2", None, args.samples // 64)):
            gen = [generation_rate(preset, n, max_rows) for _ in range(args.repeats)]
            pq_runs = [parquet_rates(preset, n, max_rows, Path(tmp)) for _ in range(args.repeats)]
            results[preset] = {
                "samples": n,
                "generate_samples_per_s": statistics.median(gen),
                "parquet_write_samples_per_s": statistics.median(r[0] for r in pq_runs),
                "parquet_read_samples_per_s": statistics.median(r[1] for r in pq_runs),
                "parquet_bytes_per_sample": statistics.median(r[2] for r in pq_runs),
            }
            print(json.dumps({preset: results[preset]}), flush=True)
        model = dlrm_lab.load_preset("kaggle", max_rows=1_000_000)
        dataset = Path(tmp) / "kaggle-train"
        write_dataset(synthetic_generator(model, seed=0), 2048 * args.steps, dataset)
        # the share alone misleads where batches and compute share the cores: a thread lowers the wait and slows the
        # step (2 cores, 2 compute threads). Each source's two ways interleaved, each with its step's samples/s, and
        # the thread's samples/s over inline's per repeat (what `--prefetch auto` decides between)
        results["loader"], results["loader_samples_per_s"], results["loader_thread_over_inline"] = {}, {}, {}
        for name, data in (("parquet", str(dataset)), ("synthetic", "synthetic")):
            runs: dict[int, list[dict[str, Any]]] = {0: [], 2: []}
            for k in range(args.repeats):
                for p in (0, 2) if k % 2 == 0 else (2, 0):
                    runs[p].append(loader_share(data, p, args.steps))
            for p in (0, 2):
                results["loader"][f"{name} prefetch={p}"] = statistics.median(r["data_wait_share"] for r in runs[p])
                results["loader_samples_per_s"][f"{name} prefetch={p}"] = statistics.median(
                    r["samples_per_s"] for r in runs[p]
                )
            results["loader_thread_over_inline"][name] = statistics.median(
                b["samples_per_s"] / a["samples_per_s"] for a, b in zip(runs[0], runs[2], strict=True)
            )
        print(json.dumps({k: results[k] for k in ("loader", "loader_samples_per_s", "loader_thread_over_inline")}))
    if args.json:
        write_results(Path(args.json), results)


if __name__ == "__main__":
    main()
