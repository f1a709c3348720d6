"""HSTU layers: the sequential transduction units of MLPerf's DLRMv3 ranker (issue 17).

A request is one user's history (a contextual token, then the interaction history, oldest
first) followed by the candidates to rank. One STU layer, as in the DLRMv3 reference
(docs/hstu.md gives the sources):

    xn = LayerNorm(x)                                  (eps 1e-6)
    u, v, q, k = split(xn W_uvqk + b)                  u = SiLU(u); heads of d_v, d_qk
    A_h = SiLU(q_h k_h^T / sqrt(d_qk)) / N  (masked)   no softmax; N: the batch's padded length
    a = concat_h(A_h v_h)
    x' = x + [u, a, u * LayerNorm(a)] W_out            (no bias)

The mask: history tokens attend causally (themselves and earlier tokens); each candidate
attends to the whole history and itself, never to other candidates; nothing attends to
padding. Dividing by the batch's longest sequence (not a softmax, not the request's own
length) is the reference's choice, so a request's scores depend slightly on its batch.

Two equivalent attention paths: `padded` (one [B, H, N, N] product, fast on CPU for
similar lengths) and `jagged` (each request at its own length, no work on padding). Their
agreement is tested; the lab measures which is faster.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_lab.config.hstu import ACTION_BITS, ACTION_DIM, HSTUSpec, RankerShape, STUShape, attention_pairs
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError

__all__ = ["HSTURanker", "RankerShape", "STULayer", "STUShape", "attention_pairs", "valid_attention"]

LAYER_NORM_EPS = 1e-6
ATTENTION_PATHS = ("padded", "jagged")


def valid_attention(lengths: torch.Tensor, candidates: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, N, N] bool: may query i attend to key j, for requests of `lengths` tokens whose
    last `candidates` tokens are candidates (N = max_len, positions beyond a length are padding)."""
    pos = torch.arange(max_len, device=lengths.device)
    history = (lengths - candidates).unsqueeze(1)  # [B, 1]
    # every candidate takes the same id, one past the history: it sees the history and itself only
    ids = torch.minimum(pos.unsqueeze(0), history)  # [B, N]
    real = pos.unsqueeze(0) < lengths.unsqueeze(1)  # [B, N]
    earlier = ids.unsqueeze(2) > ids.unsqueeze(1)  # key strictly before the query
    same = torch.eye(max_len, dtype=torch.bool, device=lengths.device).unsqueeze(0)
    return (earlier | same) & real.unsqueeze(2) & real.unsqueeze(1)


