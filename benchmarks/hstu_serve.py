"""HSTU ranker serving (issue 17, parts 4-5): Offline throughput, the best Server rate under p99 80 ms
and the gain from history reuse at a request shape that fits a small machine; what reuse costs in
AUC on a trained ranker.

    python benchmarks/hstu_serve.py            # ~25 min on 2 cores

Cases:
- reuse accuracy: hstu-tiny (max_history 256, so that the served histories are not cut) trained
  through the lab's loop, its evaluation-window requests scored in time order with and without
  history reuse (`infer.history.reuse_accuracy`): hit rate, AUC of both, largest score difference;
- dlrmv3's layers (5 STU layers, D 512, 4 heads of 128) with short requests (SHAPE: ~50 history
  items, 32 candidates, 100 users, 70 of them active at each timestamp: a user's next request comes
  ~70 requests later; the library is the window's 280 requests), tables at --max-rows 1e5:
  - one request at a time (open loop at 3 queries/s, 1 instance x 2 threads) in time order, history
    reuse off and on (and, with reuse, the requests that hit against those that missed);
  - LoadGen Offline throughput, 2 instances x 1 thread, reuse off and on;
  - `infer search` under p99 <= 80 ms (open loop, requests in time order), reuse off and on.
Every serving case is a real `dlrm-lab infer` command; results: results-hstu_serve-<date>.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from common import child_failed, header, results_path, write_results

from dlrm_lab.config import TrainConfig, load_any_preset
from dlrm_lab.data.sequences import with_overrides
from dlrm_lab.infer.history import reuse_accuracy
from dlrm_lab.infer.requests import RequestLibrary
from dlrm_lab.model.hstu import build_ranker
from dlrm_lab.train import preflight, train

SHAPE = ["users=100", "timestamps=20", "train_timestamps=16", "warmup_timestamps=2", "interactions_mean=4",
         "interactions_sd=1", "candidates=32", "max_history=256"]  # fmt: skip
MODEL = ["--model", "dlrmv3", "--max-rows", "100000", *[a for s in SHAPE for a in ("--set", s)]]
CACHE_MB = "1000"  # per instance: every user's history (5 layers x 4 heads x ~55 tokens x 256 fp32 ~ 1.1 MB each)
KEEP = ("queries_per_s", "samples_per_s", "latency_p50_ms", "latency_p99_ms", "latency_floor_ms",
        "latency_floor_ratio", "compute_mean_ms", "history_hit_rate", "history_tokens_reused_mean",
        "roofline_fraction", "flops_per_sample", "loadgen_result", "loadgen_queries_per_s", "attention")  # fmt: skip


def plain_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A one-rank DistributedModelParallel model's state with its sharded tables made whole."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "local_shards"):  # a ShardedTensor: on one rank every shard is local
            whole = torch.zeros(v.size())
            for shard in v.local_shards():
                rows, cols = shard.metadata.shard_offsets
                n, m = shard.tensor.shape
                whole[rows : rows + n, cols : cols + m] = shard.tensor
            v = whole
        out[k] = v
    return out


def reuse_accuracy_case() -> dict[str, Any]:
    spec = with_overrides(load_any_preset("hstu-tiny"), ["max_history=256"])
    result = train(
        preflight(spec, TrainConfig(steps=400, batch_size=32, eval_every=400, eval_batches=16)), keep_model=True
    )
    ranker = build_ranker(spec).eval()
    ranker.load_state_dict(plain_state(result.model))
    library = RequestLibrary.generate(spec, 0, 100_000)
    got = reuse_accuracy(ranker, library, batch=64)
    got.update(preset="hstu-tiny", set=["max_history=256"], train_steps=400, train_eval_auc=result.summary["eval_auc"],
               teacher_auc=result.summary["teacher_auc"])  # fmt: skip
    print(f"reuse accuracy: hit rate {got['hit_rate']:.3f}, AUC {got['auc_full']:.4f} full vs {got['auc_reused']:.4f} "
          f"reused, max |score difference| {got['max_score_difference']:.2e}", flush=True)  # fmt: skip
    return got


def dlrm_lab(args: list[str], root: str, allowed: tuple[int, ...] = (0,)) -> tuple[Path, float, str]:
    """Run `dlrm-lab ARGS` into `root`: (its one run directory, seconds, what it printed)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dlrm_lab", *args, "--metrics-dir", root, "--no-progress"],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode not in allowed:
        raise child_failed(f"dlrm-lab {' '.join(args)}", done)
    (run,) = Path(root).glob("infer-*")
    return run, time.perf_counter() - t0, done.stdout


