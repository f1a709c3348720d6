"""A serving build's accuracy rule: its scores against the fp32 eager model's on held-out samples.

An fp32 build keeps every score within 1e-5; a reduced-precision one keeps 99.9% of fp32's AUC (MLPerf's
high-accuracy target), or, for a preset that declares MLPerf's rule ([mlperf]), its share of NE, accuracy
and per-request AUC. The labels are the samples' own where the served model was trained (`--checkpoint`);
an untrained model's are drawn from its own ranking (`reference_labels`), said so in the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict, cast

import numpy as np
import torch
from torch import nn

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.serving_parts import serving_of

FP32_SCORE_TOLERANCE = 1e-5  # an fp32 build's scores against the eager model's
AUC_RELATIVE_TOLERANCE = 1e-3  # a reduced-precision build's AUC against fp32's (MLPerf: 99.9% of the reference)
AUC_RELATIVE_TOLERANCE_99 = 1e-2  # MLPerf's lower target (99%), recorded beside the rule
CHECK_SAMPLES = 16384  # held-out samples of the accuracy check
CHECK_REQUESTS = 512  # held-out requests of the ranker's accuracy check (a few thousand candidates)


def score_build(module: nn.Module, samples: Any, precision: str) -> np.ndarray:
    """A build's scores of held-out samples, as its family scores them (a DLRM: a PackedLibrary or a
    SampleBlock in one batch as an instance assembles it; the HSTU ranker: one per candidate of a
    RequestBlock's requests); the eager model under autocast below fp32."""
    autocast = precision != "fp32" and getattr(module, "served_precision", None) is None
    return serving_of(module.spec).score(module, samples, precision, autocast)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.from_numpy(scores.astype(np.float32)), torch.from_numpy(labels).long()).item())


class MLPerfMetrics(TypedDict):
    """A build's and the fp32 eager model's NE, accuracy and per-request AUC under a preset's MLPerf rule, and per
    metric whether the build keeps its share of fp32's (`config.mlperf.MLPerfRules.accuracy_kept`)."""

    build: dict[str, float]
    fp32: dict[str, float]
    kept: dict[str, bool]


@dataclass(frozen=True)
class AccuracyCheck:
    """A build's scores against the fp32 eager model's on held-out samples."""

    build: str
    precision: str
    table_precision: str
    samples: int
    max_abs_diff: float
    auc: float  # the build's, on the rule's labels (`labels`)
    auc_fp32: float  # the fp32 eager model's on the same labels
    rule: str
    passed: bool
    data_auc: float | None = None  # the build's on the samples' own labels (an untrained model: ~0.5)
    data_auc_fp32: float | None = None
    # under a preset's MLPerf rule ([mlperf]): NE, accuracy and per-request AUC, the build's and fp32's
    mlperf: MLPerfMetrics | None = None
    # the rule's labels: "data", the held-out samples' own (a trained model, `--checkpoint`), or "teacher", drawn
    # from the fp32 model's ranking (an untrained model's: its AUC on the data's labels is ~0.5)
    labels: str = "teacher"

    @property
    def kept(self) -> float:
        """The share of the fp32 model's AUC this build keeps."""
        return self.auc / self.auc_fp32 if self.auc_fp32 else float("nan")

    def to_dict(self) -> JsonObject:
        return {
            "build": self.build,
            "precision": self.precision,
            "table_precision": self.table_precision,
            "samples": self.samples,
            "max_abs_score_diff": self.max_abs_diff,
            "auc": self.auc,
            "auc_fp32_eager": self.auc_fp32,
            "auc_relative_diff": abs(self.auc - self.auc_fp32) / self.auc_fp32,
            "labels": LABELS[self.labels],
            "auc_kept": self.kept,
            "passes_99_9": abs(self.auc - self.auc_fp32) <= AUC_RELATIVE_TOLERANCE * self.auc_fp32,
            "passes_99": abs(self.auc - self.auc_fp32) <= AUC_RELATIVE_TOLERANCE_99 * self.auc_fp32,
            "data_label_auc": self.data_auc,
            "data_label_auc_fp32_eager": self.data_auc_fp32,
            "mlperf_metrics": cast("JsonObject | None", self.mlperf),  # a TypedDict of JSON values
            "rule": self.rule,
            "passed": self.passed,
        }