def prefix_attention(prefix: torch.Tensor, new: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """[B, T, P + T] bool, for requests whose first `prefix` tokens are already encoded and whose next
    `new` tokens are not, `history` tokens in all (user token and history; the rest are candidates):
    may new token t attend to prefix key j (j < prefix: always, every prefix token is earlier
    history) or to new key t' (the `valid_attention` rule on the tokens' places in the whole request)."""
    p, t = int(prefix.max()) if len(prefix) else 0, int(new.max()) if len(new) else 0
    jp = torch.arange(p, device=new.device)
    jt = torch.arange(t, device=new.device)
    real = jt.unsqueeze(0) < new.unsqueeze(1)  # [B, T]
    ids = torch.minimum(prefix.unsqueeze(1) + jt, history.unsqueeze(1))  # candidates share one id
    earlier = ids.unsqueeze(2) > ids.unsqueeze(1)
    same = torch.eye(t, dtype=torch.bool, device=new.device).unsqueeze(0)
    to_new = (earlier | same) & real.unsqueeze(2) & real.unsqueeze(1)
    to_prefix = (jp.unsqueeze(0) < prefix.unsqueeze(1)).unsqueeze(1) & real.unsqueeze(2)  # [B, T, P]
    return torch.cat([to_prefix, to_new], dim=2)


class STULayer(nn.Module):
    """One HSTU layer over padded [B, N, D] sequences (see the module docstring)."""

    def __init__(self, shape: STUShape | None = None, dropout: float = 0.1, attention: str = "padded") -> None:
        super().__init__()
        shape = shape or STUShape()
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention {attention!r}: allowed: {', '.join(ATTENTION_PATHS)}")
        self.shape, self.attention = shape, attention
        h, d = shape.heads, shape.dim
        self.input_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.uvqk = nn.Linear(d, h * (2 * shape.v_dim + 2 * shape.qk_dim))
        self.attn_norm = nn.LayerNorm(h * shape.v_dim, eps=LAYER_NORM_EPS)
        self.out = nn.Linear(3 * h * shape.v_dim, d, bias=False)
        self.dropout = nn.Dropout(dropout)
        nn.init.xavier_uniform_(self.uvqk.weight)
        nn.init.zeros_(self.uvqk.bias)
        nn.init.xavier_uniform_(self.out.weight)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """x [B, N, D]; lengths, candidates [B]. Padding positions come out as they went in."""
        n = x.shape[1]
        u, q, k, v = self._project(x)
        if self.attention == "padded":
            a = self._padded(q, k, v, lengths, candidates, n)
        else:
            a = self._jagged(q, k, v, lengths, candidates, n)
        return self._output(x, u, a, lengths)

    def forward_after_prefix(
        self,
        x: torch.Tensor,
        lengths: torch.Tensor,
        mask: torch.Tensor,
        prefix_k: torch.Tensor,
        prefix_v: torch.Tensor,
        n: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer over tokens that follow a prefix already encoded (history reuse): x [B, T, D] the new
        tokens, prefix_k/prefix_v [B, H, P, d] the prefix's keys and values at this layer, mask [B, T, P + T]
        (`prefix_attention`), n the normaliser the full sequences would have had. Returns the new tokens'
        output and their keys and values (for the cache)."""
        u, q, k, v = self._project(x)
        keys, values = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)
        scores = F.silu(q @ keys.transpose(-1, -2) / math.sqrt(self.shape.qk_dim)) / n
        a = (scores * mask.unsqueeze(1)) @ values
        return self._output(x, u, a, lengths), k, v

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """u [B, N, H dv] (SiLU'd), q, k [B, H, N, dqk], v [B, H, N, dv]."""
        b, n, _ = x.shape
        s = self.shape
        u, v, q, k = torch.split(
            self.uvqk(self.input_norm(x)),
            [s.heads * s.v_dim, s.heads * s.v_dim, s.heads * s.qk_dim, s.heads * s.qk_dim],
            dim=-1,
        )
        q = q.view(b, n, s.heads, s.qk_dim).transpose(1, 2)
        k = k.view(b, n, s.heads, s.qk_dim).transpose(1, 2)
        v = v.view(b, n, s.heads, s.v_dim).transpose(1, 2)
        return F.silu(u), q, k, v

    def _output(self, x: torch.Tensor, u: torch.Tensor, a: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        a = a.transpose(1, 2).reshape(b, n, self.shape.heads * self.shape.v_dim)
        y = self.out(self.dropout(torch.cat([u, a, u * self.attn_norm(a)], dim=-1)))
        real = (torch.arange(n, device=x.device).unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(2)
        return x + y * real

    def _padded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, candidates: torch.Tensor, n: int
    ) -> torch.Tensor:
        scores = F.silu(q @ k.transpose(-1, -2) / math.sqrt(self.shape.qk_dim)) / n
        mask = valid_attention(lengths, candidates, n).unsqueeze(1)  # [B, 1, N, N]
        return (scores * mask) @ v

    def _jagged(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, candidates: torch.Tensor, n: int
    ) -> torch.Tensor:
        """Each request at its own length: no product over padding (a loop over requests;
        fbgemm's jagged attention kernels are GPU-only)."""
        out = torch.zeros_like(v)
        for i, (length, cands) in enumerate(zip(lengths.tolist(), candidates.tolist(), strict=True)):
            qi, ki, vi = q[i, :, :length], k[i, :, :length], v[i, :, :length]
            scores = F.silu(qi @ ki.transpose(-1, -2) / math.sqrt(self.shape.qk_dim)) / n
            mask = valid_attention(lengths.new_tensor([length]), lengths.new_tensor([cands]), length)
            out[i, :, :length] = (scores * mask) @ vi
        return out


# ----------------------------------------------------------------------------- the ranker

HISTORY_FEATURES = ("item_id", "item_category_id")  # a request's history, oldest first
CANDIDATE_FEATURES = ("item_candidate_id", "item_candidate_category_id")


class SwishLayerNorm(nn.Module):
    """x * sigmoid(LayerNorm(x)), the reference's gated activation."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.norm(x))


def _tower(d_in: int, hidden: int, d_out: int, last: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), SwishLayerNorm(hidden), nn.Linear(hidden, d_out), last)


class HSTURanker(nn.Module):
    """Scores each candidate of each request from the user's history (see docs/hstu.md).

    Inputs, for B requests: `sparse` a KeyedJaggedTensor with, per request, its history's
    `item_id` and `item_category_id` (oldest first), its candidates' `item_candidate_id`
    and `item_candidate_category_id`, and `user_id` (one); `actions` the history's action
    bitmask per token and `ages_s` each history token's age in seconds at query time
    (both flat over the requests, in the history's order). Returns one logit per
    candidate, flat in request order.

    DLRMv4's layout (`shape.item_tables`, `shape.cross_tables`; `shape.features` names the features):
    the item's attributes (`artist_id`, `album_id` and their candidates') replace the category, their
    embeddings concatenated into one content tower (the reference's additional-embedding MLP) and, with
    the item's, into the item tower (1,536 -> 512 -> 512); each cross-hash feature is one more contextual
    token after the user's, each through its own linear (the reference's batched contextual linear).

    Left out of the reference: the hour-of-day and day-of-week features of the query time
    before the candidates' norm (constant in the reference's own synthetic data, where
    every timestamp is 1), and the contextual token's zeroing for short histories.
    """

    def __init__(
        self,
        shape: RankerShape | None = None,
        attention: str = "padded",
        device: str | torch.device = "cpu",
        table_device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        shape = shape or RankerShape()
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection

        self.shape = shape
        d, features = shape.stu.dim, shape.features
        history, candidates = features.history, features.candidates
        tables = ("item", *(name for name, _ in shape.attribute_tables))
        self.tables = EmbeddingCollection(
            tables=[
                *(
                    EmbeddingConfig(
                        name=name, num_embeddings=shape.table_rows[name], embedding_dim=d, feature_names=[h, c]
                    )
                    for name, h, c in zip(tables, history, candidates, strict=True)
                ),
                EmbeddingConfig(name="user", num_embeddings=shape.users, embedding_dim=d, feature_names=["user_id"]),
                *(
                    EmbeddingConfig(name=name, num_embeddings=rows, embedding_dim=d, feature_names=[name])
                    for name, rows in shape.cross_tables
                ),
            ],
            device=torch.device(table_device or device),
        )
        attributes = len(shape.attribute_tables)
        (tower_hidden, tower_out), (head_hidden, head_out) = shape.tower_widths
        self.item_content = _tower(d, shape.hidden, d, nn.LayerNorm(d))
        self.attribute_content = _tower(attributes * d, shape.hidden, d, nn.LayerNorm(d))  # DLRMv3: the category's
        self.action_rows = nn.Parameter(torch.randn(ACTION_BITS, ACTION_DIM) * 0.1)
        self.target_action = nn.Parameter(torch.randn(ACTION_BITS * ACTION_DIM) * 0.1)  # every candidate's
        self.action_content = _tower(ACTION_BITS * ACTION_DIM, shape.hidden, d, nn.LayerNorm(d))
        self.contextual = nn.ModuleList(nn.Linear(d, d) for _ in range(shape.contextual_tokens))  # user, crosses
        self.positions = nn.Embedding(shape.position_buckets, d)
        self.ages = nn.Embedding(shape.time_buckets + 1, d)
        self.input_dropout = nn.Dropout(shape.input_dropout)
        self.layers = nn.ModuleList(
            STULayer(shape.stu, dropout=shape.layer_dropout, attention=attention) for _ in range(shape.layers)
        )
        self.candidate_norm = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d))
        self.item_tower = _tower((1 + attributes) * d, tower_hidden, tower_out, nn.LayerNorm(tower_out))
        self.head = _tower(d, head_hidden, head_out, nn.Identity())
        for table in (self.positions, self.ages):
            bound = math.sqrt(1.0 / table.num_embeddings)
            nn.init.uniform_(table.weight, -bound, bound)
        for name, child in self.named_children():
            if name != "tables":
                child.to(device)
        # new parameters rather than `.data` set in place, which no device of another tensor type (meta) takes
        self.action_rows = nn.Parameter(self.action_rows.detach().to(device))
        self.target_action = nn.Parameter(self.target_action.detach().to(device))

    def forward(self, sparse: KeyedJaggedTensor, actions: torch.Tensor, ages_s: torch.Tensor) -> torch.Tensor:
        tokens = self._tokens(sparse, actions, ages_s)
        x, lengths = self._sequences(tokens, with_user=[True] * tokens.requests)
        for layer in self.layers:
            x = layer(x, lengths, tokens.candidate_lengths)
        return self._score(x, lengths, tokens)

    def forward_after_prefix(
        self,
        sparse: KeyedJaggedTensor,
        actions: torch.Tensor,
        ages_s: torch.Tensor,
        prefix: torch.Tensor,
        prefix_keys: list[torch.Tensor],
        prefix_values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Score requests whose first `prefix` tokens (the user token and the oldest history items) were
        encoded before (history reuse, `infer.history`): `sparse` holds only each request's history after
        its prefix, and its candidates; `prefix_keys[l]`/`prefix_values[l]` [B, H, max prefix, d] are layer
        l's keys and values of the prefixes (a request with prefix 0 is encoded whole, its user token too).
        Returns the logits and each layer's keys and values of the new tokens [B, H, max new, d].

        With every prefix encoded by this same request, this is exactly `forward`; with a prefix
        encoded at an earlier request its tokens keep that request's positions and ages."""
        tokens = self._tokens(sparse, actions, ages_s)
        x, new = self._sequences(tokens, with_user=(prefix == 0).tolist())
        history = prefix + new - tokens.candidate_lengths  # user and history tokens of the whole request
        n = int((prefix + new).max())  # the normaliser the whole sequences would have had
        mask = prefix_attention(prefix, new, history)
        keys, values = [], []
        for layer, pk, pv in zip(self.layers, prefix_keys, prefix_values, strict=True):
            x, k, v = layer.forward_after_prefix(x, new, mask, pk, pv, n)
            keys.append(k)
            values.append(v)
        return self._score(x, new, tokens), keys, values

    def _tokens(self, sparse: KeyedJaggedTensor, actions: torch.Tensor, ages_s: torch.Tensor) -> _Tokens:
        """Each request's token embeddings before the STU layers (flat over requests)."""
        d, features = self.shape.stu.dim, self.shape.features
        emb = self.tables(sparse)
        # per history token: content + attributes + action branches; candidates: a learned target action
        bits = (actions.unsqueeze(1) >> torch.arange(ACTION_BITS, device=actions.device)) & 1
        history_actions = (bits.unsqueeze(2) * self.action_rows).flatten(1)
        hist_item, cand_item = emb[features.history[0]].values(), emb[features.candidates[0]].values()
        hist_attr = torch.cat([emb[f].values() for f in features.history[1:]], dim=-1)
        cand_attr = torch.cat([emb[f].values() for f in features.candidates[1:]], dim=-1)
        history = (
            self.item_content(hist_item) + self.attribute_content(hist_attr) + self.action_content(history_actions)
        )
        candidates = (
            self.item_content(cand_item)
            + self.attribute_content(cand_attr)
            + self.action_content(self.target_action).expand(len(cand_item), d)
        )
        contextual = torch.stack(
            [linear(emb[f].values()) for linear, f in zip(self.contextual, features.contextual, strict=True)], dim=1
        )
        return _Tokens(
            history=history,
            candidates=candidates,
            contextual=contextual,
            history_lengths=emb[features.history[0]].lengths(),
            candidate_lengths=emb[features.candidates[0]].lengths(),
            age_buckets=torch.sqrt(ages_s.clamp(min=0) / 60.0).long().clamp(max=self.shape.time_buckets),
            candidate_items=cand_item,
            candidate_attributes=cand_attr,
        )

    def _sequences(self, t: _Tokens, with_user: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """[contextual tokens?, history..., candidates...] per request, padded to the batch's longest:
        (x [B, N, D], lengths); `with_user`: whether a request's contextual tokens (the user's, and DLRMv4's
        crosses) lead it. Every token is placed by index (one scatter per kind, no loop over requests: at
        hstu-tiny's size a Python loop per request cost more than the layers)."""
        d, dev, k = self.shape.stu.dim, t.history.device, self.shape.contextual_tokens
        h, c = t.history_lengths.long(), t.candidate_lengths.long()
        u = torch.as_tensor(with_user, dtype=torch.long, device=dev) * k
        lengths = u + h + c
        n = int(lengths.max())
        h_req, h_at = _places(h)  # each history token's request and place among its history
        c_req, c_at = _places(c)
        h_col = u[h_req] + h_at
        c_col = u[c_req] + h[c_req] + c_at
        x = t.history.new_zeros(t.requests, n, d)
        users = torch.nonzero(u).squeeze(1)
        x[users, :k] = t.contextual[users]
        x[h_req, h_col] = t.history
        x[c_req, c_col] = t.candidates
        # positions count back from the newest history item; every candidate shares one (0)
        pos_idx = torch.zeros(t.requests, n, dtype=torch.long, device=dev)
        pos_idx[h_req, h_col] = (h[h_req] - h_at).clamp(max=self.shape.position_buckets - 1)
        age_idx = torch.zeros(t.requests, n, dtype=torch.long, device=dev)
        age_idx[h_req, h_col] = t.age_buckets
        return self.input_dropout(x * math.sqrt(d) + self.positions(pos_idx) + self.ages(age_idx)), lengths

    def _score(self, x: torch.Tensor, lengths: torch.Tensor, t: _Tokens) -> torch.Tensor:
        """One logit per candidate (the last tokens of each sequence), flat in request order."""
        c = t.candidate_lengths.long()
        c_req, c_at = _places(c)
        picked = x[c_req, lengths[c_req] - c[c_req] + c_at]
        user_side = self.candidate_norm(picked)
        item_side = self.item_tower(torch.cat([t.candidate_items, t.candidate_attributes], dim=-1))
        return self.head(user_side * item_side).squeeze(-1)


def _places(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For items listed request by request, `lengths[i]` of request i: each item's request and its
    place among its request's items."""
    req = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return req, torch.arange(len(req), device=lengths.device) - first[req]


@dataclass
class _Tokens:
    history: torch.Tensor  # [history tokens, D]
    candidates: torch.Tensor  # [candidates, D]
    contextual: torch.Tensor  # [B, contextual tokens, D]: the user's, then the crosses'
    history_lengths: torch.Tensor  # [B]
    candidate_lengths: torch.Tensor  # [B]
    age_buckets: torch.Tensor  # [history tokens]
    candidate_items: torch.Tensor  # [candidates, D] (embeddings)
    candidate_attributes: torch.Tensor  # [candidates, attributes x D]: DLRMv3's category, DLRMv4's artist and album

    @property
    def requests(self) -> int:
        return len(self.history_lengths)


def build_ranker(
    spec: HSTUSpec,
    device: str | torch.device = "cpu",
    table_device: str | torch.device | None = None,
    table_precision: str = "fp32",
    attention: str = "padded",
) -> HSTURanker:
    """The ranker of an HSTU preset, its dense layers on `device` (`table_device="meta"`: tables
    left for `DistributedModelParallel` to materialise shard by shard). Tables are fp32."""
    spec.check_table_precision(table_precision)
    model = HSTURanker(spec.shape, attention=attention, device=device, table_device=table_device)
    model.spec = spec  # what the planner and the table initialiser read, as they read a DLRM's
    return model


# ----------------------------------------------------------------------------- the attention path, by measurement

ATTENTION_REPEATS = 3


def time_attention_paths(
    shape: STUShape,
    lengths: list[int],
    candidates: list[int],
    device: torch.device,
    repeats: int = ATTENTION_REPEATS,
    backward: bool = True,
) -> dict[str, float]:
    """Seconds of one STU layer's forward (and backward, for training) over a batch of requests of
    these lengths (tokens, candidates among them), per attention path: the median of `repeats`,
    paths in turn."""
    torch.manual_seed(0)
    n = max(lengths)
    x = torch.randn(len(lengths), n, shape.dim, device=device)
    lens, cands = torch.tensor(lengths, device=device), torch.tensor(candidates, device=device)
    layers = {p: STULayer(shape, dropout=0.0, attention=p).to(device) for p in ATTENTION_PATHS}
    times: dict[str, list[float]] = {p: [] for p in ATTENTION_PATHS}
    for i in range(repeats + 1):
        for path, layer in layers.items():
            xi = x.clone().requires_grad_(backward)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(backward):
                y = layer(xi, lens, cands)
                if backward:
                    y.sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first pass warms up
                times[path].append(time.perf_counter() - t0)
    return {p: statistics.median(t) for p, t in times.items()}


@dataclass(frozen=True)
class AttentionChoice:
    path: str
    reason: str
    seconds: dict[str, float]

    def to_dict(self) -> JsonObject:
        return {"attention": self.path, "reason": self.reason, "layer_seconds": self.seconds}


def choose_attention(
    requested: str,
    spec: HSTUSpec,
    batch_size: int,
    device: torch.device,
    seed: int = 0,
    *,
    backward: bool = True,
    window: str = "train",
) -> AttentionChoice:
    """`--attention auto`: time one layer of the ranker over a batch of the run's requests (spread over
    `window`) in both paths, forward and backward for training, forward for serving, and take the
    faster (on CPU the jagged path skips padding but loops per request in Python; which wins depends
    on the lengths, the width and the machine). Explicit paths are taken."""
    if requested != "auto":
        if requested not in ATTENTION_PATHS:
            raise FieldError("attention", f"{requested!r}: allowed: auto, {', '.join(ATTENTION_PATHS)}")
        return AttentionChoice(requested, f"asked for (--attention {requested}); not measured", {})
    from dlrm_lab.data.sequences import SequenceGenerator

    gen = SequenceGenerator(spec.data, seed)
    picks = np.linspace(0, gen.num_requests(window) - 1, batch_size).astype(np.int64)  # spread over the window
    h = np.array([int(gen.requests(int(i), int(i) + 1, window).history_lengths[0]) for i in picks])
    lengths = (1 + h + spec.data.candidates).tolist()
    seconds = time_attention_paths(
        spec.shape.stu, lengths, [spec.data.candidates] * batch_size, device, backward=backward
    )
    best = min(seconds, key=seconds.__getitem__)
    other = next(p for p in seconds if p != best)
    reason = (
        f"auto: one layer over {batch_size} of the run's requests ({min(lengths)}-{max(lengths)} tokens): {best} "
        f"{seconds[best] * 1e3:.2f} ms, {other} {seconds[other] * 1e3:.2f} ms "
        f"({'forward + backward' if backward else 'forward'}, median of {ATTENTION_REPEATS})"
    )
    return AttentionChoice(best, reason, seconds)
