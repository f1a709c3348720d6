"""`aoti_int8`: `aoti` with the dense part quantised to int8: static, calibrated, lowered to oneDNN's int8 kernels.

The dense part (bottom MLP, interaction, top MLP, DCNv2's cross layers) is exported, quantised by torchao's
PT2E flow with `X86InductorQuantizer` (int8 weights per channel, int8 activations per tensor, observed over
CALIBRATION_SAMPLES samples of the preset's own data); the quantised graph takes the dense part's place in
`aoti`'s whole batch (the lookup inside, the tables an input), compiled by AOTInductor with freezing, which lowers
the quantised patterns to oneDNN int8 (AMX where the CPU has it, VNNI elsewhere). The package is cached like
`aoti`'s. Its scores are judged by the reduced-precision rule (AUC kept within 0.1% of fp32's), never by fp32's.

torchao is an optional extra (`pip install 'dlrm-lab[int8]'`): without it `auto` says so and does not try it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dlrm_lab.infer.builds.aoti import EXAMPLE_BATCH, GRAPH, AOTIBuild, export_whole
from dlrm_lab.infer.builds.compiled import too_small_to_compile
from dlrm_lab.infer.serving_parts import serving_of

CALIBRATION_SAMPLES = 2048  # observed, in batches of CALIBRATION_BATCH, before the scales are fixed
CALIBRATION_BATCH = 256
CALIBRATION_SEED = 0


def torchao_missing() -> str | None:
    """Why the build cannot be made here (torchao absent), or None."""
    try:
        # torchao logs a warning for each CUDA kernel library it cannot load on a CPU-only host, and torch one for
        # an enum torchao registers: neither is ours to show
        logging.getLogger("torchao").setLevel(logging.ERROR)
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401
    except ImportError as exc:
        return f"torchao is not installed ({exc}): pip install 'dlrm-lab[int8]'"
    return None


def calibration_inputs(module: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The dense part's inputs (dense features, pooled embeddings) for CALIBRATION_SAMPLES samples of the preset's
    own synthetic data: what the int8 scales are observed over."""
    from dlrm_lab.data import synthetic_generator
    from dlrm_lab.infer.batches import QueryRef, gather_batch, kernel_batch
    from dlrm_lab.infer.library import PackedLibrary

    block = synthetic_generator(module.spec, None, seed=CALIBRATION_SEED).samples(0, CALIBRATION_SAMPLES)
    library = PackedLibrary.from_block(block)
    out = []
    with torch.inference_mode():
        for at in range(0, CALIBRATION_SAMPLES, CALIBRATION_BATCH):
            dense, ids, offsets = kernel_batch(*gather_batch(library, [QueryRef(-1, CALIBRATION_BATCH, at)]))
            out.append((dense.clone(), module.lookup(ids, offsets).clone()))
    return out


def quantise_and_export(module: Any, path: Path) -> None:
    """PT2E int8 of `module.dense` (fp32), calibrated, then the whole batch around it compiled by AOTInductor into
    the package `path`."""
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    inputs = calibration_inputs(module)
    example = tuple(t[:EXAMPLE_BATCH] for t in inputs[0])
    batch = torch.export.Dim("batch", min=1)
    shapes = ({0: batch}, {0: batch})
    with torch.no_grad():
        graph = torch.export.export(module.dense, example, dynamic_shapes=shapes).module()
        quantizer = x86.X86InductorQuantizer()
        quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
        prepared = prepare_pt2e(graph, quantizer)
        for dense, pooled in inputs:
            prepared(dense, pooled)
        quantised = convert_pt2e(prepared)
    export_whole(module, path, dense_part=quantised, frozen=BUILD.frozen)


class AOTIInt8Build(AOTIBuild):
    """`aoti`'s package, loaded the same way by instances; made from a quantised graph."""

    name = "aoti_int8"
    order = 7
    base = None  # made from an fp32 fused build of its own: PT2E quantises an fp32 graph
    about = "aoti with its dense part int8 (torchao PT2E, X86InductorQuantizer, calibrated)"
    dense_precision = "int8"  # what its accuracy rule judges (infer.accuracy): never fp32's exact rule
    weight_precision = "int8"
    frozen = True  # unfrozen, Inductor leaves PT2E's patterns unlowered: the int8 weights dequantised every call

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        if why := torchao_missing():
            raise RuntimeError(why)
        module = serving_of(model.spec).make_fused(model, precision="fp32", table_precision=table_precision).eval()
        return self.packaged(
            module,
            quantise_and_export,
            {"calibration": [CALIBRATION_SEED, CALIBRATION_SAMPLES], "graph": GRAPH},
        )

    def skip(self, base_dense_ms: float | None, smallest: int | None = None) -> str | None:
        # the size first: a dense part too small to compile is skipped without importing torchao (seconds)
        return too_small_to_compile(base_dense_ms, "a quantised package build of seconds") or torchao_missing()


BUILD = AOTIInt8Build()
