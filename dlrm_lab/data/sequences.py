"""Time-ordered synthetic requests for generative rankers (HSTU / MLPerf DLRMv3): users whose
histories grow over timestamps, items with popularity skew and categories, preferences that drift,
labels from a fixed teacher whose AUC is known.

In the spirit of MLPerf's streaming synthetic data (docs/hstu.md), written here for the lab:

- time is `timestamps` steps of `timestamp_s` seconds; at each step a fixed share of the users
  is active (exactly round(active_share x users) of them, chosen by a per-step permutation) and
  each active user meets a number of items ~ N(interactions_mean, interactions_sd);
- an item's category is one of the user's `interests` categories with probability
  `interest_share`, else any category; within a category the item follows a Zipf popularity
  (`item_popularity_alpha`); item id = category + categories x popularity rank;
- a user's rating of an item is (the item's base rating + the user's affinity to its category) / 2
  + N(0, rating_noise); the affinity drifts, a sine of period `drift_period` timestamps with a
  phase per (user, category); the label is rating >= 3.5 (the reference's rule);
- a request is (user, step): the user's history (everything met at earlier active steps, oldest
  first, the newest `max_history` kept), with each item's actions (seen; rating >= 3.5; >= 4.5;
  < 2.5) and age, and `candidates` items drawn the way the user meets items at that step, the
  first of which are the ones the user meets then (so they join the history of later requests).

Every value is a counter-based hash of (seed, what, user, step, item slot): a request depends only
on (spec, seed, its index), so any rank, shard or batch slices the same stream and memory is one
block of requests. Requests are in time order; training takes steps [warmup_timestamps,
train_timestamps), evaluation the later ones. The teacher's click probability of each candidate is
P(rating >= 3.5) given everything but the noise; its AUC on a calibration sample is the best any
model can reach.

For DLRMv4's layout (`spec.attributes`, `spec.crosses`, set by the preset's [model]):
- an item's attributes (artist, album) are functions of the item and the seed, each nested in the one
  before: an artist plays one category, an album is one artist's (`item_attributes`);
- each request has an hour of day and an organic flag (hashes of user and step; neither moves the
  rating), and one contextual id per cross table: a hash of the features its name crosses, taken from
  the request's anchor, its first candidate (the reference's one candidate: user_x_artist is the user
  and the anchor's artist; item_x_hour the anchor item and the hour), modulo the table's rows.
The rating does not read them: they carry what the item, its category and the user already carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, TypedDict, cast

import numpy as np
from scipy.special import ndtr, ndtri

from dlrm_lab.config.request_features import RequestFeatures, cross_keys
from dlrm_lab.config.sequence_spec import SequenceSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.synthetic import expected_auc
from dlrm_lab.errors import FieldError

LIKE_RATING = 3.5  # the reference's label: rating >= 3.5
ACTION_BITS = ("seen", "liked", "loved", "disliked")  # history action bits, lowest first
MAX_BLOCK_TOKENS = 1 << 20  # history tokens per generated block, about
CALIBRATION_REQUESTS = 2048

# what each hash stream is for
_ACTIVE, _COUNT, _CATEGORY, _INTEREST, _RANK, _ITEM_BASE, _AFFINITY, _PHASE, _NOISE, _INTERESTS = range(10)
_HOUR, _ORGANIC, _CROSS, _ATTRIBUTE = range(10, 14)
ORGANIC_SHARE = 0.5  # requests whose anchor the user found themselves (Yambda's is_organic)
_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64."""
    h = h + _M1
    h = (h ^ (h >> np.uint64(30))) * _M2
    h = (h ^ (h >> np.uint64(27))) * _M3
    return h ^ (h >> np.uint64(31))


def _hash(seed: int, stream: int, *keys: np.ndarray | int) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = _mix(np.asarray([(seed << 8) ^ stream], dtype=np.uint64))
        for k in keys:
            h = _mix(h ^ np.asarray(k).astype(np.uint64))
    return h


