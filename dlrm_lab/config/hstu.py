"""The HSTU ranker family (MLPerf DLRMv3): its shapes, its cost per request, and its presets.

A preset file of this family says `family = "hstu"` and holds two tables::

    name = "hstu-tiny"
    family = "hstu"
    description = "..."
    [model]            # RankerShape: table rows (items, categories, users), layers, dim, heads,
    items = 20000      # qk_dim, v_dim, hidden, position_buckets, time_buckets, dropouts
    ...
    [data]             # SequenceSpec (config/sequence_spec.py) without the table rows, which come from
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

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dlrm_lab.config.mlperf import HSTURecipe, MLPerfRules
from dlrm_lab.config.request_features import (
    CATEGORY_TABLE,
    RequestFeatures,
    Tables,
    candidate_feature,
    history_feature,
    tables_of,
)
from dlrm_lab.config.rules import row_scaler
from dlrm_lab.config.sequence_spec import SequenceSpec
from dlrm_lab.config.specs import TableSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError, UserError

ACTION_BITS = 5  # the reference's action weights 1, 2, 4, 8, 16: one bit per action type
ACTION_DIM = 8  # per action type


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

        def tower(i: int, h: int, o: int, last: bool = True) -> int:  # linear, swish norm, linear, norm
            return i * h + h + 2 * h + h * o + o + 2 * o * last

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

        def tower(i: int, o: int, h: int = hid) -> int:
            return 2 * (i * h + h * o)

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

        def scaled(key: str, rows: int) -> int | None:
            return pub.get(key) if pub.get(key, rows) != rows else None

        return (
            TableSpec(
                "item",
                s.items,
                s.stu.dim,
                (history_feature("item"), candidate_feature("item")),
                per_token,
                scaled("items", s.items),
            ),
            *(
                TableSpec(
                    name,
                    rows,
                    s.stu.dim,
                    (history_feature(name), candidate_feature(name)),
                    per_token,
                    scaled(name, rows),
                )
                for name, rows in s.attribute_tables
            ),
            TableSpec("user", s.users, s.stu.dim, ("user_id",), 1.0, scaled("users", s.users)),
            *(TableSpec(name, rows, s.stu.dim, (name,), 1.0, scaled(name, rows)) for name, rows in s.cross_tables),
        )

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

    def to_dict(self) -> JsonObject:
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
                shape[key] = tables_of(shape.get(key, ()))
            for key in ("item_tower", "head"):
                shape[key] = tuple(shape.get(key, ()))
            known = {f.name for f in fields(cls)} - {"shape", "data"}
            rest = {k: v for k, v in data.items() if k in known}
            if rest.get("mlperf") is not None:
                rest["mlperf"] = MLPerfRules.from_dict(rest["mlperf"], f"{where}: mlperf")
            recipe = rest.pop("reference", None) or {}
            rest["reference"] = HSTURecipe.from_dict(
                {k: v for k, v in recipe.items() if v not in (None, "")}, f"{where}: reference"
            )
            return cls(shape=RankerShape(**shape, stu=stu), data=SequenceSpec.from_dict(data["data"], where), **rest)
        except (KeyError, TypeError) as exc:
            raise UserError(f"{where}: not an HSTU spec ({exc})") from None


_SHAPE_KEYS = {f.name for f in fields(RankerShape)} - {"stu"} | {f.name for f in fields(STUShape)}
_TABLE_KEYS = ("item_tables", "cross_tables")  # [model.item_tables], [model.cross_tables]: name = rows
_TOWER_KEYS = ("item_tower", "head")  # [hidden, out]


def _parse_layout(model: JsonObject, where: str) -> dict[str, Any]:
    """[model]'s tables of tables and tower widths, checked: (name, rows) pairs and (hidden, out) pairs."""
    out: dict[str, Tables | tuple[int, ...]] = {}
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
        out[key] = tables_of(raw)
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
    for key, by in (
        ("items", "[model] items"),
        ("categories", "[model] categories"),
        ("attributes", "[model.item_tables]"),
        ("crosses", "[model.cross_tables]"),
    ):
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
        raise UserError(
            f"{where}: [model] item_tower ends at the width {shape.stu.dim} (dim) and head at 1: "
            f"got {tower_out} and {head_out}"
        )
    scale, scaled = row_scaler(where, table_scale, max_rows)
    published = {"items": shape.items, "users": shape.users, **dict(shape.item_tables), **dict(shape.cross_tables)}
    items = max(scaled(shape.items), shape.categories)
    users = scaled(shape.users)
    shape = replace(
        shape,
        items=items,
        users=users,
        item_tables=tuple((n, scaled(r)) for n, r in shape.item_tables),
        cross_tables=tuple((n, scaled(r)) for n, r in shape.cross_tables),
    )
    data_users = data.get("users", published["users"])
    if not isinstance(data_users, int) or not 1 <= data_users <= published["users"]:
        raise UserError(
            f"{where}: [data] users = {data_users!r}: must be 1 .. the user table's {published['users']} rows"
        )
    spec = SequenceSpec.from_dict(
        {
            **data,
            "items": items,
            "categories": shape.categories,
            "users": min(users, scaled(data_users)),
            "attributes": shape.item_tables,
            "crosses": shape.cross_tables,
        },
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
        reference=HSTURecipe.from_dict(raw.get("reference", {}), f"{where}: [reference]"),
    )
