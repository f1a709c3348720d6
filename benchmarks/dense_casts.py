"""Issue 59's cast routes, measured on a preset's dense part (bottom MLP, dot interaction, top MLP) at a training
batch: one step (forward, backward, dense Adagrad) each way, interleaved, medians of repeats. The embeddings come in
as one fp32 B x F x D tensor (the lookup is not what differs between the ways).

- `autocast`: fp32 weights, bf16 autocast, torch's per-tensor Adagrad (the lab before issue 59);
- `autocast+fused`: the same with torch's fused Adagrad kernel (the lab's `--dense-update auto` on this class);
- `bf16 weights, fp32 master`: the weights held in bf16 as views of one flat buffer, their fp32 masters in another,
  stepped by one fused Adagrad over the flat master and copied back once a step (no per-step weight casts; the
  boundary casts only: the dense input, the embeddings, the logits);
- `bf16 weights, stochastic rounding`: the weights in bf16 alone (no master), the update computed in fp32 and
  rounded to bf16 stochastically (torchao's low-precision optimizers' way);
- `bf16 weights, split`: split-SGD's layout (Kalamkar et al., arXiv 2005.04680): the bf16 weights are the top
  halves of the fp32 masters, the low 16 bits kept apart; a step joins the halves, steps in fp32, splits again.

    python benchmarks/dense_casts.py [--preset kaggle] [--batch-size 2048] [--repeats 15] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import header, results_path, write_results
from torch import nn

import dlrm_lab
from dlrm_lab.model.interaction import DotInteractionArch


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if last_relu or i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


class Dense(nn.Module):
    def __init__(self, spec, features: int, dim: int) -> None:
        super().__init__()
        self.bot = mlp([spec.num_dense, *spec.bottom_mlp], True)
        self.inter = DotInteractionArch(features)
        self.top = mlp([dim + features * (features + 1) // 2, *spec.top_mlp], False)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.top(self.inter(self.bot(x), e)).squeeze(-1)


def flat_bf16(model: nn.Module) -> tuple[list[nn.Parameter], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's weights as bf16 views of one buffer, their gradients views of another; (params, fp32 copy of
    the weights, the bf16 buffer, the bf16 gradient buffer)."""
    params = list(model.parameters())
    master = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    flat, grads = master.to(torch.bfloat16), torch.zeros(master.numel(), dtype=torch.bfloat16)
    at = 0
    for p in params:
        n = p.numel()
        p.data, p.grad = flat[at : at + n].view_as(p), grads[at : at + n].view_as(p)
        at += n
    return params, master, flat, grads


def stochastic_round(x: torch.Tensor, out: torch.Tensor) -> None:
    """`x` (fp32) to bf16 in `out`, rounded up with probability equal to the dropped low bits' share."""
    bits = x.view(torch.int32) + torch.randint(0, 1 << 16, x.shape, dtype=torch.int32)
    out.copy_((bits & -65536).view(torch.float32))  # the low 16 bits cleared: exact in bf16


def make_step(way: str, spec, batch: int, lr: float = 0.01) -> Callable[[], None]:
    features, dim = len(spec.tables), spec.tables[0].embedding_dim
    torch.manual_seed(0)
    x, labels = torch.randn(batch, spec.num_dense), torch.randint(0, 2, (batch,)).float()
    emb = torch.randn(batch, features, dim, requires_grad=True)
    model = Dense(spec, features, dim)
    loss_of = nn.functional.binary_cross_entropy_with_logits
    if way.startswith("autocast"):
        opt = torch.optim.Adagrad(model.parameters(), lr=lr, **({"fused": True} if "fused" in way else {}))

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x, emb)
            opt.zero_grad()
            loss_of(logits.float(), labels).backward()
            opt.step()

        return step
    _, master, flat, grads = flat_bf16(model)
    weights = nn.Parameter(master)
    weights.grad = torch.zeros_like(master)
    opt = torch.optim.Adagrad([weights], lr=lr, fused=True)
    low = master.view(torch.int32) & 0xFFFF  # split: the low halves kept apart, the top halves the weights
    if way == "bf16 weights, split":
        flat.copy_((master.view(torch.int32) & -65536).view(torch.float32))

    def step() -> None:
        logits = model(x.bfloat16(), emb.bfloat16())  # the boundary casts only
        grads.zero_()
        loss_of(logits.float(), labels).backward()
        if way == "bf16 weights, split":  # the fp32 master rebuilt from its two halves
            weights.data.view(torch.int32).copy_((flat.float().view(torch.int32) & -65536) | low)
        elif way == "bf16 weights, stochastic rounding":  # no master: the bf16 weights are the state
            weights.data.copy_(flat)
        weights.grad.copy_(grads)
        opt.step()
        if way == "bf16 weights, split":
            low.copy_(weights.data.view(torch.int32) & 0xFFFF)
            flat.copy_((weights.data.view(torch.int32) & -65536).view(torch.float32))  # the top half: exact
        elif way == "bf16 weights, stochastic rounding":
            stochastic_round(weights.data, flat)
        else:
            flat.copy_(weights.data)

    return step


WAYS = (
    "autocast",
    "autocast+fused",
    "bf16 weights, fp32 master",
    "bf16 weights, stochastic rounding",
    "bf16 weights, split",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kaggle")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--profile", action="store_true", help="also print the top operators of two ways")
    ap.add_argument("--out")
    args = ap.parse_args()
    spec = dlrm_lab.load_preset(args.preset)
    steps = {way: make_step(way, spec, args.batch_size) for way in WAYS}
    for step in steps.values():
        for _ in range(3):
            step()
    ms: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(args.repeats):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            start = time.perf_counter()
            for _ in range(5):
                steps[way]()
            ms[way].append((time.perf_counter() - start) / 5 * 1e3)
    base = statistics.median(ms["autocast"])
    results = {**header(), "preset": args.preset, "batch_size": args.batch_size, "threads": torch.get_num_threads()}
    for way in WAYS:
        med = statistics.median(ms[way])
        results[way] = {"step_ms": med, "vs_autocast": base / med}
        print(f"{way:36s} {med:7.2f} ms a step  {base / med:4.2f}x autocast", flush=True)
    if args.profile:
        from torch.profiler import profile

        for way in ("autocast+fused", "bf16 weights, fp32 master"):
            with profile() as prof:
                for _ in range(5):
                    steps[way]()
            print(way, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10), sep="\n")
    print("wrote", write_results(results_path("dense_casts", args.out), results))


if __name__ == "__main__":
    main()
