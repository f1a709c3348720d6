"""kaggle's 20 training GEMMs at batch 2048 (forward, the weights' and the inputs' gradients), each alone with its
operands already in the dtype (the best a step could do with torch's kernels: no casts), and the dot interaction's
batched products: the measured bound of a training step's dense part (issue 46, part 2).

    python benchmarks/dense_gemms.py [--preset kaggle] [--batch-size 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dlrm_lab.config import load_preset


def _median_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kaggle")
    ap.add_argument("--batch-size", type=int, default=2048)
    opts = ap.parse_args()
    spec = load_preset(opts.preset)
    b = opts.batch_size
    bottom = [spec.num_dense, *spec.bottom_mlp]
    top = [spec.over_arch_in_features, *spec.top_mlp]
    layers = list(zip(bottom, bottom[1:], strict=False)) + list(zip(top, top[1:], strict=False))
    print(f"{spec.name}: {len(layers)} layers at batch {b}, {torch.get_num_threads()} threads")
    for dtype in (torch.bfloat16, torch.float32):
        total_ms = total_flop = 0.0
        for i, (k, n) in enumerate(layers):
            x, w, dy = torch.randn(b, k, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.randn(b, n, dtype=dtype)
            forward = _median_ms(lambda x=x, w=w: x @ w)
            grad_w = _median_ms(lambda x=x, dy=dy: x.t() @ dy)
            grad_x = _median_ms(lambda dy=dy, w=w: dy @ w.t()) if i else 0.0  # the dense input needs no gradient
            total_ms += forward + grad_w + grad_x
            total_flop += 2 * b * k * n * (3 if i else 2)
            print(f"  {dtype}: {k:4d} x {n:4d}: forward {forward:.3f}, dW {grad_w:.3f}, dX {grad_x:.3f} ms")
        rows = torch.randn(b, spec.num_features + 1, spec.embedding_dim, dtype=dtype)
        gram = 3 * _median_ms(lambda rows=rows: torch.bmm(rows, rows.transpose(1, 2)))  # forward, two backward
        rate = total_flop / total_ms / 1e9
        print(f"{dtype}: {len(layers) * 3 - 1} GEMMs {total_ms:.2f} ms for {total_flop / 1e9:.2f} GFLOP "
              f"({rate:.3f} TFLOP/s); the interaction's 3 batched products {gram:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
