"""The DLRM's interactions of its dense output with the pooled embeddings: the dot interaction (TorchRec's
`InteractionArch` in outputs, trained with its own backward or run by the lab's kernel, `model.native`) and
facebookresearch/dlrm's cat interaction.

Notation as in TorchRec: B batch size, F sparse features, D embedding dimension.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class DotInteractionArch(nn.Module):
    """Pairwise dot products of the bottom-MLP output and the pooled embeddings.

    Input B X D and B X F X D; output B X (D + (F + 1) choose 2), equal to TorchRec's
    `InteractionArch`: the dense output, then the upper triangle of the (F + 1) X (F + 1)
    Gram matrix row by row. It selects the triangle from the flattened matrix by a flat index
    (`dot_interaction`), trained with its own backward (`_DotInteraction`); TorchRec's 2-D
    advanced indexing backs up through a serial `index_put` (about twice as slow on CPU).

    Example (B = 2, F = 3, D = 8: 8 + (3 + 1) choose 2 = 14 outputs):

    >>> import torch
    >>> DotInteractionArch(num_sparse_features=3)(torch.rand(2, 8), torch.rand(2, 3, 8)).shape
    torch.Size([2, 14])
    >>> DotInteractionArch(num_sparse_features=0)
    Traceback (most recent call last):
        ...
    ValueError: num_sparse_features = 0: must be an integer >= 1
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        if isinstance(num_sparse_features, bool) or not isinstance(num_sparse_features, int) or num_sparse_features < 1:
            raise ValueError(f"num_sparse_features = {num_sparse_features!r}: must be an integer >= 1")
        self.F: int = num_sparse_features
        rows, cols = torch.triu_indices(self.F + 1, self.F + 1, offset=1)
        self.register_buffer("triu_flat_indices", rows * (self.F + 1) + cols, persistent=False)
        # None: the Gram matrix in autocast's dtype where autocast is on (bmm: bf16); a dtype: in that one, out of
        # autocast (set by a training run's measured choice, `train.choices.choose_run_interaction`)
        self.gram_dtype: torch.dtype | None = None
        # the lab's C++ kernel (`model.native`) in place of torch's ops: set only by a measured choice (training's,
        # the serving plan's), never by default
        self.native = False
        # serving's: the kernel's output this wide, zero beyond the pairs, for a next GEMM computed at a wider K
        # (`infer.gemm_widths.padded`); 0: as wide as its outputs
        self.out_width = 0

    def use(self, way: str) -> None:
        """The Gram matrix by the lab's kernel ("native"), torch's ops in fp32 ("fp32") or as autocast casts them."""
        self.gram_dtype = torch.float32 if way == "fp32" else None
        self.native = way == "native"

    @staticmethod
    def within(model: nn.Module) -> list[DotInteractionArch]:
        return [m for m in model.modules() if isinstance(m, DotInteractionArch)]

    def forward(
        self, dense_features: torch.Tensor, sparse_features: torch.Tensor, triangle: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`triangle`: where the pairs lie when `sparse_features` come in another order than the
        features' (`pooled_with_triangle`); by default they come in order."""
        pairs = self.triu_flat_indices if triangle is None else triangle
        return dot_interaction(dense_features, sparse_features, pairs, self.gram_dtype, self.native, self.out_width)


def dot_interaction(
    dense: torch.Tensor,
    sparse: torch.Tensor,
    pairs: torch.Tensor,
    gram_dtype: torch.dtype | None,
    native: bool = False,
    out_width: int = 0,
) -> torch.Tensor:
    """`[dense, the entries `pairs` of each sample's Gram matrix of [dense, sparse...]]` (B X D, B X F X D -> B X
    (D + pairs)), the Gram matrix in `gram_dtype` out of autocast where one is given (a training run's measured
    choice), else in autocast's dtype where it is on. `native`: the lab's kernel (one op, its own backward; it
    exports and compiles as one call). Its output is `out_width` wide where that is given (zero columns after
    the pairs; the kernel writes them, no backward). Otherwise training in eager mode takes `_DotInteraction`'s
    forward and backward; traced, exported and no-grad calls the plain ops."""
    if native:
        return _native_interaction(dense, sparse, pairs, gram_dtype, out_width)
    out = _torch_interaction(dense, sparse, pairs, gram_dtype)
    return torch.nn.functional.pad(out, (0, out_width - out.shape[1])) if out_width else out


def _torch_interaction(
    dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor, gram_dtype: torch.dtype | None
) -> torch.Tensor:
    trained = dense.requires_grad or sparse.requires_grad
    if trained and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _DotInteraction.apply(dense, sparse, pairs, _compute_dtype(dense, sparse, gram_dtype))
    if gram_dtype is not None:  # the measured choice: out of autocast, in this dtype
        with torch.autocast(dense.device.type, enabled=False):
            return _plain_interaction(dense.to(gram_dtype), sparse.to(gram_dtype), pairs)
    return _plain_interaction(dense, sparse, pairs)


def _native_interaction(
    dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor, gram_dtype: torch.dtype | None, out_width: int = 0
) -> torch.Tensor:
    """The lab's kernel in one compute dtype (`_compute_dtype`), its sums fp32; fp32 embeddings go in as they are
    (it rounds them as it reads them, and writes their gradient in fp32: no cast op either way, BENCHMARKS.md)."""
    from dlrm_lab.model import native

    # loaded before any trace (`infer.interaction.put`, training's choice): a compile does not trace the loader
    if not torch.compiler.is_compiling() and (why := native.load()) is not None:
        raise RuntimeError(why)
    dtype = _compute_dtype(dense, sparse, gram_dtype)
    wide = sparse.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(dense.device.type, enabled=False):
        dense, sparse = dense.to(dtype), sparse if wide else sparse.to(dtype)
        if out_width:
            return torch.ops.dlrm_lab.dot_interaction_padded(dense, sparse, pairs, out_width)
        return torch.ops.dlrm_lab.dot_interaction(dense, sparse, pairs)


def _compute_dtype(dense: torch.Tensor, sparse: torch.Tensor, gram_dtype: torch.dtype | None) -> torch.dtype:
    """A trained or native interaction's dtype: `gram_dtype`, else autocast's where it is on (as it runs bmm),
    else the wider input's."""
    if gram_dtype is not None:
        return gram_dtype
    if torch.is_autocast_enabled(device := dense.device.type):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(dense.dtype, sparse.dtype)


def _plain_interaction(dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)
    gram = torch.bmm(combined, combined.transpose(1, 2)).flatten(1)
    return torch.cat((dense, gram.index_select(1, pairs)), dim=1)


# A leaf for torch.fx: TorchRec's training pipeline traces the model, and a traced autograd.Function is not one call
torch.fx.wrap("dot_interaction")


class _DotInteraction(torch.autograd.Function):
    """The dot interaction with its own forward and backward, equal to autograd's through the plain ops (a test).
    Forward: [dense, sparse...] written once into one buffer in the Gram matrix's dtype (no concatenation in the
    wider dtype and cast after it), the pairs gathered straight into the output's columns after the dense ones
    (no second concatenation, no copy), by `gather` over an expanded index (0.60 against `index_select`'s 1.16 ms
    along dim 1 of kaggle's 2048 x 729 bf16 Gram matrices, 2 cores, AMX). Backward: autograd's backward of `C @ C^T`
    runs two batched GEMMs (one for each use of C) and adds them; here one, `(G + G^T) @ C`, G + G^T the pairs'
    gradient copied into both triangles (`index_copy_`: 0.84 ms against a `scatter_` pair's 1.39 and one gather's
    1.03). At kaggle's batch of 2048 under bf16 autocast, forward and backward with a bottom MLP's last layer: 5.60
    -> 4.57 ms against the pairs-only Function before it (itself 1.49-1.58x autograd's)."""

    @staticmethod
    def forward(
        ctx: Any, dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        batch, width = dense.shape
        n = sparse.shape[1] + 1
        with torch.autocast(dense.device.type, enabled=False):
            combined = torch.empty(batch, n, width, dtype=dtype, device=dense.device)
            combined[:, 0] = dense
            combined[:, 1:] = sparse
            gram = torch.bmm(combined, combined.transpose(1, 2)).view(batch, n * n)
            out = torch.empty(
                batch, width + len(pairs), dtype=torch.promote_types(dense.dtype, dtype), device=dense.device
            )
            out[:, :width] = dense
            index = pairs.expand(batch, -1)
            if out.dtype == gram.dtype:
                torch.gather(gram, 1, index, out=out[:, width:])
            else:  # a wider dense output than the Gram matrix (fp32 without autocast's cast of it)
                out[:, width:] = torch.gather(gram, 1, index)
        ctx.save_for_backward(combined, pairs)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        combined, pairs = ctx.saved_tensors
        batch, n, width = combined.shape
        both = _gram_gradient(batch, n, combined.dtype, combined.device)
        pair_grad = grad[:, width:].to(combined.dtype)
        both.index_copy_(1, pairs, pair_grad).index_copy_(1, pairs % n * n + pairs // n, pair_grad)  # G, then G^T
        to_combined = torch.bmm(both.view(batch, n, n), combined)
        # autograd casts each to its input's dtype
        return to_combined[:, 0] + grad[:, :width], to_combined[:, 1:], None, None


# The Gram matrix's gradient buffer of the last shape trained: the triangles' copies overwrite all but the diagonal
# each step, which stays the zero it was made with (no 3 MB fill a step at kaggle's batch of 2048).
_GRAM_GRADIENT: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _gram_gradient(batch: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (batch, n, dtype, device)
    if (buffer := _GRAM_GRADIENT.get(key)) is None:
        _GRAM_GRADIENT.clear()
        buffer = _GRAM_GRADIENT[key] = torch.zeros(batch, n * n, dtype=dtype, device=device)
    return buffer


class ConcatInteractionArch(nn.Module):
    """facebookresearch/dlrm's cat interaction: [dense_out, pooled embeddings]. Input B X D_dense and B X (sum of
    feature dims); output B X (D_dense + sum of dims).

    >>> import torch
    >>> ConcatInteractionArch()(torch.rand(2, 8), torch.rand(2, 22)).shape
    torch.Size([2, 30])
    """

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        return torch.cat((dense_features, sparse_features), dim=1)
