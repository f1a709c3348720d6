"""What serving a set of models needs in memory, checked before anything is allocated.

Training refuses a model whose tables do not fit (TorchRec's planner against the real
memory); serving must too, or the kernel's out-of-memory killer ends it minutes later
without a word. The parts counted, per served model (see `infer/server.py`):

- build: the parent builds the model with fp32 tables before writing its snapshot (and a fused build
  beside them: TorchRec copies the model, then fills one TBE at the table precision), so the
  fp32 tables are resident while the snapshot is written (one model at a time);
- snapshot: the tables at their stored precision (int8/int4 rows carry an fp16 scale and
  bias), written to shared memory (/dev/shm is RAM) and mapped once by all instances;
- sample library: dense values, ids and per-feature lengths and starts of its samples;
- each instance's private memory: the Python/torch runtime (`INSTANCE_RUNTIME_BYTES`,
  measured), the dense parameters and the activations of its largest batch.

On a GPU each instance holds its own copy of the tables (fp32 while it quantises, then at the
stored precision) plus its activations, on the device it round-robins onto.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dlrm_lab.errors import UserError
from dlrm_lab.infer.serving_parts import ModelMemory, Served, serving_of

# Private memory of an idle instance process (USS: torch, torchrec and fbgemm loaded), as
# measured with the tiny preset on 2026-11-23 (268 MB), rounded up.
INSTANCE_RUNTIME_BYTES = 320 << 20
GiB = float(1 << 30)


def library_samples(max_batch: int, library_samples: int = 0) -> int:
    """Samples in a served model's sample library (the server's rule)."""
    return library_samples or max(8192, 16 * min(max_batch, 4096))


def model_memory(served: Served[Any]) -> ModelMemory:
    """What `served` (an `infer.served.ServedModel`) needs, from its spec alone."""
    return serving_of(served.spec).memory(served)


def check_fits(
    models: Iterable[Any],
    *,
    device: str = "cpu",
    available_bytes: int | None = None,
    shared_free_bytes: int | None = None,
    shared_dir: Path | None = None,
    device_free_bytes: list[int] | None = None,
    own_tmpfs: bool | None = None,
) -> list[ModelMemory]:
    """Raise a one-line UserError naming the sizes when `models` cannot be served here;
    return their needs otherwise. The `*_bytes` arguments default to this machine's
    (`psutil` available memory, free space of the snapshot directory, free memory of each
    visible GPU) and are there for tests, as is `own_tmpfs` (whether a snapshot on 2 MiB pages gets a tmpfs of its
    own here: `infer.snapshot.own_tmpfs_here`)."""
    import psutil

    models = list(models)
    needs = [model_memory(m) for m in models]
    if not needs:
        return needs
    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    build = max(max(n.fp32_tables, n.build_peak) for n in needs)  # one model built at a time
    if device == "cpu":
        total = build + sum(n.steady for n in needs)
    else:  # the instances hold their tables on the GPU; the host keeps the snapshots and their runtimes
        total = build + sum(n.snapshot + n.library + n.instances * INSTANCE_RUNTIME_BYTES for n in needs)
    parts = "; ".join(
        f"{n.name}: snapshot {n.snapshot / GiB:.2f} GiB ({max(n.fp32_tables, n.build_peak) / GiB:.2f} GiB while "
        "built), "
        f"sample library {n.library / GiB:.2f} GiB, {n.instances} instance(s) x {n.per_instance / GiB:.2f} GiB"
        for n in needs
    )
    advice = "scale the tables (--table-scale, --max-rows), use fewer --instances or a smaller --table-precision"
    if total > available:
        raise UserError(
            f"serving needs {total / GiB:.2f} GiB of memory but this machine has {available / GiB:.2f} GiB available "
            f"[{parts}]: {advice}"
        )
    from dlrm_lab.infer.snapshot import own_tmpfs_here, snapshot_base

    if shared_free_bytes is None and device == "cpu":
        shared_free_bytes = shutil.disk_usage(shared_dir or snapshot_base()).free
    # a snapshot asked on 2 MiB pages is written to a tmpfs of its own where one can be mounted here, in RAM (counted
    # above), not in the snapshot directory's room (a container's /dev/shm: 64 MiB); `auto` may choose base pages
    own = own_tmpfs_here() if own_tmpfs is None else own_tmpfs
    shared = sum(
        n.snapshot + n.library
        for n, m in zip(needs, models, strict=True)
        if not (own and getattr(m, "table_pages", "base") == "huge")
    )
    if shared_free_bytes is not None and shared > shared_free_bytes:
        where = shared_dir or "the snapshot directory"
        raise UserError(
            f"the snapshots need {shared / GiB:.2f} GiB in {where} but it has {shared_free_bytes / GiB:.2f} GiB free "
            f"[{parts}]: {advice}"
        )
    if device == "cuda":
        free = device_free_bytes if device_free_bytes is not None else _gpu_free_bytes()
        if free:
            per_gpu = [0] * len(free)
            index = 0
            for n in needs:  # instances round-robin over the visible GPUs, as the server places them
                for _ in range(n.instances):
                    per_gpu[index % len(free)] += n.device_per_instance
                    index += 1
            for gpu, (need, have) in enumerate(zip(per_gpu, free, strict=True)):
                if need > have:
                    raise UserError(
                        f"the instances on cuda:{gpu} need {need / GiB:.2f} GiB of device memory but it has "
                        f"{have / GiB:.2f} GiB free [{parts}]: {advice}"
                    )
    return needs


def _gpu_free_bytes() -> list[int]:
    import torch

    return [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
