"""An HSTU ranker's sample library: requests in time order (`infer.sut.SampleLibrary`).

A sample is one request, as in MLPerf's DLRMv3: one user's history and the candidates to
rank, scored together (one score per candidate). The library holds requests [0, n) of the
model's *evaluation* window (the later window a trained ranker serves), in time order, so
issuing library samples in order is issuing them in time order and a user's consecutive
requests appear as their histories grow. Packed as flat arrays:

    per request   user, step, history_lengths, history_starts, candidate_lengths, candidate_starts
    per history token   history_items, history_categories, history_actions, history_ages_s
    per candidate       candidate_items, candidate_categories, labels, click_probability

The server writes them to its snapshot and every instance and the serving process map them,
as the DLRM library's (`infer.library`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dlrm_lab.infer.library import LoadedSamples
from dlrm_lab.infer.serving_parts import Served, serving_of

REQUEST_ARRAYS = (
    "user",
    "step",
    "history_lengths",
    "history_starts",
    "candidate_lengths",
    "candidate_starts",
    "history_items",
    "history_categories",
    "history_actions",
    "history_ages_s",
    "candidate_items",
    "candidate_categories",
    "labels",
    "click_probability",
)
SERVED_WINDOW = "eval"


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the concatenated ranges [starts[k], starts[k] + lengths[k])."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()))


class RequestLibrary(LoadedSamples):
    """Requests packed flat (see the module docstring); `size` of them."""

    # REQUEST_ARRAYS, set by name in __init__
    user: np.ndarray
    step: np.ndarray
    history_lengths: np.ndarray
    history_starts: np.ndarray
    candidate_lengths: np.ndarray
    candidate_starts: np.ndarray
    history_items: np.ndarray
    history_categories: np.ndarray
    history_actions: np.ndarray
    history_ages_s: np.ndarray
    candidate_items: np.ndarray
    candidate_categories: np.ndarray
    labels: np.ndarray
    click_probability: np.ndarray

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        missing = [k for k in REQUEST_ARRAYS if k not in arrays]
        if missing:
            raise ValueError(f"request library: arrays {', '.join(missing)} missing")
        for k in REQUEST_ARRAYS:
            setattr(self, k, arrays[k])
        n = len(self.user)
        if not all(len(getattr(self, k)) == n for k in REQUEST_ARRAYS[:6]):
            raise ValueError("request library: the per-request arrays disagree on the number of requests")
        self._loaded = np.zeros(n, dtype=np.int64)

    @classmethod
    def from_block(cls, block: Any) -> RequestLibrary:
        """Pack a `data.sequences.RequestBlock`."""
        h, c = block.history_lengths.astype(np.int64), block.candidate_lengths.astype(np.int64)
        return cls(
            {
                "user": block.user.astype(np.int64),
                "step": block.step.astype(np.int64),
                "history_lengths": h,
                "history_starts": np.cumsum(h) - h,
                "candidate_lengths": c,
                "candidate_starts": np.cumsum(c) - c,
                "history_items": block.history_items.astype(np.int64),
                "history_categories": block.history_categories.astype(np.int64),
                "history_actions": block.history_actions.astype(np.int64),
                "history_ages_s": block.history_ages_s.astype(np.float32),
                "candidate_items": block.candidate_items.astype(np.int64),
                "candidate_categories": block.candidate_categories.astype(np.int64),
                "labels": block.labels.astype(np.float32),
                "click_probability": block.click_probability.astype(np.float32),
            }
        )

    @classmethod
    def generate(cls, spec: Any, seed: int, samples: int) -> RequestLibrary:
        """The first `samples` requests of the spec's evaluation window at `seed` (at most the
        window's: past its end the stream would start again with shorter histories)."""
        from dlrm_lab.data.sequences import SequenceGenerator  # imports torch

        gen = SequenceGenerator(spec.data, seed)
        n = min(samples, gen.num_requests(SERVED_WINDOW))
        return cls.from_block(gen.requests(0, n, SERVED_WINDOW))

    @property
    def size(self) -> int:
        return len(self.user)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in REQUEST_ARRAYS}

    def output_counts(self, offset: int, size: int) -> np.ndarray:
        """Scores each of requests [offset, offset + size) yields: one per candidate."""
        return self.candidate_lengths[offset : offset + size]

    def block(self, offset: int, size: int) -> Any:
        """Requests [offset, offset + size) as a RequestBlock."""
        return self.take(np.arange(offset, offset + size, dtype=np.int64))

    def gather(self, sizes: np.ndarray, offsets: np.ndarray) -> Any:
        """A batch of queries, query k being requests [offsets[k], offsets[k] + sizes[k]), as one RequestBlock."""
        return self.take(np.repeat(offsets - np.cumsum(sizes) + sizes, sizes) + np.arange(int(sizes.sum())))

    def take(self, requests: np.ndarray) -> Any:
        """These requests (library indices) as a RequestBlock, in the order given."""
        from dlrm_lab.data.sequences import RequestBlock

        h, c = self.history_lengths[requests], self.candidate_lengths[requests]
        tokens = _ragged(self.history_starts[requests], h)
        cands = _ragged(self.candidate_starts[requests], c)
        return RequestBlock(
            request=requests,
            user=self.user[requests],
            step=self.step[requests],
            history_lengths=h,
            history_items=self.history_items[tokens],
            history_categories=self.history_categories[tokens],
            history_actions=self.history_actions[tokens],
            history_ages_s=self.history_ages_s[tokens],
            candidate_lengths=c,
            candidate_items=self.candidate_items[cands],
            candidate_categories=self.candidate_categories[cands],
            labels=self.labels[cands],
            click_probability=self.click_probability[cands],
        )


def generate_library(served: Served[Any], seed: int, samples: int) -> LoadedSamples:
    """A served model's sample library, of its family's kind."""
    return serving_of(served.spec).sample_library(served, seed, samples)
