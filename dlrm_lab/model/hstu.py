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
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

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


class STULayer(nn.Module):
    """One HSTU layer over padded [B, N, D] sequences (see the module docstring)."""

    def __init__(self, shape: STUShape = STUShape(), dropout: float = 0.1, attention: str = "padded") -> None:
        super().__init__()
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
        b, n, _ = x.shape
        s = self.shape
        u, v, q, k = torch.split(
            self.uvqk(self.input_norm(x)), [s.heads * s.v_dim, s.heads * s.v_dim, s.heads * s.qk_dim,
                                            s.heads * s.qk_dim], dim=-1,
        )  # fmt: skip
        u = F.silu(u)
        q = q.view(b, n, s.heads, s.qk_dim).transpose(1, 2)  # [B, H, N, dqk]
        k = k.view(b, n, s.heads, s.qk_dim).transpose(1, 2)
        v = v.view(b, n, s.heads, s.v_dim).transpose(1, 2)
        if self.attention == "padded":
            a = self._padded(q, k, v, lengths, candidates, n)
        else:
            a = self._jagged(q, k, v, lengths, candidates, n)
        a = a.transpose(1, 2).reshape(b, n, s.heads * s.v_dim)
        y = self.out(self.dropout(torch.cat([u, a, u * self.attn_norm(a)], dim=-1)))
        real = (torch.arange(n, device=x.device).unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(2)
        return x + y * real

    def _padded(self, q, k, v, lengths, candidates, n):  # noqa: ANN001, ANN202 - tensors
        scores = F.silu(q @ k.transpose(-1, -2) / math.sqrt(self.shape.qk_dim)) / n
        mask = valid_attention(lengths, candidates, n).unsqueeze(1)  # [B, 1, N, N]
        return (scores * mask) @ v

    def _jagged(self, q, k, v, lengths, candidates, n):  # noqa: ANN001, ANN202 - tensors
        """Each request at its own length: no product over padding (a loop over requests;
        fbgemm's jagged attention kernels are GPU-only)."""
        out = torch.zeros_like(v)
        for i, (length, cands) in enumerate(zip(lengths.tolist(), candidates.tolist(), strict=True)):
            qi, ki, vi = q[i, :, :length], k[i, :, :length], v[i, :, :length]
            scores = F.silu(qi @ ki.transpose(-1, -2) / math.sqrt(self.shape.qk_dim)) / n
            mask = valid_attention(lengths.new_tensor([length]), lengths.new_tensor([cands]), length)
            out[i, :, :length] = (scores * mask) @ vi
        return out
