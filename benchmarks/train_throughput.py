"""Training throughput: dlrm-lab against a plain-PyTorch DLRM written as facebookresearch/dlrm does.

The baseline is that repository's structure: one `nn.EmbeddingBag(mode="sum", sparse=True)`
per table, an MLP of `nn.Linear` + ReLU, the dot interaction by `bmm` over the upper
triangle, and one `torch.optim.SGD` over everything (sparse row updates for the tables).
dlrm-lab runs its real training loop (`dlrm_lab.train.train`: TorchRec sharding, fbgemm
fused row-wise Adagrad, DDP dense part). Both consume the same pre-generated batches, so
data generation is not measured; repeats are interleaved and the median is reported,
with throughput ratios taken within one run.

    python benchmarks/train_throughput.py                 # kaggle, tables capped at 1M rows
    python benchmarks/train_throughput.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch
from common import header, write_results
from torch import nn
from torchmetrics.functional.classification import binary_auroc

import dlrm_lab
from dlrm_lab.config import PRECISIONS, ModelSpec, TrainConfig
from dlrm_lab.data import HELD_OUT_OFFSET, SyntheticSource, synthetic_generator
from dlrm_lab.metrics.precision import choose_precision, contenders
from dlrm_lab.model.cost import sample_cost
from dlrm_lab.train import preflight, train


class PlainDLRM(nn.Module):
    """facebookresearch/dlrm's model shape, with its per-table sparse EmbeddingBags."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.emb = nn.ModuleList(
            nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum", sparse=True) for t in spec.tables
        )
        for bag, t in zip(self.emb, spec.tables, strict=True):
            nn.init.uniform_(bag.weight, -((1 / t.num_embeddings) ** 0.5), (1 / t.num_embeddings) ** 0.5)
        self.bot = self._mlp(spec.num_dense, spec.bottom_mlp, last_relu=True)
        self.top = self._mlp(spec.over_arch_in_features, spec.top_mlp, last_relu=False)
        f = spec.num_features + 1
        self.register_buffer("li", torch.tensor([i for i in range(f) for j in range(i)]), persistent=False)
        self.register_buffer("lj", torch.tensor([j for i in range(f) for j in range(i)]), persistent=False)
        self.features = spec.feature_names

    @staticmethod
    def _mlp(n_in: int, sizes: tuple[int, ...], last_relu: bool) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i, n_out in enumerate(sizes):
            layers.append(nn.Linear(n_in, n_out))
            if last_relu or i < len(sizes) - 1:
                layers.append(nn.ReLU())
            n_in = n_out
        return nn.Sequential(*layers)

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        x = self.bot(dense)
        ly = []
        for bag, name in zip(self.emb, self.features, strict=True):
            jt = sparse[name]
            ly.append(bag(jt.values(), jt.offsets()[:-1]))
        t = torch.cat([x] + ly, dim=1).view(x.shape[0], -1, x.shape[1])
        z = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]
        return self.top(torch.cat([x, z], dim=1)).squeeze(-1)


def autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")


