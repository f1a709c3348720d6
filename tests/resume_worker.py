"""Run under torchrun by tests: 16 straight steps vs 8 steps, checkpoint, resume to 16."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

import dlrm_lab
from dlrm_lab.config import TrainConfig
from dlrm_lab.distributed.context import init_distributed, shutdown_distributed
from dlrm_lab.train import train


def global_losses(result):
    by_step = {}
    for row in result.steps:
        by_step.setdefault(row["step"], []).append(row["loss"])
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    world = init_distributed("cpu").world_size
    spec = dlrm_lab.load_preset("tiny")
    base = dict(batch_size=64 // world, seed=5, prefetch=0, eval_batches=2, sharding="row_wise")
    straight = train(spec, TrainConfig(steps=16, **base))
    train(spec, TrainConfig(steps=8, checkpoint_dir=str(out / "ckpt"), **base))
    resumed = train(spec, TrainConfig(steps=16, checkpoint_dir=str(out / "ckpt"), resume=True, **base))
    if dist.get_rank() == 0:
        (out / "losses.json").write_text(
            json.dumps({"straight": global_losses(straight), "resumed": global_losses(resumed)})
        )
    shutdown_distributed()  # gloo's threads left to the interpreter's teardown can abort the process
