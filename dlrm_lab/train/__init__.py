"""Training: the sharded loop, phase timers, evaluation and step records."""

from dlrm_lab.train.loop import ResolvedRun, TrainResult, preflight, train

__all__ = ["ResolvedRun", "TrainResult", "preflight", "train"]
