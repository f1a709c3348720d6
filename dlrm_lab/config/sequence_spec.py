"""The time-ordered request stream an HSTU preset's [data] table describes (`SequenceSpec`): its users, items and
categories, the time steps and the train and eval windows over them, each request's candidates and history budget,
and the interests, drift, noise and popularity the generator (data/sequences.py) draws from; checked once, with
the item attribute and cross tables that [model] sets.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from dlrm_lab.config.request_features import CATEGORY_TABLE, CROSS_KEYS, RequestFeatures, Tables, cross_keys, tables_of
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError, UserError

WINDOWS = ("train", "eval")  # the requests a model trains on, and the later ones it is evaluated on


@dataclass(frozen=True)
class SequenceSpec:
    """The generator's parameters (a preset's [data] table); `check()` names a bad one."""

    users: int = 1000
    items: int = 100_000
    categories: int = 32
    timestamps: int = 100  # steps of time in all
    train_timestamps: int = 90  # steps [warmup_timestamps, train_timestamps) train, the rest evaluate
    warmup_timestamps: int = 10  # steps before the first request (histories start filled)
    timestamp_s: float = 86400.0
    active_share: float = 0.7
    interactions_mean: float = 20.0
    interactions_sd: float = 5.0
    candidates: int = 32
    max_history: int = 4096
    interests: int = 4
    interest_share: float = 0.8
    item_popularity_alpha: float = 1.05
    rating_noise: float = 0.5
    drift_amplitude: float = 1.0
    drift_period: float = 30.0  # timestamps
    # items an active user meets at a step, at most (0: the candidates, so every item met is one of the request's
    # candidates, as in DLRMv3's generator); more lets histories outgrow few candidates (DLRMv4: one a request)
    interactions_max: int = 0
    # the model's item attribute tables (name, rows) beside the category (DLRMv4: artist, album), and its cross-hash
    # contextual tables; set by [model], not [data]
    attributes: Tables = ()
    crosses: Tables = ()

    def check(self, where: str = "data") -> SequenceSpec:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise UserError(f"{where}: {name} = {getattr(self, name)!r}: {rule}")

        def integer(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("users", "items", "categories", "timestamps", "candidates", "max_history", "interests"):
            need(integer(getattr(self, name)) and getattr(self, name) >= 1, name, "an integer >= 1")
        for name in ("train_timestamps", "warmup_timestamps"):
            need(integer(getattr(self, name)), name, "an integer")
        for f in fields(self):
            if f.type in ("float", float):
                v = getattr(self, f.name)
                need(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v), f.name, "a number")
        need(self.items >= self.categories, "items", f"at least one per category ({self.categories})")
        need(self.interests <= self.categories, "interests", f"at most the categories ({self.categories})")
        need(0 <= self.warmup_timestamps < self.train_timestamps, "warmup_timestamps", "0 .. train_timestamps - 1")
        need(self.train_timestamps < self.timestamps, "train_timestamps", f"below timestamps ({self.timestamps})")
        need(0 < self.active_share <= 1, "active_share", "in (0, 1]")
        need(0 <= self.interest_share <= 1, "interest_share", "in [0, 1]")
        need(self.interactions_mean >= 1 and self.interactions_sd >= 0, "interactions_mean", ">= 1 (sd >= 0)")
        need(self.rating_noise > 0, "rating_noise", "> 0")
        need(self.item_popularity_alpha > 0, "item_popularity_alpha", "> 0")
        need(self.drift_period > 0 and self.drift_amplitude >= 0, "drift_period", "> 0 (amplitude >= 0)")
        need(self.timestamp_s > 0, "timestamp_s", "> 0")
        need(
            integer(self.interactions_max) and self.interactions_max >= 0,
            "interactions_max",
            "an integer >= 0 (0: the candidates)",
        )
        for name in ("attributes", "crosses"):
            for table, rows in getattr(self, name):
                need(
                    isinstance(table, str) and table != "" and integer(rows) and rows >= 1,
                    name,
                    "(name, rows >= 1) pairs",
                )
        keys = {*CROSS_KEYS, *self.attribute_names}
        for table, _ in self.crosses:
            parts = cross_keys(table)
            if len(parts) < 2 or not set(parts) <= keys:
                raise UserError(
                    f"{where}: cross table {table!r}: its name crosses two or more of "
                    f"{', '.join(sorted(keys))}, joined by _x_"
                )
        return self

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "data") -> SequenceSpec:
        known = {f.name: f.type for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise UserError(f"{where}: unknown key {key!r}; allowed: {', '.join(known)}")
        given: dict[str, Any] = {**raw, **{k: tables_of(raw[k]) for k in ("attributes", "crosses") if k in raw}}
        return cls(**given).check(where)

    @property
    def attribute_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.attributes)

    @property
    def features(self) -> RequestFeatures:
        """A request's features in the batch's order (DLRMv3's five without attribute and cross tables)."""
        attributes = self.attribute_names or (CATEGORY_TABLE,)
        return RequestFeatures.of(attributes, tuple(name for name, _ in self.crosses))

    @property
    def met_max(self) -> int:
        """Items an active user meets at a step, at most."""
        return self.interactions_max or self.candidates

    def to_dict(self) -> JsonObject:
        return asdict(self)

    @property
    def active_users(self) -> int:
        """Users active at each step, and so requests per step."""
        return max(1, round(self.active_share * self.users))

    def window(self, name: str) -> tuple[int, int]:
        """Steps [first, stop) of the `train` or `eval` window."""
        if name not in WINDOWS:
            raise FieldError("window", f"{name!r}: allowed: {', '.join(WINDOWS)}")
        return (
            (self.warmup_timestamps, self.train_timestamps)
            if name == "train"
            else (self.train_timestamps, self.timestamps)
        )
