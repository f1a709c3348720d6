"""Embedding tables on huge pages: a random row gather over tables far beyond the TLB's reach costs a page walk
per row on 4 KiB pages (two-dimensional under a hypervisor), which 2 MiB pages all but remove.

Tables shared by processes live in files of a tmpfs (a serving snapshot), whose pages Linux puts on huge pages only
where the mount says so (`huge=`) or `shmem_enabled` allows it; `mount_huge_tmpfs` mounts a tmpfs of its own with
`huge=within_size` where this process may mount (root), and every process that maps a file written there maps its
2 MiB pages whole (`pmd_mapped_bytes` reads how much).

Linux backs anonymous memory with transparent huge pages only where asked (`madvise` mode, the usual default),
and tensors already written sit on 4 KiB pages. `madvise(MADV_HUGEPAGE)` marks a range, and `MADV_COLLAPSE`
(Linux 6.1) rebuilds it on huge pages in place, synchronously: the tensor keeps its address, so the views
TorchRec and fbgemm hold of a table (its state dict, the optimizer's state) stay valid. Called through libc
because neither torch nor the standard library exposes either advice for an existing tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
# the file's 2 MiB pages within its size on huge pages; up to all of RAM (tmpfs's default is half: a larger snapshot
# failed to write), what serving may take of it being checked before (`infer.memory.check_fits`)
HUGE_TMPFS = "huge=within_size,mode=0700,size=100%"


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), None off Linux or unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def unsupported(path: Path = THP_ENABLED) -> str | None:
    """Why tables cannot be put on huge pages here, or None where they can."""
    if not sys.platform.startswith("linux"):
        return f"huge pages are asked of Linux's madvise; this is {sys.platform}"
    mode = thp_mode(path)
    if mode is None:
        return f"{path} is unreadable: the kernel has no transparent huge pages"
    if mode == "never":
        return f"transparent huge pages are off ({path}: never)"
    return None


@dataclass
class PagesResult:
    """What `back_with_huge_pages` did: bytes asked, bytes now on huge pages, the time it took, and why any
    range stayed on small pages."""

    asked_bytes: int = 0
    huge_bytes: int = 0
    ms: float = 0.0
    error: str | None = None


_libc: Any = None


def _c() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _libc.mount.restype = ctypes.c_int
        _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        _libc.umount2.restype = ctypes.c_int
    return _libc


def _madvise() -> Any:
    return _c().madvise


def mount_huge_tmpfs(directory: Path) -> str | None:
    """Mount a tmpfs of 2 MiB pages (`HUGE_TMPFS`) on the empty `directory`; None where it did, else why not (one
    line). Called through libc: neither torch nor the standard library mounts."""
    if not sys.platform.startswith("linux"):
        return f"a tmpfs on huge pages is Linux's; this is {sys.platform}"
    if (why := unsupported()) is not None:
        return why
    rc = _c().mount(b"dlrm-lab-tables", str(directory).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, HUGE_TMPFS.encode())
    if rc == 0:
        return None
    code = ctypes.get_errno()
    if code == errno.EPERM:
        return "mounting a tmpfs on huge pages needs root (CAP_SYS_ADMIN); this process has not"
    if code == errno.EINVAL:
        return "this kernel's tmpfs refused huge=within_size (no transparent huge pages for shared memory)"
    return f"mount failed: {errno.errorcode.get(code, code)}"


def unmount(directory: Path) -> None:
    """Detach a tmpfs `mount_huge_tmpfs` mounted (its memory goes when the last process mapping it exits)."""
    _c().umount2(str(directory).encode(), MNT_DETACH)


def pmd_mapped_bytes(pid: int | str, under: Path) -> int:
    """Bytes process `pid` maps on whole 2 MiB pages from files under `under` (its smaps' `ShmemPmdMapped` and
    `FilePmdMapped`); 0 where none, or unreadable."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return 0
    total, inside = 0, False
    prefix = str(under).rstrip("/") + "/"
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
            inside = len(head) == 6 and head[5].startswith(prefix)
        elif inside and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
            total += int(line.split()[1]) * 1024
    return total


def _why(code: int) -> str:
    if code == errno.EINVAL:
        return "the kernel refused MADV_COLLAPSE (EINVAL: older than Linux 6.1, or huge pages off)"
    if code in (errno.EAGAIN, errno.ENOMEM):
        return f"no free huge page for part of the range ({errno.errorcode[code]}: memory too fragmented or short)"
    return f"madvise failed: {errno.errorcode.get(code, code)}"


def back_with_huge_pages(tensors: list[Any]) -> PagesResult:
    """Put each CPU tensor's whole 2 MiB pages on huge pages, in place (a tensor under two pages is left).
    Never raises: a range the kernel cannot collapse stays on small pages, and the result says why."""
    out = PagesResult()
    if (why := unsupported()) is not None:
        out.error = why
        return out
    madvise = _madvise()
    start_s = time.perf_counter()
    largest = 0
    for t in tensors:
        if t.device.type != "cpu":
            continue
        begin, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        largest = max(largest, end - begin)
        lo, hi = -(-begin // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi - lo < 2 * HUGE_PAGE:
            continue
        out.asked_bytes += hi - lo
        if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0 or madvise(lo, hi - lo, MADV_COLLAPSE) != 0:
            out.error = out.error or _why(ctypes.get_errno())
            continue
        out.huge_bytes += hi - lo
    out.ms = (time.perf_counter() - start_s) * 1e3
    if not out.asked_bytes and out.error is None:  # nothing was large enough: said, never reported as huge
        out.error = (
            f"no table spans two whole 2 MiB pages (the largest holds {largest:,} bytes): every byte stays "
            "on 4 KiB pages"
        )
    return out
