"""The batched table update of a base revision against this tree's (issue 59), interleaved: ~20 s on 2 cores.

    python benchmarks/table_update_ab.py [--base HEAD~1] [--rounds 40] [--table-pages huge|base] [--base-kernels]

kaggle's 26 tables (capped at 1M rows, row-wise Adagrad, fbgemm's layout), batch 2048, one id a bag drawn with
Criteo's skew (a few thousand distinct rows a feature). The gradient reaching the tables is a column slice of the
interaction's, as in the model. The same module applies each side's `apply_update` in turn (the order alternates
by round; the first 4 rounds are warm-up). Prints each side's median ms an update and the median of the paired
ratios (base / tree). With `--base-kernels` the base side also calls the base's C++ update kernels
(`model/native/table_update.cpp` at `--base`, built here under the op namespace `dlrm_lab_base`): a change to the
kernels compared in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import header, results_path, write_results
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    OptimType,
    SplitTableBatchedEmbeddingBagsCodegen,
)

import dlrm_lab
import dlrm_lab.train.table_update as tree
from dlrm_lab.metrics.huge_pages import back_with_huge_pages

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = 4


def _at(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout  # fmt: skip


def base_kernels(rev: str) -> None:
    """The update kernels of `rev` built and registered as `torch.ops.dlrm_lab_base`."""
    from torch.utils import cpp_extension

    from dlrm_lab.model import native

    source = _at(rev, "dlrm_lab/model/native/table_update.cpp").replace("(dlrm_lab, ", "(dlrm_lab_base, ")
    path = Path(tempfile.mkdtemp()) / "table_update_base.cpp"
    path.write_text(source)
    cpp_extension.load(name=f"dlrm_lab_base_update_{rev[:12]}", sources=[str(path)], extra_cflags=native.build_flags(),
                       is_python_module=False, verbose=False)  # fmt: skip


def base_module(rev: str, kernels: bool = False):
    """`dlrm_lab/train/table_update.py` as it was at `rev`, imported under another name (calling the base's
    kernels with `kernels`)."""
    source = _at(rev, "dlrm_lab/train/table_update.py")
    if kernels:
        base_kernels(rev)
        source = source.replace("torch.ops.dlrm_lab.", "torch.ops.dlrm_lab_base.")
    path = Path(tempfile.mkdtemp()) / "table_update_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("table_update_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD~1")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--json", default=None)
    parser.add_argument("--table-pages", choices=("base", "huge"), default="huge",
                        help="the tables on 4 KiB or 2 MiB pages (a run's auto: huge where faster)")  # fmt: skip
    parser.add_argument("--base-kernels", action="store_true", help="the base side calls the base's C++ kernels too")
    args = parser.parse_args()
    base = base_module(args.base, args.base_kernels)
    spec = dlrm_lab.load_preset("kaggle", max_rows=1_000_000)
    rows = [t.num_embeddings for t in spec.tables]
    width = spec.tables[0].embedding_dim
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, width, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8, pooling_mode=PoolingMode.SUM,
    )  # fmt: skip
    with torch.no_grad():  # every page touched before timing: a run's pages are, after its first steps
        tbe.momentum1_host.fill_(0.0)
    if args.table_pages == "huge":
        print(back_with_huge_pages([tbe.weights_host, tbe.momentum1_host]))
    features, batch = len(rows), 2048
    generator = torch.Generator()
    wide = torch.randn(batch, (features + 1) * width)  # the interaction's gradient: the dense output first
    grad = wide[:, width:]
    sides = {"base": base.BatchedTableUpdate, "tree": tree.BatchedTableUpdate}
    times: dict[str, list[float]] = {name: [] for name in sides}
    distinct = []
    first_rows = torch.tensor(rows).cumsum(0) - torch.tensor(rows)  # each table's first row in one numbering
    for r in range(args.rounds + WARM_UP):
        generator.manual_seed(r)
        ids = torch.cat([(torch.rand(batch, generator=generator) ** 3 * n).long() for n in rows])
        offsets = torch.arange(features * batch + 1)
        distinct.append(len(torch.unique(ids + torch.repeat_interleave(first_rows, batch))))
        for name in sides if r % 2 else reversed(sides):
            tbe.__class__ = sides[name]
            start = time.perf_counter()
            tbe.apply_update(grad, ids, offsets, None)
            if r >= WARM_UP:
                times[name].append(time.perf_counter() - start)
    ratio = statistics.median(b / t for b, t in zip(times["base"], times["tree"], strict=True))
    results = {
        "header": header(threads=torch.get_num_threads(), base=args.base, rounds=args.rounds, pages=args.table_pages,
                         base_kernels=args.base_kernels),
        "ids": features * batch, "distinct_rows_median": statistics.median(distinct),
        "ms": {name: statistics.median(v) * 1e3 for name, v in times.items()}, "base_over_tree": ratio,
    }  # fmt: skip
    print(f"kaggle update, {features * batch} ids, ~{results['distinct_rows_median']:.0f} distinct rows, "
          f"{torch.get_num_threads()} threads: base {results['ms']['base']:.3f} ms, tree {results['ms']['tree']:.3f} "
          f"ms; base / tree {ratio:.3f} (median of {args.rounds} pairs)")  # fmt: skip
    print(write_results(args.json or results_path("table_update_ab"), results))


if __name__ == "__main__":
    main()
