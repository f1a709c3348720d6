"""`openvino`: the `fused` build with its dense part run by OpenVINO's CPU plugin (the optional extra `openvino`).

An engine none of the lab's code writes, beside the lab's own builds: where it is faster, the lab's builds are
the bottleneck, not the machine. The dense part (bottom MLP, interaction, top MLP) is exported with
`torch.export` in fp32 with a dynamic batch dimension, converted by `openvino.convert_model`, and kept as one
file (the IR's XML and weights in an `.npz`, no pickle) in the content-keyed cache (`infer.artefacts`, its key
naming OpenVINO's version). Each instance reads it and compiles it for the CPU plugin (a fraction of a second:
OpenVINO compiles no code, it picks its kernels), executing in the served precision (`INFERENCE_PRECISION_HINT`:
bf16 runs on AMX or AVX-512 bf16 where the CPU has them) on the instance's threads, unpinned (the lab pins the
instance). The tables stay in fbgemm's inference TBE, called as in `fused`.
"""

from __future__ import annotations

import copy
import io
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrm_lab.errors import keep_signal_stack
from dlrm_lab.infer.artefacts import dense_package, require_verified
from dlrm_lab.infer.builds.aoti_int8 import CALIBRATION_SAMPLES, CALIBRATION_SEED, calibration_inputs
from dlrm_lab.infer.builds.compiled import too_small_to_compile
from dlrm_lab.infer.interaction import put as put_interaction

EXAMPLE_BATCH = 64  # the batch the dense part is traced at; the batch dimension is exported as dynamic
# the served precision -> OpenVINO's execution precision for the CPU plugin
OV_PRECISION = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


def telemetry_off() -> None:
    """Switch OpenVINO's and NNCF's usage telemetry off for this process, before either starts it: their telemetry
    is one process-wide singleton (`openvino_telemetry.Telemetry`), configured by its first caller; made here first
    and declined, every later caller gets it declined. A lab run sends nothing to an analytics host (a Ctrl-C during
    an int8 build printed a traceback from its sender, trying to reach one)."""
    try:
        import openvino_telemetry
    except ImportError:
        return
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # it warns on the root logger that a telemetry without an id sends nothing
    try:
        telemetry = openvino_telemetry.Telemetry(
            app_name="dlrm-lab",
            app_version="0",
            tid=None,
            backend="ga4",
            enable_opt_in_dialog=False,
            disable_in_ci=True,
        )
    finally:
        root.setLevel(level)
    telemetry.consent = False


def openvino_missing(quantiser: bool = False) -> str | None:
    """Why the build cannot be made here (OpenVINO, or for int8 NNCF, absent), or None."""
    telemetry_off()
    try:
        import openvino  # noqa: F401

        if quantiser:
            import nncf  # noqa: F401
    except ImportError as exc:
        return f"{'NNCF' if quantiser else 'OpenVINO'} is not installed ({exc}): pip install 'dlrm-lab[openvino]'"
    return None


def convert_dense(module: Any, path: Path, quantise: bool = False) -> None:
    """Export `module.dense` (a FusedDLRM's dense part) in fp32, convert it with OpenVINO (and, with `quantise`,
    quantise it to int8 with NNCF's post-training quantisation, calibrated on the preset's own data) and write its
    IR to `path`."""
    telemetry_off()
    import openvino as ov

    dense = copy.deepcopy(module.dense).float().eval()  # OpenVINO lowers the precision itself, at compile
    put_interaction(dense, "torch")  # OpenVINO converts torch's ops, not the lab's kernel
    features, pooled_width = module.spec.num_dense, len(module.spec.feature_names) * module.spec.embedding_dim
    example = (torch.zeros(EXAMPLE_BATCH, features), torch.zeros(EXAMPLE_BATCH, pooled_width))
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        exported = torch.export.export(dense, example, dynamic_shapes=({0: batch}, {0: batch}))
    model = ov.convert_model(exported)
    if quantise:
        model = _quantised(model, module)
        keep_signal_stack()  # NNCF compiled the model on OpenVINO's CPU plugin to calibrate (`keep_signal_stack`)
    xml = path.with_name(path.name + ".xml")  # OpenVINO writes an IR as two files: kept as one here
    try:
        # save_model compresses the weights to fp16 unless told not to
        ov.save_model(model, str(xml), compress_to_fp16=False)
        with open(path, "wb") as f:
            np.savez(
                f,
                xml=np.frombuffer(xml.read_bytes(), np.uint8),
                weights=np.frombuffer(xml.with_suffix(".bin").read_bytes(), np.uint8),
            )
    finally:
        xml.unlink(missing_ok=True)
        xml.with_suffix(".bin").unlink(missing_ok=True)


