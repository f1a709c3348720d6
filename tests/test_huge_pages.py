"""Embedding tables on 2 MiB pages (`metrics.huge_pages`, `train.choices.choose_table_pages`)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import store_profile
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    OptimType,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from dlrm_lab.config import TrainConfig
from dlrm_lab.distributed.context import DistContext
from dlrm_lab.metrics import gather_pages, huge_pages
from dlrm_lab.metrics.huge_pages import HUGE_PAGE, back_with_huge_pages, thp_mode, unsupported
from dlrm_lab.train import choices


def _huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that hold `tensor`'s bytes, from /proc/self/smaps."""
    begin, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
                lo, hi = int(m[1], 16), int(m[2], 16)
                inside = lo < end and begin < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize(
    "text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                   ("always madvise [never]", "never"), ("", None)],
)  # fmt: skip
def test_the_kernels_huge_page_mode_is_read_and_never_is_refused_with_the_file_named(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert thp_mode(path) == mode
    assert thp_mode(tmp_path / "absent") is None
    why = unsupported(path)
    if mode == "never":
        assert why == f"transparent huge pages are off ({path}: never)"
    elif mode is None:  # an empty file names no mode: as good as none
        assert why == f"{path} is unreadable: the kernel has no transparent huge pages"
    else:
        assert why is None or why.startswith("huge pages are asked of Linux")
    assert "unreadable" in unsupported(tmp_path / "absent")


def test_a_table_collapsed_onto_huge_pages_keeps_its_address_and_its_rows():
    table = torch.randn(3 * HUGE_PAGE // 4 + 123)  # 6 MiB and a bit: at least two whole 2 MiB pages inside
    view, before, address = table[1000:2000], table.clone(), table.data_ptr()
    done = back_with_huge_pages([table, torch.zeros(10)])  # the small one is left alone
    assert table.data_ptr() == address and torch.equal(table, before) and view.data_ptr() == address + 4000
    if unsupported() is not None:
        assert done.huge_bytes == 0 and done.error == unsupported()
        return
    assert done.asked_bytes >= 2 * HUGE_PAGE and done.asked_bytes % HUGE_PAGE == 0
    if done.error is None:
        assert done.huge_bytes == done.asked_bytes and done.ms > 0
        assert _huge_kib(table) * 1024 >= done.huge_bytes  # the kernel says so too
    else:  # a fragmented machine: the range stays on small pages, and the reason is one line
        assert "\n" not in done.error


def test_back_with_huge_pages_says_why_where_the_kernel_refuses(monkeypatch):
    monkeypatch.setattr(huge_pages, "unsupported", lambda: None)
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda addr, n, advice: -1)
    monkeypatch.setattr(huge_pages.ctypes, "get_errno", lambda: huge_pages.errno.EINVAL)
    done = back_with_huge_pages([torch.zeros(HUGE_PAGE)])  # 8 MiB
    assert done.huge_bytes == 0 and done.asked_bytes >= 2 * HUGE_PAGE
    assert done.error == "the kernel refused MADV_COLLAPSE (EINVAL: older than Linux 6.1, or huge pages off)"


def _tables() -> torch.nn.Module:
    rows = [(200_000, 16, EmbeddingLocation.HOST, ComputeDevice.CPU)] * 2  # 25.6 MB of rows
    return torch.nn.ModuleList([SplitTableBatchedEmbeddingBagsCodegen(rows, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD)])


ONE_RANK = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.mark.parametrize("huge_rate, chosen", [(10e9, "huge"), (8.2e9, "base"), (None, "base")])
def test_auto_takes_huge_pages_only_where_the_gather_measured_faster_on_them(monkeypatch, huge_rate, chosen):
    rates = {"base_bytes_per_s": 8e9, "huge_bytes_per_s": huge_rate, "huge_error": None if huge_rate else "EAGAIN"}
    monkeypatch.setattr(gather_pages, "gather_page_rates", lambda threads, measure=True: (rates, "the machine probe"))
    if unsupported() is not None:
        pytest.skip(f"no huge pages here: {unsupported()}")
    tables = _tables()
    choice = choices.choose_table_pages(TrainConfig(table_pages="auto"), ONE_RANK, tables, None)
    # a machine too fragmented to collapse any range records base, and why (never "huge" with no byte on one)
    assert choice["requested"] == "auto" and choice["table_pages"] == (chosen if choice["huge_bytes"] else "base")
    if chosen == "huge":
        assert choice["reason"].startswith("an embedding gather ran 10.00 GB/s on 2 MiB pages against 8.00 on 4 KiB")
        assert choice["reason"].split("; ")[0].endswith("huge pages are faster")
        assert choice["huge_bytes"] > 0 or "; " in choice["reason"]
    elif huge_rate:
        assert choice["reason"].endswith("huge pages not 1.05x faster") and choice["huge_bytes"] == 0
    else:
        assert choice["reason"] == "no gather on 2 MiB pages could be measured (EAGAIN)"


def test_base_and_huge_are_taken_as_asked_and_a_gpu_keeps_its_own_memory(monkeypatch):
    monkeypatch.setattr(
        gather_pages, "gather_page_rates", lambda threads, measure=True: pytest.fail("nothing to measure")
    )
    base = choices.choose_table_pages(TrainConfig(table_pages="base"), ONE_RANK, _tables(), None)
    assert (base["table_pages"], base["reason"], base["huge_bytes"]) == ("base", "--table-pages base", 0)
    gpu = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"), backend="nccl")
    on_gpu = choices.choose_table_pages(TrainConfig(table_pages="auto"), gpu, torch.nn.ModuleList(), None)
    assert (on_gpu["table_pages"], on_gpu["reason"]) == ("base", "the tables are in the GPU's memory")
    if unsupported() is None:
        huge = choices.choose_table_pages(TrainConfig(table_pages="huge"), ONE_RANK, _tables(), None)
        assert huge["table_pages"] == ("huge" if huge["huge_bytes"] else "base")
        assert huge["reason"].startswith("--table-pages huge")


def test_huge_pages_asked_for_tables_too_small_for_one_record_base_and_say_why(monkeypatch):
    """`--table-pages huge` on tables that span no two whole 2 MiB pages put no byte on a huge page while the run
    said "huge" (issue 57 A7): the record says base, and the reason names the largest table's size."""
    monkeypatch.setattr(huge_pages, "unsupported", lambda: None)
    monkeypatch.setattr(
        gather_pages, "gather_page_rates", lambda threads, measure=True: pytest.fail("nothing to measure")
    )
    rows = [(1_000, 16, EmbeddingLocation.HOST, ComputeDevice.CPU)]  # 64 KB
    small = torch.nn.ModuleList(
        [SplitTableBatchedEmbeddingBagsCodegen(rows, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD)]
    )
    choice = choices.choose_table_pages(TrainConfig(table_pages="huge"), ONE_RANK, small, None)
    assert choice["table_pages"] == "base" and choice["huge_bytes"] == 0
    assert choice["reason"].startswith("--table-pages huge; no table spans two whole 2 MiB pages (the largest holds ")


def test_a_bad_table_pages_is_refused_in_one_line():
    from dlrm_lab.errors import UserError

    with pytest.raises(UserError, match=r"table_pages 'giant'.*auto, base, huge"):
        TrainConfig(table_pages="giant")


def test_the_gather_rates_come_from_the_nearest_thread_count_the_probe_measured(monkeypatch, tmp_path):
    """A run on 3 threads of a machine probed at 1 and 4: the two pages' ratio is read at 4, not measured again."""
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    profile = store_profile(tmp_path)
    one, four = ({"base_bytes_per_s": b, "huge_bytes_per_s": 2 * b, "huge_error": None} for b in (1e9, 3e9))
    peaks = profile["devices"]["cpu"]["threads"]["1"]
    profile["devices"]["cpu"]["threads"] = {"1": {**peaks, "gather_pages": one}, "4": {**peaks, "gather_pages": four}}
    (path,) = tmp_path.glob("*.json")
    path.write_text(json.dumps(profile))
    monkeypatch.setattr("dlrm_lab.metrics.device_peaks.gather_on_pages", lambda *a: pytest.fail("measured again"))
    rates, source = gather_pages.gather_page_rates(3)
    assert rates == four and source.endswith("at 4 thread(s)")
    assert gather_pages.gather_page_rates(1)[0] == one
