"""One training step, and the dense optimizer beside the tables' fused one (the loop and the sharding trial)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from dlrm_lab.config import TrainConfig
from dlrm_lab.config.train import DenseRecipe
from dlrm_lab.distributed.context import DistContext

DENSE_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


class RecipeOptimizer(CombinedOptimizer):
    """The tables' fused optimizer and the dense one, stepped with the dense recipe: the dense rate warmed up
    linearly and the dense gradients' norm clipped before each step (the tables' update is fused in backward,
    so it is neither). `steps_done` is the run's step (set on resume)."""

    def __init__(self, fused: Any, dense: Any, lr: float, recipe: DenseRecipe) -> None:
        super().__init__([fused, dense])
        self.dense, self.base_lr, self.recipe, self.steps_done = dense, lr, recipe, 0
        self._dense_params = [p for group in dense.param_groups for p in group["params"]]
        self._set_lr()

    def resume_at(self, step: int) -> None:
        """A run resumed at `step`: its warm-up goes on from there."""
        self.steps_done = step
        self._set_lr()

    def _set_lr(self) -> None:
        if self.recipe.lr_warmup_steps:
            for group in self.dense.param_groups:
                group["lr"] = self.base_lr * self.recipe.lr_scale(self.steps_done)

    def step(self, closure: Any = None) -> Any:
        if self.recipe.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._dense_params, self.recipe.grad_clip_norm)
        out = super().step(closure)
        self.steps_done += 1
        self._set_lr()  # the next step's rate
        return out


# How torch steps a dense optimizer: a Python loop of small ops per tensor, the same ops over every tensor at once,
# or one fused kernel (CPU kernels for Adagrad, Adam and SGD since torch 2.4). The same update; which is fastest is
# measured (`train.choices.choose_dense_update`).
DENSE_UPDATE_ARGS: dict[str, dict[str, bool]] = {
    "per_tensor": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def dense_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters the dense optimizer steps (the tables' are updated in their backward)."""
    return dict(in_backward_optimizer_filter(model.named_parameters()))


def make_dense(
    params: Any, cfg: TrainConfig, lr: float, recipe: DenseRecipe, update: str = "per_tensor"
) -> torch.optim.Optimizer:
    """The dense optimizer of `cfg` over `params`, stepped the `update` way (`DENSE_UPDATE_ARGS`)."""
    extra = {"betas": recipe.betas} if recipe.betas is not None and cfg.dense_optimizer == "adam" else {}
    return DENSE_OPTIMIZERS[cfg.dense_optimizer](params, lr=lr, **extra, **DENSE_UPDATE_ARGS[update])


def dense_optimizer(
    model: torch.nn.Module,
    cfg: TrainConfig,
    lr: float,
    recipe: DenseRecipe | None = None,
    update: str = "per_tensor",
) -> CombinedOptimizer:
    """The dense optimizer beside the tables' fused one, combined for stepping and checkpoints; with a recipe
    that warms up or clips (`config.train.dense_recipe_for`), stepped by `RecipeOptimizer`."""
    recipe = recipe or DenseRecipe()
    dense = KeyedOptimizerWrapper(dense_params(model), lambda params: make_dense(params, cfg, lr, recipe, update))
    if recipe.lr_warmup_steps or recipe.grad_clip_norm is not None:
        return RecipeOptimizer(model.fused_optimizer, dense, lr, recipe)
    return CombinedOptimizer([model.fused_optimizer, dense])


def autocast(ctx: DistContext, cfg: TrainConfig, weights: Any = None) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast for a bf16 run whose dense weights are fp32 (`weights`: its `train.dense_weights.DenseWeights`,
    None where it has none); none where they are already bf16 or the run is fp32."""
    if cfg.precision == "bf16" and (weights is None or weights.autocast):
        return torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_inputs(batch: Any) -> tuple[Any, ...]:
    """The model's forward arguments from a batch: a DLRM's (dense, sparse); an HSTU request batch's
    (sparse, actions, ages); one label per logit either way (`batch.labels`)."""
    own = getattr(batch, "model_inputs", None)
    return own() if own is not None else (batch.dense_features, batch.sparse_features)


def train_step(
    dmp: torch.nn.Module,
    optimizer: Any,
    batch: Any,
    ctx: DistContext,
    cfg: TrainConfig,
    mark: Callable[[str], None],
    weights: Any = None,
) -> torch.Tensor:
    """One unpipelined step on a batch already on the device; `mark` ends each phase. `weights`: the run's
    `train.dense_weights.DenseWeights` (bf16 copies of the masters the optimizer steps), or None."""
    with autocast(ctx, cfg, weights):
        logits = dmp(*model_inputs(batch))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    mark("dense_forward")
    optimizer.zero_grad()
    loss.backward()  # also applies the fused table optimizer and DDP all-reduce
    mark("backward")
    if weights is not None:
        weights.to_masters()
    optimizer.step()
    if weights is not None:
        weights.after_step()
    mark("optimizer")
    return loss