def _uniform(seed: int, stream: int, *keys: np.ndarray | int) -> np.ndarray:
    """Uniform in (0, 1), one per broadcast element of `keys`."""
    return ((_hash(seed, stream, *keys) >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


@dataclass
class RequestBlock:
    """Requests as flat numpy arrays; per-token arrays are concatenated over requests in order."""

    request: np.ndarray  # int64 [n] global request index
    user: np.ndarray  # int64 [n]
    step: np.ndarray  # int64 [n] timestamp index
    history_lengths: np.ndarray  # int64 [n]
    history_items: np.ndarray  # int64 [sum]
    history_categories: np.ndarray  # int64 [sum]
    history_actions: np.ndarray  # uint8 [sum] bitmask of ACTION_BITS
    history_ages_s: np.ndarray  # float64 [sum] seconds before the request
    candidate_lengths: np.ndarray  # int64 [n]
    candidate_items: np.ndarray  # int64 [sum]
    candidate_categories: np.ndarray  # int64 [sum]
    labels: np.ndarray  # float32 [sum]
    click_probability: np.ndarray  # float64 [sum] the teacher's
    # DLRMv4's layout only (None otherwise): each token's item attributes [sum, A] (artist, album) and each
    # request's cross-hash ids [n, K], named by `features`
    history_attributes: np.ndarray | None = None
    candidate_attributes: np.ndarray | None = None
    crosses: np.ndarray | None = None
    features: RequestFeatures | None = None  # None: DLRMv3's five (REQUEST_FEATURES)

    @property
    def size(self) -> int:
        return len(self.request)


class _Layout(TypedDict, total=False):
    """`RequestBlock`'s DLRMv4 fields, where a block has them."""

    history_attributes: np.ndarray
    candidate_attributes: np.ndarray
    crosses: np.ndarray
    features: RequestFeatures


class SequenceTeacher(TypedDict):
    """What `SequenceGenerator.teacher` measures on evaluation requests: the teacher's AUC (the best reachable),
    its mean click probability, the requests measured, and the AUC of a ranking by each part of the rating alone."""

    teacher_auc: float
    click_rate: float
    requests: int
    signal_auc: dict[str, float]


class SequenceGenerator:
    """Requests of `spec` for `seed` (see the module docstring)."""

    def __init__(self, spec: SequenceSpec, seed: int = 0) -> None:
        self.spec, self.seed = spec.check(), seed
        self._per_category = spec.items // spec.categories
        self._orders = [self._step_order(t) for t in range(spec.timestamps)]

    # ----------------------------------------------------------------- who is active when
    def _step_order(self, step: int) -> tuple[int, int, int]:
        """An affine permutation of the users for `step`: slot s -> (a s + b) mod U; the first
        `active_users` slots are the active users. Returns (a, b, a^-1 mod U)."""
        users = self.spec.users
        h = int(_hash(self.seed, _ACTIVE, step)[0])
        a = (h % users) | 1 if users > 1 else 1
        while math.gcd(a, users) != 1:
            a += 2
        b = (h >> 32) % users
        return a % users or 1, b, pow(a % users or 1, -1, users) if users > 1 else 0

    def _active(self, users: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Whether each (user, step) is active: its slot in that step's permutation is in front."""
        out = np.zeros(np.broadcast(users, steps).shape, dtype=bool)
        users, steps = np.broadcast_arrays(users, steps)
        for t in np.unique(steps):
            a, b, inv = self._orders[int(t)]
            sel = steps == t
            slot = ((users[sel] - b) % self.spec.users) * inv % self.spec.users
            out[sel] = slot < self.spec.active_users
        return out

    def _met(self, users: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """Items a user meets at a step when active (>= 1, at most the candidates)."""
        s = self.spec
        z = ndtri(_uniform(self.seed, _COUNT, users, steps))
        return np.clip(np.rint(s.interactions_mean + s.interactions_sd * z), 1, s.met_max).astype(np.int64)

    # ----------------------------------------------------------------- items and ratings
    def user_interests(self, users: np.ndarray) -> np.ndarray:
        """[n, interests] categories of each user's interests (distinct)."""
        s = self.spec
        start: np.ndarray = (_uniform(self.seed, _INTERESTS, users) * s.categories).astype(np.int64)
        stride: np.ndarray = 1 + (
            _uniform(self.seed, _INTERESTS, users, 1) * max(1, s.categories // s.interests)
        ).astype(np.int64)
        return (start[:, None] + stride[:, None] * np.arange(s.interests)) % s.categories

    def _items(self, users: np.ndarray, steps: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(item, category) met by each (user, step, slot)."""
        s = self.spec
        pick = _uniform(self.seed, _INTEREST, users, steps, slots)
        interests = self.user_interests(users)
        which: np.ndarray = (_uniform(self.seed, _CATEGORY, users, steps, slots) * s.interests).astype(np.int64)
        anywhere: np.ndarray = (_uniform(self.seed, _CATEGORY, users, steps, slots, 1) * s.categories).astype(np.int64)
        category = np.where(pick < s.interest_share, interests[np.arange(len(users)), which], anywhere)
        rank = _zipf_rank(_uniform(self.seed, _RANK, users, steps, slots), self._per_category, s.item_popularity_alpha)
        return category + s.categories * rank, category

    def item_attributes(self, items: np.ndarray, categories: np.ndarray) -> np.ndarray:
        """[n, A] each item's attribute ids (DLRMv4: artist, album), each nested in the one before it (the first
        in the item's category): parent + parent rows x (a hash of the item, below rows // parent rows), so an
        album is one artist's and an artist plays one category (the last rows mod parent rows stay unused: 0.78M
        of DLRMv4's 3.37M albums); a table with fewer rows than its parent takes the parent's id modulo its rows."""
        out: np.ndarray = np.empty((len(items), len(self.spec.attributes)), dtype=np.int64)
        parent, parent_rows = np.asarray(categories, dtype=np.int64), self.spec.categories
        for k, (_, rows) in enumerate(self.spec.attributes):
            if rows >= parent_rows:
                pick = _hash(self.seed, _ATTRIBUTE, k, items) % np.uint64(rows // parent_rows)
                ids = parent + parent_rows * pick.astype(np.int64)
            else:
                ids = parent % rows
            out[:, k] = ids
            parent, parent_rows = ids, rows
        return out

    def request_context(self, users: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hour of day, organic 0/1) of each request: hashes of (user, step), not read by the rating."""
        hour: np.ndarray = (_uniform(self.seed, _HOUR, users, steps) * 24).astype(np.int64)
        return hour, (_uniform(self.seed, _ORGANIC, users, steps) < ORGANIC_SHARE).astype(np.int64)

    def cross_ids(
        self, users: np.ndarray, steps: np.ndarray, anchors: np.ndarray, anchor_attributes: np.ndarray
    ) -> np.ndarray:
        """[n, K] each request's cross-hash ids: per cross table, a hash of the features its name crosses (the
        user, the anchor item and its attributes, the request's hour and organic flag) modulo its rows."""
        hour, organic = self.request_context(users, steps)
        values = {
            "user": users,
            "item": anchors,
            "hour": hour,
            "is_organic": organic,
            **{name: anchor_attributes[:, k] for k, name in enumerate(self.spec.attribute_names)},
        }
        out: np.ndarray = np.empty((len(users), len(self.spec.crosses)), dtype=np.int64)
        for j, (name, rows) in enumerate(self.spec.crosses):
            h = _hash(self.seed, _CROSS, j, *(values[key] for key in cross_keys(name)))
            out[:, j] = (h % np.uint64(rows)).astype(np.int64)
        return out

    def item_base(self, items: np.ndarray) -> np.ndarray:
        """Each item's base rating, in [1, 5]."""
        return 1.0 + 4.0 * _uniform(self.seed, _ITEM_BASE, items)

    def affinity(self, users: np.ndarray, categories: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """A user's affinity to a category at a step, in about [1, 5]: higher for their interests,
        drifting as a sine of the step."""
        return self._affinity_level(users, categories) + self._drift(users, categories, steps)

    def _affinity_level(self, users: np.ndarray, categories: np.ndarray) -> np.ndarray:
        """The part of `affinity` that does not drift."""
        interest = (self.user_interests(users) == categories[:, None]).any(axis=1)
        return np.where(interest, 3.0, 1.5) + 1.5 * _uniform(self.seed, _AFFINITY, users, categories)

    def _drift(self, users: np.ndarray, categories: np.ndarray, steps: Any) -> np.ndarray:
        """The sine part of `affinity`."""
        s = self.spec
        phase = 2 * math.pi * _uniform(self.seed, _PHASE, users, categories)
        return s.drift_amplitude * np.sin(2 * math.pi * np.asarray(steps, dtype=np.float64) / s.drift_period + phase)

    def _ratings(self, users, steps, slots, items, categories) -> tuple[np.ndarray, np.ndarray]:
        """(rating, the teacher's P(rating >= LIKE_RATING)) of each met item."""
        mean = (self.item_base(items) + self.affinity(users, categories, steps)) / 2
        noise = self.spec.rating_noise * ndtri(_uniform(self.seed, _NOISE, users, steps, slots))
        return mean + noise, ndtr((mean - LIKE_RATING) / self.spec.rating_noise)

    # ----------------------------------------------------------------- requests
    def num_requests(self, window: str = "train") -> int:
        first, stop = self.spec.window(window)
        return (stop - first) * self.spec.active_users

    def request_users(self, k: np.ndarray, window: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(user, step) of a window's requests `k` (indices within it), in time order."""
        first, _ = self.spec.window(window)
        steps: np.ndarray = first + k // self.spec.active_users
        users = np.empty_like(k)
        for t in np.unique(steps):
            a, b, _ = self._orders[int(t)]
            sel = steps == t
            users[sel] = (a * (k[sel] % self.spec.active_users) + b) % self.spec.users
        return users, steps

    def requests(self, start: int, stop: int, window: str = "train") -> RequestBlock:
        """Requests [start, stop) of `window` (indices past its end wrap around: epochs)."""
        total = self.num_requests(window)
        return self._blocks(np.arange(start, stop, dtype=np.int64) % total, window)

    def step_requests(self, step: int, start: int, stop: int) -> RequestBlock:
        """Requests [start, stop) of time step `step` (a step's requests are its active users, in the step's
        order; 0 <= start <= stop <= active_users)."""
        window = "train" if step < self.spec.train_timestamps else "eval"
        first, last = self.spec.window(window)
        if not (first <= step < last and 0 <= start <= stop <= self.spec.active_users):
            raise ValueError(f"step {step} requests [{start}, {stop}): outside the stream")
        k: np.ndarray = (step - first) * self.spec.active_users + np.arange(start, stop, dtype=np.int64)
        return self._blocks(k, window)

    def _blocks(self, k: np.ndarray, window: str) -> RequestBlock:
        parts = [self._block(k[i : i + self._block_size], window) for i in range(0, len(k), self._block_size)]
        return parts[0] if len(parts) == 1 else _concat(parts)

    @cached_property
    def _block_size(self) -> int:
        s = self.spec
        per_request = min(s.max_history, s.timestamps * s.interactions_mean * s.active_share) + s.candidates
        return int(max(16, MAX_BLOCK_TOKENS // max(1.0, per_request)))

    def _block(self, k: np.ndarray, window: str) -> RequestBlock:
        s = self.spec
        users, steps = self.request_users(k, window)
        # history: every earlier active step's met items, oldest first, the newest max_history kept
        past = np.arange(s.timestamps)[None, :]
        earlier = past < steps[:, None]
        active = self._active(users[:, None], past) & earlier
        met = np.where(active, self._met(users[:, None], past), 0)
        total = met.sum(axis=1)
        drop = np.maximum(total - s.max_history, 0)
        # token lists: (request, step, slot) per history item, then the oldest `drop` of each request cut
        rows, cols = np.nonzero(met)
        counts = met[rows, cols]
        req: np.ndarray = np.repeat(rows, counts)
        step_of: np.ndarray = np.repeat(cols, counts)
        slot = np.arange(len(req)) - np.repeat(np.cumsum(counts) - counts, counts)
        token = np.arange(len(req)) - np.repeat(np.concatenate([[0], np.cumsum(total)[:-1]]), total)
        keep = token >= drop[req]
        req, step_of, slot = req[keep], step_of[keep], slot[keep]
        h_users = users[req]
        h_items, h_cats = self._items(h_users, step_of, slot)
        rating, _ = self._ratings(h_users, step_of, slot, h_items, h_cats)
        actions = (1 | (rating >= LIKE_RATING) << 1 | (rating >= 4.5) << 2 | (rating < 2.5) << 3).astype(np.uint8)
        ages = (steps[req] - step_of).astype(np.float64) * s.timestamp_s
        # candidates: the request step's first `candidates` slots (its met items lead)
        c_req: np.ndarray = np.repeat(np.arange(len(k)), s.candidates)
        c_slot = np.tile(np.arange(s.candidates), len(k))
        c_users, c_steps = users[c_req], steps[c_req]
        c_items, c_cats = self._items(c_users, c_steps, c_slot)
        c_rating, prob = self._ratings(c_users, c_steps, c_slot, c_items, c_cats)
        layout: _Layout = {}
        if s.attributes or s.crosses:  # DLRMv4's layout
            c_attrs = self.item_attributes(c_items, c_cats)
            anchor: np.ndarray = np.arange(len(k)) * s.candidates  # each request's first candidate
            layout = _Layout(
                history_attributes=self.item_attributes(h_items, h_cats),
                candidate_attributes=c_attrs,
                crosses=self.cross_ids(users, steps, c_items[anchor], c_attrs[anchor]),
                features=s.features,
            )
        return RequestBlock(
            request=k,
            user=users,
            step=steps,
            history_lengths=total - drop,
            history_items=h_items,
            history_categories=h_cats,
            history_actions=actions,
            history_ages_s=ages,
            candidate_lengths=np.full(len(k), s.candidates, dtype=np.int64),
            candidate_items=c_items,
            candidate_categories=c_cats,
            labels=(c_rating >= LIKE_RATING).astype(np.float32),
            click_probability=prob,
            **layout,
        )

    # ----------------------------------------------------------------- the teacher
    @cached_property
    def teacher(self) -> SequenceTeacher:
        """The teacher's AUC (the best reachable) and label rate, on evenly spread evaluation requests."""
        total = self.num_requests("eval")
        chunk = max(1, min(total, CALIBRATION_REQUESTS) // 16)  # 16 runs of requests spread over the window
        starts = np.unique(np.linspace(0, total - chunk, 16).astype(np.int64))
        blocks = [self.requests(int(i), int(i) + chunk, "eval") for i in starts]
        probs = np.concatenate([b.click_probability for b in blocks])
        users = np.concatenate([np.repeat(b.user, b.candidate_lengths) for b in blocks])
        items = np.concatenate([b.candidate_items for b in blocks])
        cats = np.concatenate([b.candidate_categories for b in blocks])
        interest = (self.user_interests(users) == cats[:, None]).any(axis=1)
        base = self.item_base(items)
        # what each part of the rating is worth: AUC of a ranking by it alone, against the teacher's labels
        signals = {
            "item": scored_auc(base, probs),
            "item + interest": scored_auc(base + 3.0 * interest, probs),
            "item + affinity without drift": scored_auc(base + self._affinity_level(users, cats), probs),
        }
        return {
            "teacher_auc": expected_auc(probs),
            "click_rate": float(probs.mean()),
            "requests": len(starts) * chunk,
            "signal_auc": signals,
        }

    def describe(self) -> JsonObject:
        teacher = cast(JsonObject, self.teacher)  # a SequenceTeacher: its values are JSON's
        return {"source": "synthetic sequences", "seed": self.seed, "spec": self.spec.to_dict(), **teacher}


def _zipf_rank(u: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """Ranks in [0, n) with P(rank r) ~ (r + 1)^-alpha, by the continuous inverse CDF."""
    if n <= 1:
        return np.zeros(len(u), dtype=np.int64)
    if abs(alpha - 1.0) < 1e-9:
        x = np.power(n + 1.0, u)
    else:
        e = 1.0 - alpha
        x = np.power(1.0 + u * (np.power(n + 1.0, e) - 1.0), 1.0 / e)
    return np.clip(x.astype(np.int64) - 1, 0, n - 1)


def _concat(parts: list[RequestBlock]) -> RequestBlock:
    def joined(name: str) -> Any:
        first = getattr(parts[0], name)
        return first if first is None or name == "features" else np.concatenate([getattr(p, name) for p in parts])

    return RequestBlock(**{f.name: joined(f.name) for f in fields(RequestBlock)})


def with_overrides(spec: Any, overrides: tuple[str, ...] | list[str]) -> Any:
    """An HSTU preset with `--set key=value` applied to its [data] table (e.g. candidates=64,
    max_history=512), checked; the table rows stay the [model]'s."""
    from dataclasses import replace

    from dlrm_lab.data.spec import parse_override

    if not overrides:
        return spec
    changes: JsonObject = {}
    known = {f.name for f in fields(SequenceSpec)} - {"items", "categories", "attributes", "crosses"}
    for text in overrides:
        path, value = parse_override(text)
        if len(path) != 1 or path[0] not in known:
            raise FieldError("data_overrides", f"{text!r}: {spec.name}'s [data] keys are {', '.join(sorted(known))}")
        changes[path[0]] = value
    users = changes.get("users", 1)
    if not isinstance(users, int) or isinstance(users, bool) or not 1 <= users <= spec.shape.users:
        raise FieldError(
            "data_overrides", f"users={changes['users']!r}: must be 1 .. the user table's {spec.shape.users} rows"
        )
    return replace(spec, data=SequenceSpec.from_dict({**spec.data.to_dict(), **changes}, where="--set"))


def scored_auc(score: np.ndarray, p: np.ndarray) -> float:
    """Expected AUC of ranking by `score` when each item is positive with probability `p` (ties half)."""
    order = np.argsort(score, kind="stable")
    score, p = score[order], p[order]
    _, starts = np.unique(score, return_index=True)
    pos_g, neg_g = np.add.reduceat(p, starts), np.add.reduceat(1.0 - p, starts)
    neg_below = np.concatenate([[0.0], np.cumsum(neg_g)[:-1]])
    return float(np.sum(pos_g * (neg_below + 0.5 * neg_g)) / (p.sum() * (1.0 - p).sum()))
