"""`aoti_frozen`: `aoti`'s whole-batch package compiled with Inductor's freezing.

The dense weights become constants that oneDNN prepacks at build time (its blocked layout for this CPU's kernels,
AMX where it has them), with bias and ReLU fused as post-ops: a GEMM no longer packs its weights each call. That
wins where packing is a large share of the call (small batches: kaggle bf16, AMX, a 256-sample batch 1.92 against
2.5 us a sample) and loses at large batches on some shapes and precisions, where oneDNN's inner-product kernels for
the prepacked layout are slower than its matmul over plain weights (DLRMv2, fp16, 2,048 samples: 89 against 72
ms). So it is a build of its own, and `auto` measures it against `aoti` at the served sizes.
"""

from __future__ import annotations

from dlrm_lab.infer.builds.aoti import AOTIBuild


class AOTIFrozenBuild(AOTIBuild):
    name = "aoti_frozen"
    order = 4
    about = "aoti compiled with Inductor's freezing: the dense weights prepacked for oneDNN at build time"
    frozen = True


BUILD = AOTIFrozenBuild()
