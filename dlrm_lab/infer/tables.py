"""The served tables: TorchRec's quantised inference tables (fbgemm's TBE) at a table precision.

Every serving build, and an instance that builds on its own GPU, quantises through here.
"""

from __future__ import annotations

import torch

TABLE_PRECISIONS = ("fp32", "fp16", "int8", "int4")
TABLE_WEIGHT_DTYPES = {"fp32": torch.float, "fp16": torch.half, "int8": torch.qint8, "int4": torch.quint4x2}


def quantize_tables(
    model: torch.nn.Module, table_precision: str, *, output_dtype: torch.dtype = torch.float, inplace: bool = False
) -> torch.nn.Module:
    """Replace the float tables by TorchRec's quantised inference tables (fbgemm TBE): int8/int4
    row-wise with per-row scale and bias, fp16, or fp32, their output in `output_dtype`. A DLRM's pooled
    `EmbeddingBagCollection` and the HSTU ranker's sequence `EmbeddingCollection` alike (TorchRec maps
    only the first by default). Not `inplace`: a copy of `model` whose float tables were never copied (TorchRec
    deep-copies the whole model first, its float tables too: DLRMv2's 5.2 GB at a table scale of 0.05 held twice
    while a build was made, which took a 24 GiB machine to its OOM killer)."""
    import copy

    from torchrec.inference.modules import quantize_embeddings
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

    if not inplace:  # the copy shares the float tables (they are read, never written, and swapped out of it below)
        tables = [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
        shared = {id(t): t for m in tables for t in [*m.parameters(), *m.buffers()]}
        model = copy.deepcopy(model, memo=shared)
    return quantize_embeddings(
        model,
        dtype=TABLE_WEIGHT_DTYPES[table_precision],
        inplace=True,
        output_dtype=output_dtype,
        additional_qconfig_spec_keys=[EmbeddingCollection],
        additional_mapping={EmbeddingCollection: QuantEmbeddingCollection},
    )
