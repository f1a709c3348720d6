"""The lab's own CPU kernels, in C++ where torch's ops are the wrong shape for the work (each file says why).

They are built once per machine (`make install` runs `python -m dlrm_lab.model.native`; else at first use, `load`)
by torch's extension builder with the vector ISA Inductor picks on this machine (AVX2 on Zen 3, AVX-512 elsewhere),
and cached by it (`~/.cache/torch_extensions`, under a name of this checkout and its sources, `_name`; torch keys
the flags). Where no build is possible (no compiler), `load` says why and the lab keeps torch's ops: a kernel here is
one way among those the lab measures, never the only one.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import time
from typing import Any

import torch

_SOURCES = [
    pathlib.Path(__file__).with_name(name) for name in ("dot_interaction.cpp", "table_update.cpp", "lookup.cpp")
]
_HEADERS = [pathlib.Path(__file__).with_name("amx_triangle.h")]  # in the build's name beside the sources


def _name() -> str:
    """The extension's name, one per checkout and sources. torch caches a build under its name alone, and ninja
    rebuilds it (~20 s) whenever the compile command differs, as it does for another checkout's source paths: two
    checkouts on one machine (`benchmarks/ab.py`'s two sides, a worktree beside the main tree) took turns rebuilding
    the one build, four times in one session."""
    digest = hashlib.sha1()
    for source in (*_SOURCES, *_HEADERS):
        digest.update(str(source).encode())
        try:
            digest.update(source.read_bytes())
        except OSError:  # a source missing: `load` says why it cannot build; importing this module must not fail
            pass
    return f"dlrm_lab_native_{digest.hexdigest()[:12]}"


NAME = _name()


def build_flags() -> list[str]:
    """-fopenmp: ATen's `parallel_for` is a header of OpenMP pragmas, serial in a build without it."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:  # no vector ISA Inductor knows: ATen's portable vectors
        return ["-O3", "-fopenmp"]
    return ["-O3", "-fopenmp", *(f"-D{macro}" for macro in isa.build_macro()), *str(isa.build_arch_flags()).split()]


@functools.cache
def load() -> str | None:
    """Build (first time on this machine) and load the kernels: None once their ops are registered
    (`torch.ops.dlrm_lab.*`), else why they could not be."""
    try:
        from torch.utils import cpp_extension

        _clear_stale_lock(cpp_extension)
        cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=build_flags(),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any failure to build or load leaves torch's ops in place
        first = str(exc).strip().splitlines()
        return f"the lab's C++ kernels did not build: {type(exc).__name__}: {first[0] if first else ''}"[:300]
    _register_python_parts()
    return None


STALE_LOCK_S = 600  # a build takes 0.5-5 minutes (as fast as the host is): a lock this old was left by a killed one


def _clear_stale_lock(cpp_extension: Any) -> None:
    """torch's builder waits for the build directory's lock file as long as it exists, and a build killed midway
    (a stopped run, a test's SIGTERM) leaves it behind: every later load would wait forever."""
    try:
        lock = pathlib.Path(cpp_extension._get_build_directory(NAME, verbose=False)) / "lock"
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except (OSError, AttributeError):  # no lock (the usual case), or a torch that names its directory otherwise
        pass


def unavailable(device: str | torch.device) -> str | None:
    """Why the lab's kernels cannot run on `device` (they are CPU kernels, built here), or None where they can."""
    if (kind := torch.device(device).type) != "cpu":
        return f"the lab's kernels are for the CPU, not {kind}"
    return load()


def _register_python_parts() -> None:
    """The ops' shapes for tracing and export (their autograd is in C++, beside the kernels)."""

    @torch.library.register_fake("dlrm_lab::dot_interaction")
    def _(dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        return dense.new_empty(dense.shape[0], dense.shape[1] + pairs.shape[0])

    @torch.library.register_fake("dlrm_lab::dot_interaction_padded")
    def _(dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor, width: int) -> torch.Tensor:
        return dense.new_empty(dense.shape[0], width)

    @torch.library.register_fake("dlrm_lab::pooled_lookup")
    def _(
        tables: torch.Tensor,
        weights_offsets: torch.Tensor,
        weights_tys: torch.Tensor,
        D_offsets: torch.Tensor,  # noqa: N803 - fbgemm's name
        ids: torch.Tensor,
        offsets: torch.Tensor,
        total_D: int,  # noqa: N803
        pooling_mode: int,
        row_alignment: int,
        output_dtype: int,
    ) -> torch.Tensor:
        batch = (offsets.shape[0] - 1) // (D_offsets.shape[0] - 1)
        dtype = {0: torch.float32, 1: torch.float16}.get(output_dtype, torch.bfloat16)
        return tables.new_empty(batch, total_D, dtype=dtype)

    @torch.library.register_fake("dlrm_lab::dot_interaction_backward")
    def _(
        grad: torch.Tensor, dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(dense), torch.empty_like(sparse)
