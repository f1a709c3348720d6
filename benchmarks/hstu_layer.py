"""One DLRMv3 STU layer on this CPU: padded against jagged attention (issue 17's first block).

    python benchmarks/hstu_layer.py            # ~1 min on 2 cores

DLRMv3's layer shape (D 512, 4 heads of 128), a batch of requests whose histories are
uniform in [LO, HI] tokens with a fixed candidate count, forward in eval mode. Each path's
time is the median of repeats (paths interleaved); its FLOPs are what it computes (the
padded path every pair of the batch's longest sequence, the jagged one each request's
own), and the useful FLOPs are the valid pairs only (`STUShape.layer_flops(path="jagged")`):
useful GFLOP/s is reported beside the profile's fp32 GEMM peak at the same threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import header, results_path, write_results

from dlrm_lab.metrics.roofline import load_profile, peaks_for
from dlrm_lab.model.hstu import STULayer, STUShape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--history", default="256,1024", help="LO,HI history tokens per request")
    ap.add_argument("--candidates", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lo, hi = (int(v) for v in args.history.split(","))
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    shape = STUShape()
    histories = torch.randint(lo, hi + 1, (args.batch,))
    cands = torch.full((args.batch,), args.candidates)
    lengths = histories + cands
    n = int(lengths.max())
    x = torch.randn(args.batch, n, shape.dim)
    layers = {path: STULayer(shape, attention=path).eval() for path in ("padded", "jagged")}
    layers["jagged"].load_state_dict(layers["padded"].state_dict())
    useful = sum(shape.layer_flops(int(h), args.candidates) for h in histories)
    times: dict[str, list[float]] = {p: [] for p in layers}
    with torch.inference_mode():
        for layer in layers.values():
            layer(x, lengths, cands)  # warm-up
        for _ in range(args.repeats):
            for path, layer in layers.items():
                t = time.perf_counter()
                layer(x, lengths, cands)
                times[path].append(time.perf_counter() - t)
    peaks = peaks_for(load_profile(), "cpu", "fp32", threads)
    peak = None if isinstance(peaks, str) else peaks.flops_per_s
    results = header(
        threads=threads, batch=args.batch, histories=histories.tolist(), candidates=args.candidates,
        useful_gflop=useful / 1e9, gemm_peak_gflops=peak and peak / 1e9, paths={},
    )  # fmt: skip
    for path, ts in times.items():
        median = statistics.median(ts)
        results["paths"][path] = {"median_ms": median * 1e3, "useful_gflops": useful / median / 1e9,
                                  "of_peak": useful / median / peak if peak else None}  # fmt: skip
        of_peak = f" ({useful / median / peak:.2f} of the {peak / 1e9:.0f} GFLOP/s fp32 GEMM peak)" if peak else ""
        print(f"{path:>6}: {median * 1e3:8.1f} ms, useful {useful / median / 1e9:6.1f} GFLOP/s{of_peak}")
    write_results(results_path("hstu_layer", args.out), results)


if __name__ == "__main__":
    main()