def infer_case(name: str, extra: list[str]) -> dict[str, Any]:
    args = ["infer", "run", *MODEL, "--order", "time", "--sla-ms", "80", *extra]
    with tempfile.TemporaryDirectory() as root:
        run, wall, _ = dlrm_lab(args, root, allowed=(0, 1))  # 1: a LoadGen verdict INVALID, recorded
        (row,) = pq.read_table(run / "summary.parquet").to_pylist()
        queries = pq.read_table(run / "queries.parquet").to_pandas()
    out = {"name": name, "command": "dlrm-lab " + " ".join(args), "wall_s": wall, **{k: row.get(k) for k in KEEP}}
    ok = queries[(queries.status == "ok") & (queries.samples == 1)]
    if ok["history_reused"].notna().any():  # one-request queries that reused a history against those that did not
        for label, part in (("hit", ok[ok.history_reused > 0]), ("miss", ok[ok.history_reused == 0])):
            out[f"{label}_queries"] = len(part)
            out[f"{label}_compute_p50_ms"] = float(part.compute_ms.median()) if len(part) else None
            out[f"{label}_latency_p50_ms"] = float(part.latency_ms.median()) if len(part) else None
    print(f"{name}: {out['queries_per_s']:.1f} requests/s, p50 {out['latency_p50_ms']:.1f} ms, p99 "
          f"{out['latency_p99_ms']:.1f} ms (floor {out['latency_floor_ms']:.1f} ms), hit rate "
          f"{out['history_hit_rate']}, LoadGen {out['loadgen_result']}", flush=True)  # fmt: skip
    return out


def search_case(name: str, extra: list[str]) -> dict[str, Any]:
    args = ["infer", "search", *MODEL, "--order", "time", "--sla-ms", "80", "--layouts", "1x2,2x1",
            "--max-batch", "1,4", "--max-delay-ms", "2", "--repeats", "2", "--steps", "5", "--min-queries", "200",
            "--max-probe-duration", "10", *extra]  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        run, wall, printed = dlrm_lab(args, root)
        rows = pq.read_table(run / "frontier.parquet").to_pylist()
    keep = ("instances", "threads_per_instance", "max_batch", "capacity_queries_per_s", "best_qps",
            "best_sla_latency_ms", "best_history_hit_rate", "best", "outcome")  # fmt: skip
    out = {"name": name, "command": "dlrm-lab " + " ".join(args), "wall_s": wall,
           "frontier": [{k: r.get(k) for k in keep} for r in rows]}  # fmt: skip
    print(printed[-2500:], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="accuracy,infer,search", help="which of accuracy, infer, search to run")
    opts = ap.parse_args()
    parts = set(opts.parts.split(","))
    results: dict[str, Any] = header(shape=SHAPE, cases=[])
    if "accuracy" in parts:
        results["reuse_accuracy"] = reuse_accuracy_case()
    if "infer" in parts:
        infer_cases(results["cases"])
    if "search" in parts:
        results["search_reuse_off"] = search_case("search p99 <= 80 ms, reuse off", [])
        results["search_reuse_on"] = search_case("search p99 <= 80 ms, reuse on", ["--history-cache-mb", CACHE_MB])
    write_results(results_path("hstu_serve", opts.out), results)


def infer_cases(cases: list[dict[str, Any]]) -> None:
    one = ["--qps", "3", "--duration", "60", "--instances", "1", "--threads", "2", "--max-batch", "1"]
    cases.append(infer_case("one request at a time, 1x2, reuse off", one))
    cases.append(infer_case("one request at a time, 1x2, reuse on", [*one, "--history-cache-mb", CACHE_MB]))
    offline = ["--scenario", "offline", "--qps", "100", "--duration", "20", "--instances", "2", "--threads", "1",
               "--max-batch", "8"]  # fmt: skip
    cases.append(infer_case("offline, 2x1, reuse off", offline))
    cases.append(infer_case("offline, 2x1, reuse on", [*offline, "--history-cache-mb", CACHE_MB]))


if __name__ == "__main__":
    main()
