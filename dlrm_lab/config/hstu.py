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

MLPerf Training's DLRMv4 (`models/dlrmv4.toml`) adds to [model]: `[model.item_tables]`, the item's
attribute tables looked up beside its id in the history and the candidates (artist, album; without
them the category is the one attribute, DLRMv3's `item_category` table), `[model.cross_tables]`,
contextual tokens after the user's, each a hash of the features its name crosses
(`user_x_artist_x_hour`: the user, the anchor's artist and its hour) modulo its rows, and the towers'
widths (`item_tower`, `head`); and a `[reference]` table, the published recipe (`HSTURecipe`). Every
table's rows scale alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dlrm_lab.config.rules import row_scaler
from dlrm_lab.config.specs import TableSpec
from dlrm_lab.errors import FieldError, UserError

WINDOWS = ("train", "eval")  # the requests a model trains on, and the later ones it is evaluated on
ACTION_BITS = 5  # the reference's action weights 1, 2, 4, 8, 16: one bit per action type
ACTION_DIM = 8  # per action type
CATEGORY_TABLE = "item_category"  # DLRMv3's one item attribute, when a preset names no item tables
# what a cross-hash table may cross, besides the item's attribute tables (DLRMv4: artist, album): the user, the
# anchor (the request's first candidate) item, the request's hour of day, and whether the anchor was organic
CROSS_KEYS = ("user", "item", "hour", "is_organic")

Tables = tuple[tuple[str, int], ...]  # (name, rows) in order


def history_feature(table: str) -> str:
    """A history token's id feature of an item table: item_id, item_category_id, artist_id."""
    return f"{table}_id"


def candidate_feature(table: str) -> str:
    """A candidate's id feature of an item table: item_candidate_id, item_candidate_category_id, ..._artist_id."""
    return "item_candidate_id" if table == "item" else f"item_candidate_{table.removeprefix('item_')}_id"


def cross_keys(name: str) -> tuple[str, ...]:
    """The features a cross-hash table's name crosses (`user_x_artist_x_hour` -> user, artist, hour)."""
    return tuple(name.split("_x_"))


@dataclass(frozen=True)
class RequestFeatures:
    """The sparse features of a request, in the order a batch lists them: per history token, per candidate,
    per request (the contextual tokens: the user, then each cross)."""

    history: tuple[str, ...]
    candidates: tuple[str, ...]
    contextual: tuple[str, ...]

    @classmethod
    def of(cls, attributes: tuple[str, ...], crosses: tuple[str, ...]) -> RequestFeatures:
        tables = ("item", *attributes)
        return cls(tuple(map(history_feature, tables)), tuple(map(candidate_feature, tables)), ("user_id", *crosses))

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.history, *self.candidates, *self.contextual)


def _tables(raw: Any) -> Tables:
    """(name, rows) pairs from a TOML table, a manifest's lists or pairs already."""
    items = raw.items() if isinstance(raw, dict) else raw
    return tuple((str(name), rows) for name, rows in items)


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
        need(integer(self.interactions_max) and self.interactions_max >= 0, "interactions_max",
             "an integer >= 0 (0: the candidates)")  # fmt: skip
        for name in ("attributes", "crosses"):
            for table, rows in getattr(self, name):
                need(isinstance(table, str) and table != "" and integer(rows) and rows >= 1, name,
                     "(name, rows >= 1) pairs")  # fmt: skip
        keys = {*CROSS_KEYS, *self.attribute_names}
        for table, _ in self.crosses:
            parts = cross_keys(table)
            if len(parts) < 2 or not set(parts) <= keys:
                raise UserError(f"{where}: cross table {table!r}: its name crosses two or more of "
                                f"{', '.join(sorted(keys))}, joined by _x_")  # fmt: skip
        return self

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "data") -> SequenceSpec:
        known = {f.name: f.type for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise UserError(f"{where}: unknown key {key!r}; allowed: {', '.join(known)}")
        tables = {k: _tables(raw[k]) for k in ("attributes", "crosses") if k in raw}
        return cls(**{**raw, **tables}).check(where)

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def active_users(self) -> int:
        """Users active at each step, and so requests per step."""
        return max(1, round(self.active_share * self.users))

    def window(self, name: str) -> tuple[int, int]:
        """Steps [first, stop) of the `train` or `eval` window."""
        if name not in WINDOWS:
            raise FieldError("window", f"{name!r}: allowed: {', '.join(WINDOWS)}")
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
    scale `items` and `users` down.

    DLRMv4's layout (MLPerf Training v6.1) grows it: `item_tables` replace the category table by the
    item's attributes (artist, album), each looked up for every history token and candidate, their
    embeddings concatenated into one content tower and, with the item's, into the item tower
    ((1 + attributes) x D in: 1,536 for DLRMv4); `cross_tables` add one contextual token each after the
    user's; `item_tower` and `head` give the towers' widths (hidden, out)."""

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
    item_tables: Tables = ()  # (name, rows): the item's attribute tables; (): the category table (DLRMv3)
    cross_tables: Tables = ()  # (name, rows): a contextual token each, after the user's
    item_tower: tuple[int, ...] = ()  # (hidden, out) widths; (): (dim, dim)
    head: tuple[int, ...] = ()  # (hidden, 1); (): (dim, 1)

    @property
    def attribute_tables(self) -> Tables:
        """The item's attribute tables (name, rows): DLRMv4's artist and album, or DLRMv3's category."""
        return self.item_tables or ((CATEGORY_TABLE, self.categories),)

    @property
    def contextual_tokens(self) -> int:
        """Tokens before the history: the user's and one per cross-hash table."""
        return 1 + len(self.cross_tables)

    @property
    def features(self) -> RequestFeatures:
        return RequestFeatures.of(tuple(n for n, _ in self.attribute_tables), tuple(n for n, _ in self.cross_tables))

    @property
    def tower_widths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The item tower's (hidden, out) and the head's (hidden, out)."""
        d = self.stu.dim
        return tuple(self.item_tower or (d, d)), tuple(self.head or (d, 1))  # type: ignore[return-value]

    @property
    def table_rows(self) -> dict[str, int]:
        return {"item": self.items, **dict(self.attribute_tables), "user": self.users, **dict(self.cross_tables)}

    @property
    def embedding_parameters(self) -> int:
        return sum(self.table_rows.values()) * self.stu.dim

    @property
    def dense_parameters(self) -> int:
        """Parameters outside the tables (weights and biases of every layer, norms counted)."""
        d, hid, s = self.stu.dim, self.hidden, self.stu
        (tower_hidden, tower_out), (head_hidden, head_out) = self.tower_widths
        attributes = len(self.attribute_tables)
        # linear, swish norm, linear, norm
        tower = lambda i, h, o, last=True: i * h + h + 2 * h + h * o + o + 2 * o * last  # noqa: E731
        action_in = ACTION_BITS * ACTION_DIM
        pre = tower(d, hid, d) + tower(attributes * d, hid, d) + tower(action_in, hid, d) + ACTION_BITS * ACTION_DIM
        pre += action_in + self.contextual_tokens * (d * d + d) + (self.position_buckets + self.time_buckets + 1) * d
        uvqk = d * s.heads * (2 * s.v_dim + 2 * s.qk_dim) + s.heads * (2 * s.v_dim + 2 * s.qk_dim)
        layer = 2 * d + uvqk + 2 * s.heads * s.v_dim + 3 * s.heads * s.v_dim * d
        post = d * d + d + 2 * d + tower((1 + attributes) * d, tower_hidden, tower_out)
        post += tower(d, head_hidden, head_out, last=False)
        return pre + self.layers * layer + post

    def request_flops_parts(self, history: int, candidates: int, *, path: str = "jagged") -> tuple[int, int, int]:
        """Forward FLOPs of one request of `history` items and `candidates` candidates, in three parts:
        the preprocessor (content towers per token, the contextual tokens' linears), the STU stack over
        (contextual tokens + history + candidates), and the head (candidate norm, item tower, MLP per candidate)."""
        d, hid = self.stu.dim, self.hidden
        (tower_hidden, tower_out), (head_hidden, head_out) = self.tower_widths
        attributes = len(self.attribute_tables)
        tower = lambda i, o, h=hid: 2 * (i * h + h * o)  # noqa: E731
        content = tower(d, d) + tower(attributes * d, d)  # the item's and its attributes'
        pre = history * (content + tower(ACTION_BITS * ACTION_DIM, d)) + candidates * content
        pre += self.contextual_tokens * 2 * d * d
        stack = self.layers * self.stu.layer_flops(self.contextual_tokens + history, candidates, path=path)
        head = 2 * d * d + tower((1 + attributes) * d, tower_out, tower_hidden) + tower(d, head_out, head_hidden)
        return pre, stack, candidates * head

    def request_flops(self, history: int, candidates: int, *, path: str = "jagged") -> int:
        """Forward FLOPs of one request (`request_flops_parts` summed)."""
        return sum(self.request_flops_parts(history, candidates, path=path))

    def request_lookup_bytes(self, history: int, candidates: int, bytes_per_value: float = 4.0) -> float:
        """Embedding rows read for one request: the item and its attributes per token, one row per contextual token."""
        rows = (1 + len(self.attribute_tables)) * (history + candidates) + self.contextual_tokens
        return rows * self.stu.dim * bytes_per_value


@dataclass(frozen=True)
class HSTURecipe:
    """A preset's published training recipe and target (its [reference] table). The keys DLRM presets have
    (`batch_size`, global; `dense_lr` at that batch; `target_auc`; `source`) mean what they mean there (the
    lab's `dense_lr_for` scales the rate to a run's batch); the rest are recorded as published:
    the optimizers and their settings, the warm-up and clipping, the evaluation cadence (a share of the
    training stream), the sequence budget `max_seq_len` the FLOP count charges (`reference_training_flops`),
    the published FLOPs per training sample, the mean samples to the target and the runs a result needs."""

    source: str = ""
    batch_size: int | None = None
    dense_lr: float | None = None
    target_auc: float | None = None
    dense_optimizer: str | None = None
    adam_betas: tuple[float, float] | None = None
    embedding_optimizer: str | None = None
    embedding_lr: float | None = None
    lr_warmup_steps: int | None = None
    grad_clip_norm: float | None = None
    eval_every_share: float | None = None
    max_seq_len: int | None = None
    flops_per_sample: float | None = None
    samples_to_target: float | None = None
    runs: int | None = None

    @classmethod
    def from_dict(cls, raw: Any, where: str = "[reference]") -> HSTURecipe:
        if not isinstance(raw, dict):
            raise UserError(f"{where}: must be a table")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - known):
            raise UserError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
        ints = {"batch_size", "lr_warmup_steps", "max_seq_len", "runs"}
        texts = {"source", "dense_optimizer", "embedding_optimizer"}
        out = dict(raw)
        for key, value in raw.items():
            if key in texts:
                ok = isinstance(value, str) and value != ""
            elif key == "adam_betas":
                ok = isinstance(value, list | tuple) and len(value) == 2 and all(_fraction(b) for b in value)
                out[key] = tuple(float(b) for b in value) if ok else value
            elif key in ints:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= (0 if "steps" in key else 1)
            else:
                ok = _number(value) and value > 0 and (key != "target_auc" or value < 1)
            if not ok:
                rule = ("a name" if key in texts else "two numbers in [0, 1)" if key == "adam_betas"
                        else "an integer >= 0" if key == "lr_warmup_steps" else "an integer >= 1" if key in ints
                        else "a number in (0, 1)" if key == "target_auc" else "a number > 0")  # fmt: skip
                raise UserError(f"{where}: {key} = {value!r}: must be {rule}")
        return cls(**out)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _fraction(v: Any) -> bool:
    return _number(v) and 0 <= v < 1


def reference_training_flops(shape: RankerShape, seq_len: int) -> float:
    """FLOPs of one training sample by MLPerf Training DLRMv4's own rule (mlcommons/training PR #889,
    recommendation_v4/README.MD "Computation cost analysis"; `_hstu_layer_flops` and `get_num_flops_per_sample` in
    its modules/dlrm_hstu.py), the figure its MFU divides by: 315.7 GFLOP at its shape.

    Counted, per STU layer, at `seq_len` positions S (its max_seq_len, 4,096: the padded budget, not a request's
    own tokens, which are at most 8 contextual + 4,086 history + 1 candidate = 4,095), 2 FLOPs per multiply-add:
    - the u/v/q/k projection, S x D x H (2 d_qk + 2 d_v) MACs, and the output projection, S x 3 H d_v x D MACs,
      each x3 for forward and backward (backward computes the input's and the weight's gradients);
    - attention, (S^2 / 2) x H (d_qk + d_v) MACs (two products, q k^T and scores v, over the causal half:
      its kernel skips the upper triangle), x3.5 for forward and backward (backward takes about five products);
    plus the task head's one D -> 1 product (x3). Left out, as the reference leaves them: embedding lookups and
    their all-to-all, norms and gating (elementwise), the preprocessor's towers, the item tower and the head's
    MLP (per candidate, not per position); the causal half is charged to the contextual tokens too.

    The lab's own count (`RankerShape.request_flops_parts`, x3 for training, `model.cost.sample_cost`) differs:
    it counts a request's own tokens and its valid (query, key) pairs, every part of the forward pass including
    the preprocessor's towers, and backward as twice forward on attention too (x3, not x3.5)."""
    s, d = shape.stu, shape.stu.dim
    macs_per_token = d * s.heads * (2 * s.qk_dim + 2 * s.v_dim) + 3 * s.heads * s.v_dim * d
    gemm = 2 * 3 * seq_len * macs_per_token
    attention = 2 * 3.5 * (seq_len * seq_len / 2) * s.heads * (s.qk_dim + s.v_dim)
    return shape.layers * (gemm + attention) + 2 * 3 * d


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
    reference: HSTURecipe = field(default_factory=HSTURecipe)  # the preset's [reference] (dlrmv4: MLPerf Training's)

    # What the training loop, the planner and the cost model read of any model spec (as ModelSpec has them).
    interaction = "hstu"

    @property
    def reference_batch_size(self) -> int | None:
        return self.reference.batch_size

    @property
    def reference_dense_lr(self) -> float | None:
        return self.reference.dense_lr

    @property
    def reference_target_auc(self) -> float | None:
        return self.reference.target_auc

    @property
    def reference_source(self) -> str:
        return self.reference.source

    @property
    def reference_flops_per_sample(self) -> float | None:
        """FLOPs per training sample by the reference's own rule (`reference_training_flops`), at its max_seq_len."""
        seq_len = self.reference.max_seq_len
        return reference_training_flops(self.shape, seq_len) if seq_len else None

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
        """The tables as the planner sees them (DLRMv3: item, item_category, user); a feature's "pooling factor"
        here is its mean ids per request (sequence features are not pooled, every id keeps its own row)."""
        per_token = (self.mean_history + float(self.data.candidates)) / 2  # its two features, history and candidates
        pub, s = self.published_rows, self.shape
        scaled = lambda key, rows: pub.get(key) if pub.get(key, rows) != rows else None  # noqa: E731
        return (
            TableSpec("item", s.items, s.stu.dim, (history_feature("item"), candidate_feature("item")), per_token,
                      scaled("items", s.items)),
            *(TableSpec(name, rows, s.stu.dim, (history_feature(name), candidate_feature(name)), per_token,
                        scaled(name, rows)) for name, rows in s.attribute_tables),
            TableSpec("user", s.users, s.stu.dim, ("user_id",), 1.0, scaled("users", s.users)),
            *(TableSpec(name, rows, s.stu.dim, (name,), 1.0, scaled(name, rows)) for name, rows in s.cross_tables),
        )  # fmt: skip

    def check_table_precision(self, table_precision: str) -> None:
        """The ranker's sequence tables are fp32 only (training, serving and building alike)."""
        if table_precision != "fp32":
            raise FieldError("table_precision", f"{table_precision}: {self.name}'s tables are fp32 here")

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
            for key in ("item_tables", "cross_tables"):
                shape[key] = _tables(shape.get(key, ()))
            for key in ("item_tower", "head"):
                shape[key] = tuple(shape.get(key, ()))
            known = {f.name for f in fields(cls)} - {"shape", "data"}
            rest = {k: v for k, v in data.items() if k in known}
            if rest.get("mlperf") is not None:
                rest["mlperf"] = MLPerfRules.from_dict(rest["mlperf"], f"{where}: mlperf")
            recipe = rest.pop("reference", None) or {}
            rest["reference"] = HSTURecipe.from_dict({k: v for k, v in recipe.items() if v not in (None, "")},
                                                     f"{where}: reference")  # fmt: skip
            return cls(shape=RankerShape(**shape, stu=stu), data=SequenceSpec.from_dict(data["data"], where), **rest)
        except (KeyError, TypeError) as exc:
            raise UserError(f"{where}: not an HSTU spec ({exc})") from None


_SHAPE_KEYS = {f.name for f in fields(RankerShape)} - {"stu"} | {f.name for f in fields(STUShape)}
_TABLE_KEYS = ("item_tables", "cross_tables")  # [model.item_tables], [model.cross_tables]: name = rows
_TOWER_KEYS = ("item_tower", "head")  # [hidden, out]


def _parse_layout(model: dict[str, Any], where: str) -> dict[str, Any]:
    """[model]'s tables of tables and tower widths, checked: (name, rows) pairs and (hidden, out) pairs."""
    out: dict[str, Any] = {}
    for key in _TABLE_KEYS:
        if key not in model:
            continue
        raw = model[key]
        if not isinstance(raw, dict) or not raw:
            raise UserError(f"{where}: [model.{key}] must be a table of name = rows")
        for name, rows in raw.items():
            if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
                raise UserError(f"{where}: [model.{key}] {name} = {rows!r}: must be an integer >= 1 (the table's rows)")
            if name in ("item", "user", CATEGORY_TABLE):
                raise UserError(f"{where}: [model.{key}] {name}: a name the ranker's own tables use")
        out[key] = _tables(raw)
    for key in _TOWER_KEYS:
        if key not in model:
            continue
        widths = model[key]
        if not isinstance(widths, list) or len(widths) != 2 or not all(isinstance(w, int) and w >= 1 for w in widths):
            raise UserError(f"{where}: [model] {key} = {widths!r}: must be [hidden, out], two integers >= 1")
        out[key] = tuple(widths)
    return out


def parse_hstu(
    raw: dict[str, Any], *, where: str, table_scale: float | None = None, max_rows: int | None = None
) -> HSTUSpec:
    """An HSTU preset's parsed TOML -> HSTUSpec, scaled; each bad field is one UserError naming it."""
    allowed = {"name", "family", "description", "model", "data", "mlperf", "reference"}
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
    for key, by in (("items", "[model] items"), ("categories", "[model] categories"),
                    ("attributes", "[model.item_tables]"), ("crosses", "[model.cross_tables]")):  # fmt: skip
        if key in data:
            raise UserError(f"{where}: [data] {key}: set by {by} (the table's rows)")
    layout = _parse_layout(model, where)
    model = {k: v for k, v in model.items() if k not in layout}
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
        **layout,
    )
    (_, tower_out), (_, head_out) = shape.tower_widths
    if tower_out != shape.stu.dim or head_out != 1:
        raise UserError(f"{where}: [model] item_tower ends at the width {shape.stu.dim} (dim) and head at 1: "
                        f"got {tower_out} and {head_out}")  # fmt: skip
    scale, scaled = row_scaler(where, table_scale, max_rows)
    published = {"items": shape.items, "users": shape.users, **dict(shape.item_tables), **dict(shape.cross_tables)}
    items = max(scaled(shape.items), shape.categories)
    users = scaled(shape.users)
    shape = replace(shape, items=items, users=users, item_tables=tuple((n, scaled(r)) for n, r in shape.item_tables),
                    cross_tables=tuple((n, scaled(r)) for n, r in shape.cross_tables))  # fmt: skip
    data_users = data.get("users", published["users"])
    if not isinstance(data_users, int) or not 1 <= data_users <= published["users"]:
        raise UserError(
            f"{where}: [data] users = {data_users!r}: must be 1 .. the user table's {published['users']} rows"
        )
    spec = SequenceSpec.from_dict(
        {**data, "items": items, "categories": shape.categories, "users": min(users, scaled(data_users)),
         "attributes": shape.item_tables, "crosses": shape.cross_tables},
        where=f"{where}: [data]",
    )  # fmt: skip
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
        reference=HSTURecipe.from_dict(raw.get("reference", {}), f"{where}: [reference]"),
    )
