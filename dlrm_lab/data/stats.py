"""What a dataset really holds, compared with the spec it was generated from.

Per feature: samples, lookups, unique ids, share of lookups on the top 1% of the
table's rows, the fitted Zipf exponent, mean and p99 pooling factor; per dataset the
label rate. Each measured value that the spec predicts is checked against a tolerance
and flagged when outside it, so a generator bug (or a mislabelled dataset) shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrm_lab.data.distributions import expected_pooling, expected_top_share, fit_zipf_alpha
from dlrm_lab.data.parquet import dataset_files, read_dataset_info
from dlrm_lab.data.spec import DataSpec
from dlrm_lab.errors import UserError

ALPHA_TOLERANCE = 0.05  # absolute, on the fitted Zipf exponent
TOP_SHARE_TOLERANCE = 0.05  # absolute, on the top-1% share
POOLING_RELATIVE_TOLERANCE = 0.02


@dataclass
class Check:
    feature: str
    quantity: str
    measured: float
    expected: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return abs(self.measured - self.expected) <= self.tolerance


def dataset_stats(path: str | Path) -> dict[str, Any]:
    """Measure every feature of a dataset; compare with its stored spec where it has one."""
    info = read_dataset_info(path)
    files = dataset_files(path)
    spec = DataSpec.from_dict(info["data_spec"]) if info.get("data_spec") else None
    rows_of = {f.name: f.rows for f in spec.features} if spec else {}
    if not rows_of and info.get("model"):
        rows_of = {f: t["num_embeddings"] for t in info["model"]["tables"] for f in t["feature_names"]}
    try:
        labels = pq.read_table(files, columns=["label"]).column("label").to_numpy()
    except Exception as exc:  # noqa: BLE001 - any read failure is a bad dataset
        raise UserError(f"{path}: cannot read column label ({str(exc).splitlines()[0]})") from None
    n = len(labels)
    if n == 0:
        raise UserError(f"{path}: the dataset has no rows")
    schema_names = pq.read_schema(files[0]).names
    feature_names = [c for c in schema_names if c not in ("label", "dense")]
    features, checks = [], []
    for name in feature_names:
        col = pq.read_table(files, columns=[name]).column(name)
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        ids = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        rows = rows_of.get(name, int(ids.max()) + 1 if ids.size else 1)
        counts = np.bincount(ids, minlength=rows) if ids.size else np.zeros(rows, dtype=np.int64)
        top = max(1, math.ceil(rows / 100))
        top_share = float(np.partition(counts, rows - top)[rows - top :].sum() / max(ids.size, 1))
        alpha = fit_zipf_alpha(counts)
        row = {
            "feature": name,
            "table_rows": rows,
            "samples": n,
            "lookups": int(ids.size),
            "unique_ids": int(np.count_nonzero(counts)),
            "top1pct_share": top_share,
            "zipf_alpha_fit": alpha,
            "pooling_mean": float(lengths.mean()),
            "pooling_p99": float(np.percentile(lengths, 99)),
        }
        features.append(row)
        if spec is not None:
            checks.extend(_feature_checks(spec, name, row, lengths, rows, top))
    label_rate = float(labels.mean())
    if spec is not None:
        # the teacher was calibrated on a sample: allow its error beside binomial noise
        p = spec.click_rate
        checks.append(Check("(labels)", "label rate", label_rate, p, 4 * math.sqrt(p * (1 - p) / n) + 0.05 * p))
    return {
        "path": str(path),
        "source": info.get("source", "unknown"),
        "samples": n,
        "label_rate": label_rate,
        "teacher_auc": (info.get("teacher") or {}).get("teacher_auc"),
        "features": features,
        "checks": checks,
    }


def _feature_checks(spec: DataSpec, name: str, row: dict[str, Any], lengths: np.ndarray, rows: int, top: int):
    by_name = {f.name: f for f in spec.features}
    if name not in by_name:
        return [Check(name, "present in spec", 0.0, 1.0, 0.0)]
    f = by_name[name]
    out = []
    mean = expected_pooling(f.pooling)
    sem = float(lengths.std()) / math.sqrt(len(lengths))
    out.append(Check(name, "pooling mean", row["pooling_mean"], mean, 4 * sem + POOLING_RELATIVE_TOLERANCE * mean))
    if f.drift_every is None:  # drift moves the hot rows: the overall share is not the spec's
        share = expected_top_share(f.ids, rows, top)
        if share is not None:
            out.append(Check(name, "top-1% share", row["top1pct_share"], share, TOP_SHARE_TOLERANCE))
        if f.ids["distribution"] == "zipf" and row["zipf_alpha_fit"] is not None:
            out.append(Check(name, "zipf alpha", row["zipf_alpha_fit"], f.ids["alpha"], ALPHA_TOLERANCE))
    return out