def run_plain(spec: ModelSpec, batches: list, steps: int, warmup: int, precision: str, lr: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = PlainDLRM(spec)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    times = []
    for step in range(warmup + steps):
        b = batches[step % len(batches)]
        t0 = time.perf_counter()
        with autocast(precision):
            logits = model(b.dense_features, b.sparse_features)
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    n = batches[0].labels.numel()
    return {"samples_per_s": n * len(times) / sum(times), "model": model}


def batches(spec: ModelSpec, batch_size: int, count: int, seed: int = 0, offset: int = 0) -> list:
    """`count` batches of the preset's synthetic data, generated before any timing."""
    source = SyntheticSource(synthetic_generator(spec, seed=seed), batch_size, offset=offset, num_batches=count)
    return list(source)


class CycleSource:
    """Pre-generated batches, cycled: the loop measures the model, not the generator."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        i = 0
        while True:
            yield self.batches[i % len(self.batches)]
            i += 1

    def describe(self) -> dict[str, Any]:
        return {"source": "pre-generated RandomSource batches", "count": len(self.batches)}


class ListSource(CycleSource):
    """Pre-generated held-out batches, once each."""

    def __iter__(self):
        return iter(self.batches)


# The lab's optimizer settings: "sgd" is the baseline's math (one SGD learning rate for
# tables and MLPs), "adagrad" the lab's default (fused row-wise Adagrad tables, Adagrad MLPs).
LAB_OPTIMIZERS = ("sgd", "adagrad")
TABLE_UPDATE = "auto"  # --table-update fbgemm: the lab on TorchRec's fused kernel, as before issue 37
TABLE_PAGES = "auto"  # --table-pages base: the tables on 4 KiB pages, as before issue 46
PLAIN_LR = 4.0  # best held-out AUC of lr in {0.1, 1, 4, 10} after 150 steps at batch 2048


def optimizer_options(name: str, variant: dict[str, str] | None = None) -> dict[str, Any]:
    """The lab as `dlrm-lab train` runs it: its tables' update and pages, its dense optimizer's step and its dense
    weights chosen by measurement (`--table-update auto`, `--table-pages auto`, `--dense-update auto`,
    `--dense-weights auto`), or as `variant` fixes them."""
    chosen = dict(table_update=TABLE_UPDATE, table_pages=TABLE_PAGES, dense_update="auto", dense_weights="auto")
    chosen |= variant or {}
    if name == "sgd":
        return dict(embedding_optimizer="sgd", embedding_lr=PLAIN_LR, dense_optimizer="sgd", dense_lr=PLAIN_LR,
                    **chosen)  # fmt: skip
    return dict(embedding_optimizer="rowwise_adagrad", dense_optimizer="adagrad", **chosen)


def run_lab(
    spec: ModelSpec,
    batches: list,
    eval_batches: list,
    steps: int,
    warmup: int,
    precision: str,
    optimizer: str,
    variant: dict[str, str] | None = None,
):
    cfg = TrainConfig(
        steps=warmup + steps,
        batch_size=batches[0].labels.numel(),
        precision=precision,
        warmup_steps=warmup,
        eval_batches=len(eval_batches),
        **optimizer_options(optimizer, variant),
    )
    result = train(preflight(spec, cfg, data=False), source=CycleSource(batches), eval_source=ListSource(eval_batches))
    return result.summary


@torch.no_grad()
def plain_auc(model: nn.Module, eval_batches: list) -> float:
    logits = torch.cat([model(b.dense_features, b.sparse_features) for b in eval_batches])
    labels = torch.cat([b.labels for b in eval_batches])
    return binary_auroc(torch.sigmoid(logits), labels.long()).item()


def _profiled_train(spec: ModelSpec, batches: list, precision: str, optimizer: str, steps: int):
    """torch.profiler over the lab's steps 3.. of a short run (the first steps' one-off costs skipped)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = TrainConfig(
        steps=steps,
        batch_size=batches[0].labels.numel(),
        precision=precision,
        warmup_steps=0,
        eval_batches=1,
        **optimizer_options(optimizer),
    )
    holder: dict[str, Any] = {"ms": 0.0}

    def around(row: dict[str, Any]) -> None:
        if row["step"] == 2:
            holder["prof"] = profile(activities=[ProfilerActivity.CPU])
            holder["prof"].__enter__()
        elif row["step"] > 2:
            holder["ms"] += row["step_time_ms"]
        if row["step"] == steps - 1:
            holder["prof"].__exit__(None, None, None)

    train(
        preflight(spec, cfg, data=False),
        source=CycleSource(batches),
        eval_source=ListSource(batches[:1]),
        on_step=around,
    )
    return holder["prof"], holder["ms"]


