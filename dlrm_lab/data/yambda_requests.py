"""Yambda's events into requests, user by user: the rule (`YambdaOptions`) by which one user's time-ordered events
become one request per (user, window), and the state held for the user while their events stream by.

The rule (MLPerf DLRMv4's streaming windows; every number an option of `YambdaOptions`):

- time is cut into windows of `window_s` seconds (default a day, the reference's streaming window);
  window `step` = timestamp x timestamp_unit_s // window_s, written per request so that a protocol can
  train on window T and evaluate on T + 1;
- a request is one (user, window) with at least one listen: its candidates are the window's listens in
  time order (the first `max_candidates`), label 1 when played_ratio_pct >= `listen_plus_pct` (the
  reference's listen+) or, with `like_is_positive`, when the user likes the same item later in the
  window; its history is the user's events of earlier windows (never the window's own), oldest first,
  the newest `max_history` kept; a request with fewer than `min_history` of them is dropped;
- history tokens are listens, likes and dislikes (unlikes and undislikes are counted, not kept), their
  action bits YAMBDA_ACTION_BITS (the ranker's five), their ages in seconds before the request's
  first listen;
- click_probability is NaN: real data has no teacher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import cast

import numpy as np

from dlrm_lab.data.request_files import ROW_GROUP_REQUESTS
from dlrm_lab.data.yambda_events import DISLIKE, LIKE, LISTEN, Events
from dlrm_lab.errors import FieldError

# history action bits, lowest first: the synthetic requests' four (sequences.ACTION_BITS) with Yambda's
# meanings, and is_organic in the ranker's fifth
YAMBDA_ACTION_BITS = ("listened", "listen+ or liked", "liked", "disliked", "organic")


@dataclass(frozen=True)
class YambdaOptions:
    """The conversion's rule (module docstring) and its bounds (data/yambda.py's); `check()` names a bad one."""

    window_s: int = 86_400
    timestamp_unit_s: int = 1
    max_history: int = 4096
    max_candidates: int = 32
    min_history: int = 1
    listen_plus_pct: int = 50
    like_is_positive: bool = True
    first_window: int | None = None  # windows whose requests are written (histories use all earlier events)
    last_window: int | None = None
    unmapped: str = "error"  # an event's item without a category: "error" or "drop" (its events)
    batch_rows: int = 65_536
    chunk_events: int = 50_000_000
    buffer_tokens: int = 1 << 24
    row_group_requests: int = ROW_GROUP_REQUESTS

    def check(self) -> YambdaOptions:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("like_is_positive", "unmapped") or (f.name.endswith("_window") and v is None):
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise FieldError(f.name, f"{v!r}: must be an integer")
        for name in (
            "window_s",
            "timestamp_unit_s",
            "max_history",
            "max_candidates",
            "batch_rows",
            "chunk_events",
            "buffer_tokens",
            "row_group_requests",
        ):
            if getattr(self, name) < 1:
                raise FieldError(name, f"{getattr(self, name)}: must be >= 1")
        if not 0 <= self.min_history <= self.max_history:
            raise FieldError(
                "min_history",
                f"{self.min_history}: must be in 0 .. {{max_history}} ({self.max_history})",
                "max_history",
            )
        if self.listen_plus_pct < 0:
            raise FieldError("listen_plus_pct", f"{self.listen_plus_pct}: must be >= 0 (a share of the track, %)")
        if self.unmapped not in ("error", "drop"):
            raise FieldError("unmapped", f"{self.unmapped!r}: allowed: error, drop")
        lo, hi = self.first_window, self.last_window
        if lo is not None and hi is not None and hi < lo:
            raise FieldError("last_window", f"{hi}: before {{first_window}} ({lo})", "first_window")
        return self

    def wanted(self, step: int) -> bool:
        return (self.first_window is None or step >= self.first_window) and (
            self.last_window is None or step <= self.last_window
        )


@dataclass
class YambdaRequest:
    user: int
    step: int
    history: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # items, categories, actions, ages_s
    candidates: tuple[np.ndarray, np.ndarray, np.ndarray]  # items, categories, labels

    @property
    def tokens(self) -> int:
        return len(self.history[0]) + len(self.candidates[0])


def _actions(ev: Events, listen_plus_pct: int) -> np.ndarray:
    """YAMBDA_ACTION_BITS of each event."""
    listen, like = ev.code == LISTEN, ev.code == LIKE
    bits = [listen, (listen & (ev.played >= listen_plus_pct)) | like, like, ev.code == DISLIKE, ev.organic]
    return sum(b.astype(np.uint8) << i for i, b in enumerate(bits)).astype(np.uint8)


class YambdaUser:
    """One user's state while their events stream by: the history of closed windows (newest max_history),
    the open window's newest max_history history events and its first max_candidates listens."""

    def __init__(self, uid: int, opts: YambdaOptions, emit: Callable[[YambdaRequest], None], counts: dict[str, int]):
        self.uid, self.opts, self.emit, self.counts = uid, opts, emit, counts
        empty: np.ndarray = np.zeros(0, dtype=np.int64)
        self.hist: tuple[np.ndarray, ...] = (
            empty,
            empty,
            np.zeros(0, dtype=np.uint8),
            empty,
        )  # items, categories, actions, timestamps
        self.win: tuple[np.ndarray, ...] = self.hist
        self.step: int | None = None
        self.cands: list[np.ndarray] = [empty, empty, np.zeros(0, dtype=np.float32), empty]  # items, cats, labels, ts
        self.cand_seq = empty  # each candidate's place in the user's events (a like marks only earlier listens)
        self.seen = 0

    @property
    def tokens(self) -> int:
        return len(self.hist[0]) + len(self.win[0]) + len(self.cands[0])

    def feed(self, ev: Events) -> None:
        """Events of this user, in time order."""
        steps: np.ndarray = ev.ts * self.opts.timestamp_unit_s // self.opts.window_s
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(steps)) + 1, [len(steps)]])
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            step = int(steps[a])
            if self.step is not None and step != self.step:
                self.close()
            self.step = step
            self._add(ev.take(slice(a, b)), step)
        self.counts["peak_state_tokens"] = max(self.counts["peak_state_tokens"], self.tokens)

    def _add(self, ev: Events, step: int) -> None:
        """Events of the open window, `step` (`self.step`)."""
        o, n = self.opts, len(ev.ts)
        seq: np.ndarray = self.seen + np.arange(n)
        self.seen += n
        kept = ev.code <= DISLIKE
        self.counts["unlike_undislike_events"] += int(n - kept.sum())
        h = ev.take(kept)
        self.win = tuple(
            np.concatenate([w, v])[-o.max_history :]
            for w, v in zip(self.win, (h.item, h.cat, _actions(h, o.listen_plus_pct), h.ts), strict=True)
        )
        if not o.wanted(step):
            return
        listens = np.flatnonzero(ev.code == LISTEN)
        room = o.max_candidates - len(self.cands[0])
        self.counts["candidates_over_max"] += max(0, len(listens) - room)
        take = listens[: max(0, room)]
        new = (ev.item[take], ev.cat[take], (ev.played[take] >= o.listen_plus_pct).astype(np.float32), ev.ts[take])
        self.cands = [np.concatenate([c, v]) for c, v in zip(self.cands, new, strict=True)]
        self.cand_seq = np.concatenate([self.cand_seq, seq[take]])
        if o.like_is_positive:
            for i in np.flatnonzero(ev.code == LIKE):
                self.cands[2][(self.cands[0] == ev.item[i]) & (self.cand_seq < seq[i])] = 1.0

    def close(self) -> None:
        """End the open window: its request (if it has one), then its events join the history."""
        o = self.opts
        if len(self.cands[0]):
            if len(self.hist[0]) >= o.min_history:
                now = self.cands[3][0]
                ages = ((now - self.hist[3]) * o.timestamp_unit_s).astype(np.float32)
                step = cast(int, self.step)  # set: a window with candidates was fed (`feed`)
                history = (self.hist[0], self.hist[1], self.hist[2], ages)
                self.emit(YambdaRequest(self.uid, step, history, (self.cands[0], self.cands[1], self.cands[2])))
            else:
                self.counts["requests_short_history"] += 1
        self.hist = tuple(np.concatenate([h, w])[-o.max_history :] for h, w in zip(self.hist, self.win, strict=True))
        self.win = tuple(w[:0] for w in self.win)
        self.cands = [c[:0] for c in self.cands]
        self.cand_seq = self.cand_seq[:0]
