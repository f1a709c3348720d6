"""One training step, and the dense optimizer beside the tables' fused one (the loop and the sharding trial)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from dlrm_lab.config import TrainConfig
from dlrm_lab.distributed.context import DistContext

DENSE_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


def dense_optimizer(model: torch.nn.Module, cfg: TrainConfig, lr: float) -> CombinedOptimizer:
    """The dense optimizer beside the tables' fused one, combined for stepping and checkpoints."""
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    make = DENSE_OPTIMIZERS[cfg.dense_optimizer]
    dense = KeyedOptimizerWrapper(dense_params, lambda params: make(params, lr=lr))
    return CombinedOptimizer([model.fused_optimizer, dense])  # type: ignore[attr-defined]


def autocast(ctx: DistContext, cfg: TrainConfig) -> contextlib.AbstractContextManager[Any]:
    if cfg.precision == "bf16":
        return torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_inputs(batch: Any) -> tuple[Any, ...]:
    """The model's forward arguments from a batch: a DLRM's (dense, sparse); an HSTU request batch's
    (sparse, actions, ages); one label per logit either way (`batch.labels`)."""
    own = getattr(batch, "model_inputs", None)
    return own() if own is not None else (batch.dense_features, batch.sparse_features)


def train_step(
    dmp: torch.nn.Module, optimizer: Any, batch: Any, ctx: DistContext, cfg: TrainConfig, mark: Callable[[str], None]
) -> torch.Tensor:
    """One unpipelined step on a batch already on the device; `mark` ends each phase."""
    with autocast(ctx, cfg):
        logits = dmp(*model_inputs(batch))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    mark("dense_forward")
    optimizer.zero_grad()
    loss.backward()  # also applies the fused table optimizer and DDP all-reduce
    mark("backward")
    optimizer.step()
    mark("optimizer")
    return loss