def _quantised(model: Any, module: Any) -> Any:
    """NNCF's static int8 post-training quantisation of the converted dense part (its default preset: int8 weights
    per channel, activations per tensor), over the same calibration samples as `aoti_int8`."""
    import contextlib
    import logging

    import nncf

    nncf.set_log_level(logging.ERROR)
    batches = [(dense.float().numpy(), pooled.float().numpy()) for dense, pooled in calibration_inputs(module)]
    with contextlib.redirect_stdout(io.StringIO()):  # its progress bars are not the lab's output
        return nncf.quantize(model, nncf.Dataset(batches), subset_size=len(batches), fast_bias_correction=True)


class OpenVINODense:
    """The dense part as OpenVINO serves it: `(dense rows, pooled embeddings) -> logits`, like the module it
    replaces. Compiled for the threads torch has when first called (and again if they change), so that the
    instance's intra-op threads are OpenVINO's too."""

    request: Any  # OpenVINO's infer request: None until the first call compiles the model

    def __init__(self, path: str, precision: str) -> None:
        import openvino as ov

        self.core = ov.Core()
        with np.load(require_verified(path), allow_pickle=False) as ir:
            self.model = self.core.read_model(model=ir["xml"].tobytes(), weights=ov.Tensor(ir["weights"].copy()))
        self.precision, self.threads, self.request = precision, 0, None

    def compile(self, threads: int) -> None:
        config = {
            "INFERENCE_NUM_THREADS": threads,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": OV_PRECISION[self.precision],
            "ENABLE_CPU_PINNING": False,
        }
        self.request = self.core.compile_model(self.model, "CPU", config).create_infer_request()
        keep_signal_stack()  # the plugin's engine set its own signal stack, freed with it (`keep_signal_stack`)
        self.threads = threads

    def __call__(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if self.threads != torch.get_num_threads():
            self.compile(torch.get_num_threads())
        inputs = [dense.float().numpy(), pooled.float().numpy()]  # fp32 in; the plugin converts as it computes
        out = self.request.infer(inputs, share_inputs=True, share_outputs=False)
        return torch.from_numpy(out[0])


class OpenVINOBuild:
    name = "openvino"
    order = 8
    base: str | None = "fused"
    about = "fused, its dense part converted by OpenVINO and run by its CPU plugin (optional extra `openvino`)"
    dense_precision: str | None = None
    weight_precision: str | None = None  # the plugin stores the weights in the precision it computes in

    quantise = False

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        if why := openvino_missing(self.quantise):
            raise RuntimeError(why)
        import openvino as ov

        module = base.sibling()  # the same tables, not a copy
        engine = {"openvino": ov.__version__}
        if self.quantise:
            import nncf

            engine |= {"nncf": nncf.__version__, "calibration": [CALIBRATION_SEED, CALIBRATION_SAMPLES]}
        artefact = dense_package(
            self.name, module, ".npz", lambda m, path: convert_dense(m, path, self.quantise), engine
        )
        module.package, module.package_reason = str(artefact.path), artefact.reason
        module.compiled = OpenVINODense(module.package, precision)
        return module

    def skip(self, base_dense_ms: float | None, smallest: int | None = None) -> str | None:
        # the size first: a dense part too small to convert is skipped without importing OpenVINO (seconds)
        return too_small_to_compile(base_dense_ms, "an export and conversion of seconds") or openvino_missing(
            self.quantise
        )

    def for_snapshot(self, module: Any) -> Any:
        module.compiled = None  # an OpenVINO model does not pickle; each instance reads the file
        return module

    def in_instance(self, module: Any, device: Any, *, precision: str, table_precision: str) -> Any:
        if device.type == "cuda":
            raise RuntimeError(
                f"the {self.name} build is made for OpenVINO's CPU plugin: on a GPU serve eager, fused or compiled"
            )
        module.compiled = OpenVINODense(module.package, precision)
        return module

    def artefact(self, module: Any) -> str | None:
        return None  # an IR compiled in the instance for its threads

    def from_artefact(self, module: Any, artefact: str) -> Any:
        raise NotImplementedError(f"{self.name} is not served from one file")


BUILD = OpenVINOBuild()
