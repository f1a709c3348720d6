"""`aoti_tuned`: `aoti`'s whole-batch package compiled with `max_autotune`: Inductor's C++ GEMM template beside ATen's.

The template generates AMX and AVX-512 micro-kernels for the graph's own shapes with the weights packed at compile
time and the epilogues (bias, ReLU) fused; autotuning keeps, GEMM by GEMM, whichever of it and oneDNN measured
faster at the traced batch. It removes most of oneDNN's per-call set-up (kaggle, bf16, AMX, as an instance measures
itself: 0.316 ms a batch against `aoti`'s 0.456) and may lose per sample at large batches (5.44 us against 4.09),
where oneDNN's kernels are traced for no batch at all: `auto` measures it against `aoti` at the served sizes. Its
compile takes about twice `aoti`'s. The template runs AMX only where a GEMM's K is even (bf16's VNNI pairs): the
layers of odd K get a zero input column (`infer.gemm_widths.padded`), without which its kaggle package ran the
367-input top layer on fp32 vector code (a 1-sample batch 0.22 against 0.145 ms padded, as an instance measures
itself).
"""

from __future__ import annotations

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.builds.aoti import AOTIBuild


class AOTITunedBuild(AOTIBuild):
    name = "aoti_tuned"
    order = 5
    about = "aoti compiled with max_autotune: Inductor's C++ GEMM template (AMX, AVX-512) beside oneDNN's, per GEMM"
    inductor_configs: JsonObject = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
    frozen = True  # the template packs weights only where they are constants: frozen
    even_k = True  # its AMX micro-kernel needs K in VNNI pairs: kaggle's K of 13 and 367 fell to fp32 vector code


BUILD = AOTITunedBuild()
