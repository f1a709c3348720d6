"""Training: the sharded loop, phase timers, evaluation and step records."""

from dlrm_lab.train.loop import TrainResult, train
from dlrm_lab.train.preflight import ResolvedRun, preflight

__all__ = ["ResolvedRun", "TrainResult", "preflight", "train"]