# The served model is freshly initialised: its AUC on the data's labels is ~0.51, and a bf16 cast of the
# eager model moved it by 0.101% (kaggle, 16,384 samples): the 0.1% rule would be decided by near-ties.
# So the rule's labels are drawn from the fp32 model's own ranking with the skill of a trained CTR model:
# y ~ Bernoulli(sigmoid(TEACHER_SHARPNESS x standardised fp32 logit)), an fp32 AUC of ~0.89 on kaggle
# (above the 0.80 of Criteo's published DLRMs: the stricter test); a build then passes when it keeps the
# ranking that skill depends on (kaggle bf16: 0.065-0.071% of AUC lost, int8 tables 0.04%).
TEACHER_SHARPNESS = 2.5
LABELS = {
    "data": "the held-out samples' own labels (the served model was trained: --checkpoint)",
    "teacher": f"drawn from the untrained fp32 model's standardised logits at sharpness {TEACHER_SHARPNESS:g} "
    "(no --checkpoint: the data's labels cannot tell an untrained model's builds apart)",
}


def reference_labels(reference: np.ndarray, seed: int = 0) -> np.ndarray:
    """Labels drawn from the fp32 model's scores as a teacher of a trained model's skill (see above)."""
    p = np.clip(reference.astype(np.float64), 1e-7, 1 - 1e-7)
    logit = np.log(p / (1 - p))
    spread = logit.std()
    u = (logit - logit.mean()) / (spread if spread > 0 else 1.0)
    rng = np.random.default_rng(seed)
    return (rng.random(len(u)) < 1 / (1 + np.exp(-TEACHER_SHARPNESS * u))).astype(np.float32)


def check_accuracy(
    model: nn.Module,
    module: nn.Module,
    build: str,
    block: Any,
    *,
    precision: str,
    table_precision: str,
    labels: str = "teacher",
) -> AccuracyCheck:
    """`module` (a build of `model`) against the fp32 eager model on the samples of `block`: an fp32
    build (dense and tables) within FP32_SCORE_TOLERANCE per score; any other within
    AUC_RELATIVE_TOLERANCE of fp32's AUC, or, where the preset declares an MLPerf rule ([mlperf]: dlrmv3),
    within its share of fp32's NE, accuracy and per-request AUC. The rule's labels (`labels`): the samples'
    own ("data": a trained model), or drawn from the fp32 model's ranking ("teacher", `reference_labels`);
    the AUCs on the samples' own labels are recorded beside them either way."""
    if labels not in LABELS:
        raise ValueError(f"labels {labels!r}: one of {', '.join(LABELS)}")
    packed = serving_of(model.spec).check_samples(block)  # once, for both models
    reference = score_build(model, packed, "fp32")
    # the eager build at fp32 is the reference itself: its scores are not computed twice (the ranker's take seconds)
    scores = reference if module is model and precision == "fp32" else score_build(module, packed, precision)
    diff = float(np.abs(scores.astype(np.float64) - reference).max())
    data = np.asarray(block.labels, dtype=np.float32)
    data_ours, data_fp32 = auc(scores, data), auc(reference, data)
    if labels == "data":
        rule_labels, ours, fp32 = data, data_ours, data_fp32
    else:
        rule_labels = reference_labels(reference)
        ours, fp32 = auc(scores, rule_labels), auc(reference, rule_labels)
    rules, mlperf = getattr(model.spec, "mlperf", None), None  # only presets of an MLPerf benchmark declare one
    if precision == "fp32" and table_precision == "fp32":
        rule = f"fp32: every score within {FP32_SCORE_TOLERANCE:g} of the eager model's"
        passed = diff <= FP32_SCORE_TOLERANCE
    elif rules is not None:  # a ranker's requests: the per-request AUC groups each request's candidates
        from dlrm_lab.metrics.ranking import ranking_metrics

        candidates = np.asarray(block.candidate_lengths)
        build_metrics = ranking_metrics(scores, rule_labels, candidates)
        fp32_metrics = ranking_metrics(reference, rule_labels, candidates)
        mlperf = MLPerfMetrics(
            build=build_metrics, fp32=fp32_metrics, kept=rules.accuracy_kept(build_metrics, fp32_metrics)
        )
        rule, passed = rules.accuracy_rule, all(mlperf["kept"].values())
    else:
        rule = f"AUC within {AUC_RELATIVE_TOLERANCE:.1%} (relative) of the fp32 eager model's"
        passed = abs(ours - fp32) <= AUC_RELATIVE_TOLERANCE * fp32
    return AccuracyCheck(
        build,
        precision,
        table_precision,
        len(rule_labels),
        diff,
        ours,
        fp32,
        rule,
        bool(passed),
        data_ours,
        data_fp32,
        mlperf,
        labels,
    )
