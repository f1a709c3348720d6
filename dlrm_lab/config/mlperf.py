"""What a preset carries of its MLPerf benchmark: the Inference rules of its [mlperf] table (`MLPerfRules`: the
Server scenario's latency bound and the share of the fp32 model's accuracy a served build keeps) and the published
training recipe and target of its [reference] table (`HSTURecipe`: optimizers, warm-up, clipping, evaluation
cadence, the sequence budget the FLOP count charges, samples to the target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from dlrm_lab.errors import UserError

MLPERF_METRICS = ("ne", "accuracy", "auc")  # DLRMv3's: torchrec's lifetime NE, accuracy and per-request AUC (GAUC)
_MLPERF_KEYS = ("benchmark", "server_latency_ms", "accuracy_share", "reference", "source")


@dataclass(frozen=True)
class MLPerfRules:
    """A preset's MLPerf Inference rules (its [mlperf] table). `server_latency_ms` is the Server scenario's
    bound at p99 (MLPerf's Server percentile for every benchmark, and the lab's `--percentile` default): the
    default `--sla-ms` of `infer run` and `infer search` for the preset. A served build keeps
    `accuracy_share` of each metric of the fp32 model (MLPerf: of the FP32 reference checkpoint's
    `reference`, fractions: the rules' NE 86.687% is 0.86687)."""

    benchmark: str
    server_latency_ms: float
    accuracy_share: float
    reference: dict[str, float]
    source: str = ""

    @classmethod
    def from_dict(cls, raw: Any, where: str = "mlperf") -> MLPerfRules:
        def number(v: Any) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        if not isinstance(raw, dict):
            raise UserError(f"{where}: must be a table with {', '.join(_MLPERF_KEYS)}")
        if unknown := sorted(set(raw) - set(_MLPERF_KEYS)):
            raise UserError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(_MLPERF_KEYS)}")
        if missing := [k for k in _MLPERF_KEYS[:4] if k not in raw]:
            raise UserError(f"{where}: missing {missing[0]!r} (required: {', '.join(_MLPERF_KEYS[:4])})")
        bench, bound, share, ref = (raw[k] for k in _MLPERF_KEYS[:4])
        if not isinstance(bench, str) or not bench:
            raise UserError(f"{where}: benchmark = {bench!r}: a benchmark name, e.g. 'dlrm-v3'")
        if not number(bound) or bound <= 0:
            raise UserError(f"{where}: server_latency_ms = {bound!r}: a number of ms > 0")
        if not number(share) or not 0 < share <= 1:
            raise UserError(f"{where}: accuracy_share = {share!r}: in (0, 1], e.g. 0.999 for 99.9%")
        if not isinstance(ref, dict) or sorted(ref) != sorted(MLPERF_METRICS):
            raise UserError(f"{where}: reference = {ref!r}: a table of {', '.join(MLPERF_METRICS)}")
        for name in MLPERF_METRICS:
            if not number(ref[name]) or not 0 < ref[name] <= 1:
                raise UserError(f"{where}: reference.{name} = {ref[name]!r}: a fraction in (0, 1] (86.687% is 0.86687)")
        return cls(
            bench, float(bound), float(share), {k: float(ref[k]) for k in MLPERF_METRICS}, str(raw.get("source", ""))
        )

    @property
    def accuracy_rule(self) -> str:
        return (
            f"MLPerf {self.benchmark}: NE, accuracy and per-request AUC each within {self.accuracy_share:.1%} of "
            "the fp32 eager model's"
        )

    def accuracy_kept(self, build: dict[str, float], fp32: dict[str, float]) -> dict[str, bool]:
        """Per metric, whether `build` keeps `accuracy_share` of `fp32`'s, each in its own direction: NE is
        a loss (lower is better: at most fp32's / share), accuracy and AUC at least share x fp32's. (The
        submission checker compares all three as floors, found >= share x reference, NE included.)"""
        share = self.accuracy_share
        return {
            "ne": build["ne"] <= fp32["ne"] / share,
            "accuracy": build["accuracy"] >= share * fp32["accuracy"],
            "auc": build["auc"] >= share * fp32["auc"],
        }


@dataclass(frozen=True)
class HSTURecipe:
    """A preset's published training recipe and target (its [reference] table). The keys DLRM presets have
    (`batch_size`, global; `dense_lr` at that batch; `target_auc`; `source`) mean what they mean there (the
    lab's `dense_lr_for` scales the rate to a run's batch); the rest are recorded as published:
    the optimizers and their settings, the warm-up and clipping, the evaluation cadence (a share of the
    training stream), the sequence budget `max_seq_len` the FLOP count charges (`reference_training_flops`),
    the published FLOPs per training sample, the mean samples to the target and the runs a result needs."""

    source: str = ""
    batch_size: int | None = None
    dense_lr: float | None = None
    target_auc: float | None = None
    dense_optimizer: str | None = None
    adam_betas: tuple[float, float] | None = None
    embedding_optimizer: str | None = None
    embedding_lr: float | None = None
    lr_warmup_steps: int | None = None
    grad_clip_norm: float | None = None
    eval_every_share: float | None = None
    max_seq_len: int | None = None
    flops_per_sample: float | None = None
    samples_to_target: float | None = None
    runs: int | None = None

    @classmethod
    def from_dict(cls, raw: Any, where: str = "[reference]") -> HSTURecipe:
        if not isinstance(raw, dict):
            raise UserError(f"{where}: must be a table")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - known):
            raise UserError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
        ints = {"batch_size", "lr_warmup_steps", "max_seq_len", "runs"}
        texts = {"source", "dense_optimizer", "embedding_optimizer"}
        out = dict(raw)
        for key, value in raw.items():
            if key in texts:
                ok = isinstance(value, str) and value != ""
            elif key == "adam_betas":
                ok = isinstance(value, list | tuple) and len(value) == 2 and all(_fraction(b) for b in value)
                out[key] = tuple(float(b) for b in value) if ok else value
            elif key in ints:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= (0 if "steps" in key else 1)
            else:
                ok = _number(value) and value > 0 and (key != "target_auc" or value < 1)
            if not ok:
                rule = (
                    "a name"
                    if key in texts
                    else "two numbers in [0, 1)"
                    if key == "adam_betas"
                    else "an integer >= 0"
                    if key == "lr_warmup_steps"
                    else "an integer >= 1"
                    if key in ints
                    else "a number in (0, 1)"
                    if key == "target_auc"
                    else "a number > 0"
                )
                raise UserError(f"{where}: {key} = {value!r}: must be {rule}")
        return cls(**out)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _fraction(v: Any) -> bool:
    return _number(v) and 0 <= v < 1