def profile_lab(spec: ModelSpec, batches: list, precision: str, optimizer: str, steps: int = 10) -> str:
    """Top operators of the lab's training step by self CPU time (torch.profiler)."""
    prof, _ = _profiled_train(spec, batches, precision, optimizer, steps)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=55)
    return f"{optimizer} {precision}, {steps - 3} profiled steps\n{table}"


def fused_update_share(spec: ModelSpec, batches: list, precision: str, steps: int = 13) -> float:
    """Share of a lab-adagrad step spent in the tables' backward with the row-wise Adagrad update, fbgemm's
    kernel (its self time) or the batched one (its labelled range's total), over the profiled steps' wall time."""
    from dlrm_lab.train.table_update import PROFILE_LABEL

    prof, wall_ms = _profiled_train(spec, batches, precision, "adagrad", steps)
    events = prof.key_averages()
    update_us = sum(e.self_cpu_time_total for e in events if "split_embedding_backward" in e.key)
    update_us += sum(e.cpu_time_total for e in events if e.key == PROFILE_LABEL)
    return update_us / 1e3 / wall_ms


def gemm_gflops(dtype: torch.dtype, n: int = 2048, k: int = 512, m: int = 512, reps: int = 30) -> float:
    a, b = torch.randn(n, k, dtype=dtype), torch.randn(k, m, dtype=dtype)
    for _ in range(5):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n * k * m * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kaggle")
    ap.add_argument("--max-rows", type=int, default=1_000_000)
    ap.add_argument("--batch-sizes", default="128,2048")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per repeat")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quality-steps", type=int, default=300, help="steps of the equal-AUC check at batch 2048")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the lab step's top operators at batch 2048 and exit")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--table-update", default="auto", help="the lab's --table-update (auto, fbgemm, batched)")
    ap.add_argument("--table-pages", default="auto", help="the lab's --table-pages (auto, base, huge)")
    ap.add_argument("--variants", default="", help="the lab's runs, each interleaved: ';'-separated sets of "
                    "option=value (TrainConfig's names), e.g. 'dense_update=per_tensor,dense_weights=fp32;"
                    "dense_weights=bf16' measures issue 59's routes against the step before them")  # fmt: skip
    args = ap.parse_args()
    global TABLE_UPDATE, TABLE_PAGES
    TABLE_UPDATE, TABLE_PAGES = args.table_update, args.table_pages
    variants = [dict(kv.split("=", 1) for kv in v.split(",") if kv) for v in args.variants.split(";")] or [{}]
    if args.quick:
        args.steps, args.repeats, args.quality_steps, args.max_rows = 5, 1, 20, 10_000

    spec = dlrm_lab.load_preset(args.preset, max_rows=args.max_rows)
    cost = sample_cost(spec)
    # MLP multiply-adds x 2 x 3 (forward, two backward products): the 2.85 MFLOP of the issue
    flop_per_sample = 3 * (cost.bottom_mlp_flops + cost.top_mlp_flops)
    # bf16 only where this machine's GEMMs make it a contender (it ran 100x slower than fp32 on
    # an AVX2-only EPYC): the lab's own --precision auto rule, on the model's shapes
    choice = choose_precision("auto", spec, allowed=PRECISIONS, threads=torch.get_num_threads(), rows=2048)
    precisions = list(dict.fromkeys(["fp32", *contenders(choice)]))
    print(f"precisions: {', '.join(precisions)} ({choice.reason})", flush=True)
    if args.profile:
        profile_batches = batches(spec, 2048, 8)
        for opt in LAB_OPTIMIZERS:
            for prec in precisions:
                print(profile_lab(spec, profile_batches, prec, opt), flush=True)
        return
    results: dict[str, Any] = {
        "preset": spec.name,
        "max_rows": args.max_rows,
        "threads": torch.get_num_threads(),
        **header(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gemm_gflops_fp32": gemm_gflops(torch.float32),
        "gemm_gflops_bf16": gemm_gflops(torch.bfloat16, reps=2 if "bf16" not in precisions else 30),
        "precision_choice": choice.to_dict(),
        "train_mflop_per_sample": flop_per_sample / 1e6,
        "points": [],
    }
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        train_batches, evals = batches(spec, batch, 8), batches(spec, batch, 2, offset=HELD_OUT_OFFSET)
        samples: dict[str, list[float]] = {}
        fractions: dict[str, list[float | None]] = {}
        updates: dict[str, list[str]] = {}  # what --table-update chose in each repeat
        batch_list = train_batches
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for prec in precisions:
                rate = run_plain(spec, batch_list, args.steps, args.warmup, prec, PLAIN_LR)["samples_per_s"]
                samples.setdefault(f"plain {prec}", []).append(rate)
                for opt in LAB_OPTIMIZERS:
                    for variant in variants:
                        named = " ".join(f"{k}={v}" for k, v in variant.items())
                        key = f"lab-{opt} {prec}" + (f" {named}" if len(variants) > 1 else "")
                        summary = run_lab(spec, batch_list, evals, args.steps, args.warmup, prec, opt, variant)
                        samples.setdefault(key, []).append(summary["samples_per_s"])
                        fractions.setdefault(key, []).append(summary.get("roofline_fraction"))
                        updates.setdefault(f"{key} table update", []).append(summary.get("table_update"))
                        for floor in ("phase_floor_fraction", "table_update_floor_fraction", "canary_ratio"):
                            fractions.setdefault(f"{key} {floor}", []).append(summary.get(floor))
        med = {k: statistics.median(v) for k, v in samples.items()}
        point: dict[str, Any] = {"batch_size": batch, **updates}
        for k, v in med.items():
            point[f"{k} samples/s"] = v
            point[f"{k} / plain fp32"] = v / med["plain fp32"]
            point[f"{k} GFLOP/s"] = v * flop_per_sample / 1e9
            point[f"{k} spread"] = (max(samples[k]) - min(samples[k])) / v  # (max - min) / median
            known = [f for f in fractions.get(k, []) if f is not None]
            if known:  # of the step's roofline bound at this machine's probed peaks
                point[f"{k} roofline fraction"] = statistics.median(known)
            for floor in ("phase_floor_fraction", "table_update_floor_fraction", "canary_ratio"):  # the host's speed
                if known := [f for f in fractions.get(f"{k} {floor}", []) if f is not None]:
                    point[f"{k} {floor}"] = statistics.median(known)
        if batch == 2048:  # the fused row-wise Adagrad's share of a step (issue 13: under 15%)
            for prec in precisions:
                point[f"lab-adagrad {prec} fused update share"] = fused_update_share(spec, batch_list, prec)
        results["points"].append(point)
        print(json.dumps(point), flush=True)

    # Equal quality: the same learnable data, the same steps, both models scored on held-out samples.
    if args.quality_steps > 0:  # none asked: the speed alone
        quality(spec, args.quality_steps, precisions, results)
    print(json.dumps({k: v for k, v in results.items() if k not in ("points", "quality")}), flush=True)
    if args.json:
        write_results(args.json, results)


def quality(spec: Any, steps: int, precisions: list[str], results: dict[str, Any]) -> None:
    batch = 2048
    train_batches = batches(spec, batch, steps, seed=1)
    evals = batches(spec, batch, 4, seed=1, offset=HELD_OUT_OFFSET)
    plain = run_plain(spec, train_batches, steps, 0, "fp32", PLAIN_LR)
    results["quality"] = {
        "steps": steps,
        "batch_size": batch,
        "plain fp32 AUC": plain_auc(plain["model"], evals),
        **{
            f"lab-{opt} {prec} AUC": run_lab(spec, train_batches, evals, steps, 0, prec, opt)["eval_auc"]
            for opt in LAB_OPTIMIZERS
            for prec in precisions
        },
    }
    print(json.dumps(results["quality"]), flush=True)


if __name__ == "__main__":
    main()
