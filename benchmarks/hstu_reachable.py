"""How much of the HSTU teacher's AUC the requests themselves reveal (issue 17's open problem).

The generator's teacher knows every item's true base rating and every user's exact, drifting affinity
to each category, so its AUC (hstu-tiny: 0.9125) is the best reachable with unlimited data. A ranker
sees only the training window's labels and each request's history. This script scores the evaluation
window's requests with a hand-made estimator that uses exactly that:

- an item's empirical like rate over the training window (its candidates' labels and its appearances
  in histories with their "liked" bit), shrunk to the mean with weight K;
- plus, per candidate, the request's evidence of the user's affinity to the candidate's category: the
  history items of that category, their liked bit less their item's rate, weighted by recency (an
  exponential in age, `DECAY` timestamps), and how many there are;

and prints its AUC beside the teacher's parts. The ranker's AUC on the same requests is in
BENCHMARKS.md; what this estimator reaches is a reference a ranker can be held to.

    python benchmarks/hstu_reachable.py        # ~10 s
"""

from __future__ import annotations

import numpy as np
import torch
from common import header, results_path, write_results
from torchmetrics.functional.classification import binary_auroc

from dlrm_lab.config import load_any_preset
from dlrm_lab.data.sequences import SequenceGenerator

K = 3.0  # shrinkage of an item's empirical rate to the mean (pseudo-observations)
DECAY = 5.0  # timestamps: weight of a history item's evidence exp(-age / DECAY)


def auc(score: np.ndarray, labels: np.ndarray) -> float:
    return binary_auroc(torch.tensor(score), torch.tensor(labels).long()).item()


def main() -> None:
    spec = load_any_preset("hstu-tiny")
    gen = SequenceGenerator(spec.data, 0)
    train = gen.requests(0, gen.num_requests("train"), "train")
    ev = gen.requests(0, gen.num_requests("eval"), "eval")
    items = spec.shape.items
    liked = (train.history_actions >> 1) & 1
    seen = np.bincount(train.candidate_items, minlength=items) + np.bincount(train.history_items, minlength=items)
    likes = np.bincount(train.candidate_items, weights=train.labels, minlength=items) + np.bincount(
        train.history_items, weights=liked, minlength=items
    )
    rate = (likes + K * train.labels.mean()) / (seen + K)
    item_logit = np.log(rate / (1 - rate))
    # per candidate: recency-weighted residual like rate and count of the history items of its category
    evidence = np.zeros(len(ev.candidate_items))
    same = np.zeros(len(ev.candidate_items))
    h0 = np.cumsum(ev.history_lengths) - ev.history_lengths
    c0 = np.cumsum(ev.candidate_lengths) - ev.candidate_lengths
    for r in range(ev.size):
        h = slice(h0[r], h0[r] + ev.history_lengths[r])
        cats = ev.history_categories[h]
        resid = ((ev.history_actions[h] >> 1) & 1) - rate[ev.history_items[h]]
        w = np.exp(-ev.history_ages_s[h] / spec.data.timestamp_s / DECAY)
        for j in range(c0[r], c0[r] + ev.candidate_lengths[r]):
            m = cats == ev.candidate_categories[j]
            same[j] = m.sum()
            evidence[j] = (resid[m] * w[m]).sum() / (w[m].sum() + 1.0)
    scores = {
        "true item base (the teacher's item part)": auc(gen.item_base(ev.candidate_items), ev.labels),
        "empirical item rate": auc(item_logit[ev.candidate_items], ev.labels),
        "empirical item rate + history evidence + same-category count": auc(
            item_logit[ev.candidate_items] + 4 * evidence + 0.1 * np.log1p(same), ev.labels
        ),
    }
    out = {**header(), "preset": "hstu-tiny", "eval_requests": ev.size,
           "teacher_auc": gen.teacher["teacher_auc"], "teacher_parts": gen.teacher["signal_auc"],
           "estimators": scores, "K": K, "decay_timestamps": DECAY}  # fmt: skip
    for name, value in scores.items():
        print(f"{value:.4f}  {name}")
    print(f"{out['teacher_auc']:.4f}  the teacher")
    write_results(results_path("hstu_reachable"), out)


if __name__ == "__main__":
    main()
