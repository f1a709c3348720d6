"""A ranker's accuracy metrics as MLPerf's DLRMv3 reference computes them.

The reference (mlcommons/inference `recommendation/dlrm_v3/accuracy.py`, through its `MetricsLogger`)
scores LoadGen's accuracy log with torchrec's metric computations: lifetime NE, accuracy at a 0.5 threshold
and GAUC, the AUC of each request's candidates averaged over the requests that have both labels and not
all scores equal. The same torchrec functions compute them here, over every candidate at once, in
float32 as the reference logs them (fbgemm's jagged-to-dense has no float64).
"""

from __future__ import annotations

from typing import Any

import numpy as np

ETA = 1e-12  # torchrec's NE clamp


def ranking_metrics(scores: Any, labels: Any, candidates: Any) -> dict[str, float]:
    """NE, accuracy and per-request AUC (`auc`, torchrec's GAUC) of `scores` (probabilities, one per
    candidate, requests in order) against 0/1 `labels`; `candidates` per request, summing to the scores."""
    import torch
    from torchrec.metrics.accuracy import compute_accuracy_sum
    from torchrec.metrics.gauc import compute_window_auc, get_auc_states
    from torchrec.metrics.ne import compute_cross_entropy, compute_ne

    p = torch.from_numpy(np.asarray(scores, dtype=np.float32)).view(1, -1)
    y = torch.from_numpy(np.asarray(labels, dtype=np.float32)).view(1, -1)
    lengths = torch.from_numpy(np.asarray(candidates, dtype=np.int64))
    if int(lengths.sum()) != p.shape[1] or p.shape != y.shape:
        raise ValueError(f"{p.shape[1]} scores, {y.shape[1]} labels and {int(lengths.sum())} candidates disagree")
    w = torch.ones_like(p)
    ce = compute_cross_entropy(y, p, w, ETA).sum(-1)
    ne = compute_ne(ce, w.sum(-1), (y * w).sum(-1), ((1 - y) * w).sum(-1), ETA)
    accuracy = compute_accuracy_sum(y, p, w) / w.sum(-1)
    states = get_auc_states(y, p, w, lengths)
    auc = compute_window_auc(states["auc_sum"], states["num_samples"])["gauc"]
    return {"ne": float(ne.item()), "accuracy": float(accuracy.item()), "auc": float(auc.item())}
