"""Training: the sharded loop, phase timers, evaluation and step records."""

from dlrm_lab.train.loop import TrainResult, preflight, train

__all__ = ["TrainResult", "preflight", "train"]
