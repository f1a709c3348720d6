"""The HSTU ranker family (MLPerf DLRMv3): its shapes, its cost per request, and its presets.

A preset file of this family says `family = "hstu"` and holds two tables::

    name = "hstu-tiny"
    family = "hstu"
    description = "..."
    [model]            # RankerShape: table rows (items, categories, users), layers, dim, heads,
    items = 20000      # qk_dim, v_dim, hidden, position_buckets, time_buckets, dropouts
    ...
    [data]             # SequenceSpec (the generator's, data/sequences.py) without the table rows, which come from
    candidates = 16    # [model]; `users` may be fewer than the user table's rows
    ...
    [mlperf]           # optional, MLPerfRules: the Server bound and the accuracy rule of an MLPerf benchmark
    server_latency_ms = 80
    ...

`--table-scale` multiplies the item and user rows (the model's tables and the data's catalogue
alike) and `--max-rows` caps them; the 128 categories stay. The default shapes are MLPerf
Inference v6.0's DLRMv3 (docs/hstu.md, with sources).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dlrm_lab.config.rules import row_scaler
from dlrm_lab.config.specs import TableSpec
from dlrm_lab.errors import UserError

WINDOWS = ("train", "eval")  # the requests a model trains on, and the later ones it is evaluated on
ACTION_BITS = 5  # the reference's action weights 1, 2, 4, 8, 16: one bit per action type
ACTION_DIM = 8  # per action type


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
        return self

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "data") -> SequenceSpec:
        known = {f.name: f.type for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise UserError(f"{where}: unknown key {key!r}; allowed: {', '.join(known)}")
        return cls(**raw).check(where)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def active_users(self) -> int:
        """Users active at each step, and so requests per step."""
        return max(1, round(self.active_share * self.users))

    def window(self, name: str) -> tuple[int, int]:
        """Steps [first, stop) of the `train` or `eval` window."""
        if name not in WINDOWS:
            raise UserError(f"--window {name!r}: allowed: {', '.join(WINDOWS)}")
        return (self.warmup_timestamps, self.train_timestamps) if name == "train" else (
            self.train_timestamps, self.timestamps)  # fmt: skip


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
        return cls(bench, float(bound), float(share), {k: float(ref[k]) for k in MLPERF_METRICS},
                   str(raw.get("source", "")))  # fmt: skip

    @property
    def accuracy_rule(self) -> str:
        return (f"MLPerf {self.benchmark}: NE, accuracy and per-request AUC each within {self.accuracy_share:.1%} of "
                "the fp32 eager model's")  # fmt: skip

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


def attention_pairs(history: int, candidates: int) -> int:
    """Valid (query, key) pairs of one request: causal history with the diagonal, plus
    each candidate against the history and itself."""
    return history * (history + 1) // 2 + candidates * (history + 1)


@dataclass(frozen=True)
class STUShape:
    dim: int = 512  # model width D (the embedding dim)
    heads: int = 4
    qk_dim: int = 128  # per head
    v_dim: int = 128  # per head (u too)

    def layer_flops(self, history: int, candidates: int, *, path: str = "jagged") -> int:
        """Forward FLOPs (2 per multiply-add) of one layer for one request: the two
        projections per token and the two attention products per valid pair (`jagged`) or
        per padded pair (`padded`: n^2)."""
        n = history + candidates
        h, dqk, dv, d = self.heads, self.qk_dim, self.v_dim, self.dim
        pairs = attention_pairs(history, candidates) if path == "jagged" else n * n
        projections = 2 * n * d * h * (2 * dv + 2 * dqk) + 2 * n * 3 * h * dv * d
        return projections + 2 * h * (dqk + dv) * pairs


@dataclass(frozen=True)
class RankerShape:
    """A DLRMv3-style ranker: item, category and user tables, `layers` STU layers. The
    defaults are MLPerf Inference v6.0's DLRMv3 (docs/hstu.md), which no small machine holds:
    scale `items` and `users` down."""

    items: int = 1_000_000_000
    categories: int = 128
    users: int = 10_000_000
    layers: int = 5
    stu: STUShape = STUShape()
    hidden: int = 256  # the preprocessor's MLPs
    position_buckets: int = 8192
    time_buckets: int = 2048
    input_dropout: float = 0.2
    layer_dropout: float = 0.1

    @property
    def table_rows(self) -> dict[str, int]:
        return {"item": self.items, "item_category": self.categories, "user": self.users}

    @property
    def embedding_parameters(self) -> int:
        return sum(self.table_rows.values()) * self.stu.dim

    @property
    def dense_parameters(self) -> int:
        """Parameters outside the tables (weights and biases of every layer, norms counted)."""
        d, hid, s = self.stu.dim, self.hidden, self.stu
        tower = lambda i, o: i * hid + hid + 2 * hid + hid * o + o + 2 * o  # noqa: E731  (linear, norm, linear, norm)
        action_in = ACTION_BITS * ACTION_DIM
        pre = 2 * tower(d, d) + tower(action_in, d) + ACTION_BITS * ACTION_DIM + action_in + d * d + d
        pre += (self.position_buckets + self.time_buckets + 1) * d
        uvqk = d * s.heads * (2 * s.v_dim + 2 * s.qk_dim) + s.heads * (2 * s.v_dim + 2 * s.qk_dim)
        layer = 2 * d + uvqk + 2 * s.heads * s.v_dim + 3 * s.heads * s.v_dim * d
        post = d * d + d + 2 * d + (2 * d * d + d + 2 * d + d * d + d + 2 * d) + (d * d + d + 2 * d + d + 1)
        return pre + self.layers * layer + post

    def request_flops_parts(self, history: int, candidates: int, *, path: str = "jagged") -> tuple[int, int, int]:
        """Forward FLOPs of one request of `history` items and `candidates` candidates, in three parts:
        the preprocessor (content towers per token, the user's contextual token), the STU stack over
        (user + history + candidates), and the head (candidate norm, item tower, MLP per candidate)."""
        d, hid = self.stu.dim, self.hidden
        tower = lambda i, o: 2 * (i * hid + hid * o)  # noqa: E731
        pre = history * (2 * tower(d, d) + tower(ACTION_BITS * ACTION_DIM, d)) + candidates * 2 * tower(d, d)
        pre += 2 * d * d
        stack = self.layers * self.stu.layer_flops(1 + history, candidates, path=path)
        post = candidates * 2 * (d * d + 2 * d * d + d * d + d * d + d)
        return pre, stack, post

    def request_flops(self, history: int, candidates: int, *, path: str = "jagged") -> int:
        """Forward FLOPs of one request (`request_flops_parts` summed)."""
        return sum(self.request_flops_parts(history, candidates, path=path))

    def request_lookup_bytes(self, history: int, candidates: int, bytes_per_value: float = 4.0) -> float:
        """Embedding rows read for one request: item and category per token, one user row."""
        return (2 * (history + candidates) + 1) * self.stu.dim * bytes_per_value


@dataclass(frozen=True)
class HSTUSpec:
    """One HSTU preset resolved and scaled: the ranker's shape and its data generator's spec."""

    name: str
    shape: RankerShape
    data: SequenceSpec
    description: str = ""
    source: str = ""
    table_scale: float = 1.0
    max_rows: int | None = None
    published_rows: dict[str, int] = field(default_factory=dict)  # before scaling
    family: str = "hstu"
    mlperf: MLPerfRules | None = None  # the preset's [mlperf] rules (dlrmv3: MLPerf Inference's dlrm-v3)

    # What the training loop, the planner and the cost model read of any model spec (as ModelSpec has them).
    interaction = "hstu"
    reference_batch_size = reference_dense_lr = reference_target_auc = None
    reference_source = ""

    @property
    def num_parameters(self) -> int:
        return self.shape.embedding_parameters + self.shape.dense_parameters

    @property
    def embedding_parameters(self) -> int:
        return self.shape.embedding_parameters

    @property
    def dense_parameters(self) -> int:
        return self.shape.dense_parameters

    @property
    def tables(self) -> tuple[TableSpec, ...]:
        """The three tables as the planner sees them; a feature's "pooling factor" here is its
        mean ids per request (sequence features are not pooled, every id keeps its own row)."""
        history, cands = self.mean_history, float(self.data.candidates)
        pub = self.published_rows
        s = self.shape
        return (
            TableSpec("item", s.items, s.stu.dim, ("item_id", "item_candidate_id"), (history + cands) / 2,
                      pub.get("items") if pub.get("items") != s.items else None),
            TableSpec("item_category", s.categories, s.stu.dim, ("item_category_id", "item_candidate_category_id"),
                      (history + cands) / 2),
            TableSpec("user", s.users, s.stu.dim, ("user_id",), 1.0,
                      pub.get("users") if pub.get("users") != s.users else None),
        )  # fmt: skip

    def check_table_precision(self, table_precision: str) -> None:
        """The ranker's sequence tables are fp32 only (training, serving and building alike)."""
        if table_precision != "fp32":
            raise UserError(f"--table-precision {table_precision}: {self.name}'s tables are fp32 here")

    @property
    def mean_history(self) -> float:
        """Mean history items of a training request (steps warmup..train, users active at a share)."""
        return self.mean_history_of("train")

    def mean_history_of(self, window: str) -> float:
        """Mean history items of a request of `window` (train; eval: the later requests a server scores)."""
        d = self.data
        first, stop = d.window(window)
        steps = (first + stop - 1) / 2  # the window's mean step
        return min(float(d.max_history), steps * d.active_share * d.interactions_mean)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["num_parameters"] = self.num_parameters
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HSTUSpec:
        """The spec of `to_dict`'s form (a run's manifest), checked as a preset is."""
        where = f"model spec {data.get('name', '?')}"
        try:
            shape = dict(data["shape"])
            stu = STUShape(**shape.pop("stu"))
            known = {f.name for f in fields(cls)} - {"shape", "data"}
            rest = {k: v for k, v in data.items() if k in known}
            if rest.get("mlperf") is not None:
                rest["mlperf"] = MLPerfRules.from_dict(rest["mlperf"], f"{where}: mlperf")
            return cls(shape=RankerShape(**shape, stu=stu), data=SequenceSpec.from_dict(data["data"], where), **rest)
        except (KeyError, TypeError) as exc:
            raise UserError(f"{where}: not an HSTU spec ({exc})") from None


_SHAPE_KEYS = {f.name for f in fields(RankerShape)} - {"stu"} | {f.name for f in fields(STUShape)}


def parse_hstu(
    raw: dict[str, Any], *, where: str, table_scale: float | None = None, max_rows: int | None = None
) -> HSTUSpec:
    """An HSTU preset's parsed TOML -> HSTUSpec, scaled; each bad field is one UserError naming it."""
    allowed = {"name", "family", "description", "model", "data", "mlperf"}
    unknown = set(raw) - allowed
    if unknown:
        raise UserError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(allowed))}"
        )
    model, data = raw.get("model", {}), raw.get("data", {})
    if not isinstance(model, dict) or not isinstance(data, dict):
        raise UserError(f"{where}: [model] and [data] must be tables")
    bad = set(model) - _SHAPE_KEYS
    if bad:
        raise UserError(
            f"{where}: [model] unknown key(s) {', '.join(sorted(bad))}; allowed: {', '.join(sorted(_SHAPE_KEYS))}"
        )
    for key in ("items", "categories"):
        if key in data:
            raise UserError(f"{where}: [data] {key}: set by [model] {key} (the table's rows)")
    stu_keys = {f.name for f in fields(STUShape)}
    for key, value in model.items():
        ok = (
            isinstance(value, int) and value >= 1
            if "dropout" not in key
            else isinstance(value, int | float) and 0 <= value < 1
        )
        if not ok:
            rule = "a number in [0, 1)" if "dropout" in key else "an integer >= 1"
            raise UserError(f"{where}: [model] {key} = {value!r}: must be {rule}")
    shape = RankerShape(
        **{k: v for k, v in model.items() if k not in stu_keys},
        stu=STUShape(**{k: v for k, v in model.items() if k in stu_keys}),
    )
    scale, scaled = row_scaler(where, table_scale, max_rows)
    published = {"items": shape.items, "users": shape.users}
    items = max(scaled(shape.items), shape.categories)
    users = scaled(shape.users)
    shape = replace(shape, items=items, users=users)
    data_users = data.get("users", published["users"])
    if not isinstance(data_users, int) or not 1 <= data_users <= published["users"]:
        raise UserError(
            f"{where}: [data] users = {data_users!r}: must be 1 .. the user table's {published['users']} rows"
        )
    spec = SequenceSpec.from_dict(
        {**data, "items": items, "categories": shape.categories, "users": min(users, scaled(data_users))},
        where=f"{where}: [data]",
    )
    return HSTUSpec(
        name=raw.get("name", Path(where).stem),
        shape=shape,
        data=spec,
        description=raw.get("description", ""),
        source=where,
        table_scale=scale,
        max_rows=max_rows,
        published_rows=published,
        mlperf=MLPerfRules.from_dict(raw["mlperf"], f"{where}: [mlperf]") if "mlperf" in raw else None,
    )
