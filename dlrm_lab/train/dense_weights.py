"""The dense weights a bf16 training step computes with (`--dense-weights`).

Under bf16 autocast the weights stay fp32 and every use casts them: each Linear's weight and bias in the forward,
and the cast's backward in the other direction, every step (kaggle: 89 `copy_` a step, 4-17 ms of a 38-87 ms step in
profiles on the AMX class). The other way holds bf16 copies of the dense weights (views of one buffer), computes
with them out of autocast, and keeps the fp32 masters in the optimizer: after the backward the copies' gradients go
to the masters in one multi-tensor copy, the optimizer steps the masters, and one more copy refreshes the bf16
weights. The casts left are the boundaries: the dense input, the pooled embeddings and the logits
(`model.dlrm.DLRM.dense_dtype`). Checkpoints keep the fp32 masters (`as_trained`), so a run, its resume and its
serving see the weights the optimizer holds, whichever way it stepped.

Written here because torch has no "master weights" wrapper for a module trained by a plain optimizer (apex's and
DeepSpeed's are for GPUs and wrap their own optimizers); the copies are torch's `_foreach_copy_`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dlrm_lab.model.dlrm import DLRM

WAYS = ("bf16", "fp32")  # the way to prove first, as a step trial takes them (`train.step_trial`)


def unsupported(model: torch.nn.Module, cfg: Any, world_size: int) -> str | None:
    """Why the bf16 weights cannot run for this run (None: they can)."""
    if cfg.precision != "bf16":
        return f"the dense part runs in {cfg.precision}: there is nothing to cast"
    if not any(isinstance(m, DLRM) for m in model.modules()):
        return "the model is not a DLRM (its forward has no boundary casts)"
    if cfg.pipeline:
        return "the pipelined step steps its optimizer inside TorchRec's pipeline"
    if world_size > 1:
        return "DDP's buckets were made from the fp32 weights when the model was sharded"
    return None


class DenseWeights:
    """The dense weights of `model` (the parameters named `names`: the optimizer's, fp32), and their bf16 copies;
    `use(way)` puts one set in the model. The masters are the model's own parameter objects, so the optimizer, its
    state and checkpoints keep addressing them; in the bf16 way the model holds the copies instead."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        params = dict(model.named_parameters())
        self.masters = [params[name] for name in names]
        # (module, attribute) of each weight: found by identity, as a wrapper (TorchRec's DMP) names them its own way
        owners = {id(p): (m, leaf) for m in model.modules() for leaf, p in m.named_parameters(recurse=False)}
        self.slots = [owners[id(p)] for p in self.masters]
        sizes = [p.numel() for p in self.masters]
        device = self.masters[0].device if self.masters else None  # the copies beside their masters (a GPU's)
        low = torch.empty(sum(sizes), dtype=torch.bfloat16, device=device)
        grads = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        self.copies = [
            torch.nn.Parameter(view.view_as(p)) for view, p in zip(low.split(sizes), self.masters, strict=True)
        ]
        self.master_grads = [view.view_as(p) for view, p in zip(grads.split(sizes), self.masters, strict=True)]
        self.dlrms = [m for m in model.modules() if isinstance(m, DLRM)]
        self.way = "fp32"

    def use(self, way: str) -> None:
        """Put the `way` weights in the model: "bf16" (the copies, refreshed from the masters, and the DLRM's
        boundary casts) or "fp32" (the masters, as autocast casts them)."""
        if way == self.way:
            return
        if way == "bf16":
            self.refresh()
        for (module, leaf), weight in zip(self.slots, self.copies if way == "bf16" else self.masters, strict=True):
            setattr(module, leaf, weight)
        for dlrm in self.dlrms:
            dlrm.dense_dtype = torch.bfloat16 if way == "bf16" else None
        self.way = way

    @property
    def autocast(self) -> bool:
        """Whether the step computes under autocast (the fp32 way)."""
        return self.way == "fp32"

    def to_masters(self) -> None:
        """After the backward: the copies' gradients to the masters', one multi-tensor copy (the bf16 way)."""
        if self.way != "bf16":
            return
        taken = [
            (c, g, m)
            for c, g, m in zip(self.copies, self.master_grads, self.masters, strict=True)
            if c.grad is not None
        ]
        torch._foreach_copy_([g for _, g, _ in taken], [c.grad for c, _, _ in taken])
        for copy, grad, master in taken:
            master.grad = grad
            copy.grad = None  # the next backward's gradient is taken as made, not added to this one

    def refresh(self) -> None:
        """The bf16 copies from the masters, one multi-tensor copy (after each optimizer step, the bf16 way)."""
        with torch.no_grad():
            torch._foreach_copy_([c.data for c in self.copies], [m.data for m in self.masters])

    def after_step(self) -> None:
        if self.way == "bf16":
            self.refresh()

    def largest_gap(self) -> float:
        """The largest difference between a bf16 copy and its master rounded to bf16 (0 after a step)."""
        return max(
            (
                float((c.detach() - m.detach().to(torch.bfloat16)).abs().max())
                for c, m in zip(self.copies, self.masters, strict=True)
            ),
            default=0.0,
        )

    @contextlib.contextmanager
    def as_trained(self) -> Iterator[None]:
        """The masters in the model for a while (a checkpoint, an export): the fp32 weights the optimizer holds."""
        way = self.way
        self.use("fp32")
        try:
            yield
        finally:
            self.use(way)


def as_trained(weights: DenseWeights | None) -> contextlib.AbstractContextManager[None]:
    """The model with the weights the optimizer holds for a while: the fp32 masters where the run has bf16 copies
    (`weights`), the model as it is where it has none."""
    return weights.as_trained() if weights is not None else contextlib.nullcontext()
