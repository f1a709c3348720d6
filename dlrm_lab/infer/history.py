"""History reuse for the HSTU ranker: a user's encoded history kept across their requests.

A request's history tokens attend only to earlier tokens (`model.hstu.valid_attention`), so each
STU layer's keys and values of a history prefix do not depend on what follows it. An instance
keeps, per user, every layer's keys and values of [user token, history...] from the user's last
request (`HistoryCache`); when the next request's history starts with the cached items, only
the newer items and the candidates are encoded, attending to the cached keys and values
(`HSTURanker.forward_after_prefix`), as a transformer's KV cache does. MLPerf's DLRMv3 rules
allow it.

It is not free of error: the cached tokens keep the positions and ages they had when they were
encoded (the ranker counts positions back from the newest item and ages from the request time),
so reused scores differ a little from full ones. `reuse_accuracy` measures what that costs
(AUC with and without reuse on the same requests); the serving records count the hits.

A cache is one instance's: co-located instances each hold their own, so a user's requests hit
only when they reach the instance that served the previous one. Bounded in bytes, least recently
used first out.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch


@dataclass
class _Entry:
    items: np.ndarray  # the history items encoded (oldest first)
    keys: list[torch.Tensor]  # per layer [H, 1 + items, d_qk]
    values: list[torch.Tensor]  # per layer [H, 1 + items, d_v]
    nbytes: int


@dataclass
class HistoryCache:
    """Per user: each STU layer's keys and values of the user token and history at their last request."""

    max_bytes: int
    entries: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def prefix(self, user: int, items: np.ndarray) -> _Entry | None:
        """The user's cached encoding when it is a prefix of `items` (their history now), else None."""
        entry = self.entries.get(user)
        ok = (
            entry is not None
            and len(entry.items) <= len(items)
            and np.array_equal(items[: len(entry.items)], entry.items)
        )
        if ok:
            self.entries.move_to_end(user)
            self.hits += 1
            return entry
        self.misses += 1
        return None

    def store(self, user: int, items: np.ndarray, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        old = self.entries.pop(user, None)
        if old is not None:
            self.bytes -= old.nbytes
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values)) + items.nbytes
        if nbytes > self.max_bytes:
            return
        self.entries[user] = _Entry(items.copy(), keys, values, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, gone = self.entries.popitem(last=False)
            self.bytes -= gone.nbytes
            self.evictions += 1


def score_requests(
    model: Any, block: Any, cache: HistoryCache | None, device: torch.device | None = None
) -> tuple[torch.Tensor, np.ndarray]:
    """Logits of every candidate of `block`'s requests (flat, request by request) and, per request,
    the history tokens reused from `cache` (0 on a miss; zeros without a cache). Call under
    inference mode; the model's layers must be in eval mode."""
    from dlrm_lab.data.request_batches import RequestBatch

    device = device or torch.device("cpu")
    if cache is None:
        batch = RequestBatch.from_block(block).to(device)
        return model(*batch.model_inputs()), np.zeros(block.size, dtype=np.int64)
    h = block.history_lengths
    starts = np.cumsum(h) - h
    entries = [
        cache.prefix(int(u), block.history_items[s : s + n]) for u, s, n in zip(block.user, starts, h, strict=True)
    ]
    reused = np.array([0 if e is None else len(e.items) for e in entries], dtype=np.int64)
    # only the history after each cached prefix is looked up and encoded
    keep = np.arange(int(h.sum())) - np.repeat(starts, h) >= np.repeat(reused, h)
    tail = replace(
        block,
        history_lengths=h - reused,
        history_items=block.history_items[keep],
        history_categories=block.history_categories[keep],
        history_actions=block.history_actions[keep],
        history_ages_s=block.history_ages_s[keep],
    )
    batch = RequestBatch.from_block(tail).to(device)
    prefix = torch.tensor([0 if e is None else 1 + len(e.items) for e in entries], dtype=torch.long, device=device)
    shape = model.shape.stu
    p = int(prefix.max())
    dtype = next(model.layers.parameters()).dtype  # a build's keys and values are in its precision
    keys = [torch.zeros(block.size, shape.heads, p, shape.qk_dim, dtype=dtype, device=device) for _ in model.layers]
    values = [torch.zeros(block.size, shape.heads, p, shape.v_dim, dtype=dtype, device=device) for _ in model.layers]
    for i, e in enumerate(entries):
        if e is not None:
            for layer in range(len(keys)):
                keys[layer][i, :, : e.keys[layer].shape[1]] = e.keys[layer]
                values[layer][i, :, : e.values[layer].shape[1]] = e.values[layer]
    logits, new_keys, new_values = model.forward_after_prefix(*batch.model_inputs(), prefix, keys, values)
    # keep each request's user token and history, prefix and new, for the user's next request
    for i, e in enumerate(entries):
        new = 1 + int(h[i]) - int(prefix[i])  # history tokens encoded now (with the user token on a miss)
        ks = [k[i, :, :new] for k in new_keys]
        vs = [v[i, :, :new] for v in new_values]
        if e is not None:
            ks = [torch.cat([a, b], dim=1) for a, b in zip(e.keys, ks, strict=True)]
            vs = [torch.cat([a, b], dim=1) for a, b in zip(e.values, vs, strict=True)]
        else:
            ks, vs = [k.clone() for k in ks], [v.clone() for v in vs]
        cache.store(int(block.user[i]), block.history_items[starts[i] : starts[i] + h[i]], ks, vs)
    return logits, reused


def reuse_accuracy(model: Any, library: Any, batch: int = 64, cache_mb: float = 1024.0) -> dict[str, float]:
    """Scores of the library's requests in time order, `batch` at a time, without and with history
    reuse: the AUC of each against the labels, the largest score difference, and the hit rate."""
    from torchmetrics.functional.classification import binary_auroc

    cache = HistoryCache(int(cache_mb * 1e6))
    full, reused, labels, hits, tokens = [], [], [], 0, 0
    model.eval()
    with torch.inference_mode():
        for lo in range(0, library.size, batch):
            block = library.block(lo, min(batch, library.size - lo))
            full.append(torch.sigmoid(score_requests(model, block, None)[0]).numpy())
            logits, n = score_requests(model, block, cache)
            reused.append(torch.sigmoid(logits).numpy())
            labels.append(block.labels)
            hits += int((n > 0).sum())
            tokens += int(n.sum())
    full_s, reused_s, y = np.concatenate(full), np.concatenate(reused), np.concatenate(labels)
    target = torch.from_numpy(y).long()
    return {
        "requests": library.size,
        "hit_rate": hits / library.size,
        "reused_history_share": tokens / max(1, int(library.history_lengths.sum())),
        "auc_full": binary_auroc(torch.from_numpy(full_s), target).item(),
        "auc_reused": binary_auroc(torch.from_numpy(reused_s), target).item(),
        "max_score_difference": float(np.abs(full_s - reused_s).max()),
    }
