"""fbgemm's CUDA table-batched embedding (TBE) forward and backward with its fused row-wise Adagrad, in GB/s
against the GPU's copy bandwidth measured in the same run (issue 61: forward >= 0.6, backward >= 0.25 of it).

Tables far larger than L2 (4 x 10M rows x 128 by default: 20 GB in fp32) so no cache inflates the figure; the copy
is the machine probe's (`metrics.device_peaks.copy_bytes_per_s`); random ids, `--pooling` a bag. Bytes counted:
forward, every looked-up row read, the pooled output written and the ids read; backward, the pooled gradient row
read for every lookup, each unique row's weights read and written and its row-wise momentum read and written, and
the ids read. Backward = forward-and-backward less forward. Needs TorchRec's CUDA stack (`../shared/gpu-bundle`):

    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_tbe.py --out $OUT
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header, results_path, write_results  # noqa: E402

from dlrm_lab.metrics.device_peaks import copy_bytes_per_s  # noqa: E402


def _ms(fn: Any, repeats: int = 20, warmup: int = 5) -> float:
    """Mean milliseconds of `fn()` over `repeats` calls between two CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_tbe: no CUDA device is visible to this torch build")
    t, r, d, b, pool = opts.tables, opts.rows, opts.dim, opts.batch, opts.pooling
    dev = torch.device("cuda")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,power.limit,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True)  # fmt: skip
    results = header(gpu=torch.cuda.get_device_name(dev), nvidia_smi=smi.stdout.strip(), torch=torch.__version__)

    copy_gbs = copy_bytes_per_s(dev, 4 << 30, repeats=20) / 1e9  # the probe's copy, of 4 GiB: 70x an H200's L2
    torch.cuda.empty_cache()
    results["copy_GBps"] = copy_gbs
    print(f"copy: {copy_gbs:,.0f} GB/s (read + written)")

    g = torch.Generator(device=dev).manual_seed(0)
    lookups = t * b * pool
    ids = torch.randint(0, r, (lookups,), device=dev, generator=g)
    offsets = torch.arange(0, lookups + 1, pool, device=dev)
    unique = sum(int(torch.unique(ids[k * b * pool : (k + 1) * b * pool]).numel()) for k in range(t))
    results.update(tables=t, rows=r, dim=d, batch=b, pooling=pool, unique_rows=unique, precisions={})
    for name, precision, size in (("fp32", SparseType.FP32, 4), ("fp16", SparseType.FP16, 2)):
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(r, d, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * t,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.01,
            weights_precision=precision,
            output_dtype=SparseType.FP32,
        ).to(dev)
        grad = torch.randn(b, t * d, device=dev)
        with torch.no_grad():
            forward_ms = _ms(lambda tbe=tbe: tbe(ids, offsets))
        both_ms = _ms(lambda tbe=tbe, grad=grad: tbe(ids, offsets).backward(grad))
        backward_ms = both_ms - forward_ms
        forward_bytes = lookups * d * size + b * t * d * 4 + lookups * 8
        backward_bytes = lookups * d * 4 + unique * (2 * d * size + 8) + lookups * 8
        row = {
            "forward_ms": forward_ms,
            "forward_backward_ms": both_ms,
            "backward_ms": backward_ms,
            "forward_GBps": forward_bytes / forward_ms / 1e6,
            "backward_GBps": backward_bytes / backward_ms / 1e6,
        }
        row["forward_of_copy"] = row["forward_GBps"] / copy_gbs
        row["backward_of_copy"] = row["backward_GBps"] / copy_gbs
        results["precisions"][name] = row
        print(
            f"{name} tables: forward {forward_ms:.3f} ms {row['forward_GBps']:,.0f} GB/s "
            f"({row['forward_of_copy']:.2f} of copy), backward with row-wise Adagrad {backward_ms:.3f} ms "
            f"{row['backward_GBps']:,.0f} GB/s ({row['backward_of_copy']:.2f})"
        )
        del tbe, grad
        torch.cuda.empty_cache()
    write_results(results_path("gpu_tbe", opts.out), results)


if __name__ == "__main__":
    main()
