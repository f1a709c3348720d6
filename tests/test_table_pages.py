"""The serving snapshot's pages (`--table-pages`): the tables every instance maps, on 2 MiB pages where asked or
where this machine's gather measured faster on them; a tmpfs the server mounts, unmounted when it stops."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import store_profile

from dlrm_lab.config import load_preset
from dlrm_lab.errors import UserError
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.plan import Planner, plan_serving
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.server import InferenceServer
from dlrm_lab.infer.snapshot import remove_stale_snapshots, write_snapshot
from dlrm_lab.metrics import huge_pages

ROWS = 250_000  # per table: 4 x 250k x 8 fp32 = 32 MB, sixteen 2 MiB pages


def _may_mount(tmp_path) -> str | None:
    """Why a tmpfs of huge pages cannot be mounted here (not root, no THP), or None."""
    probe = tmp_path / "probe"
    probe.mkdir()
    why = huge_pages.mount_huge_tmpfs(probe)
    if why is None:
        huge_pages.unmount(probe)
    return why


def test_a_bad_table_pages_is_one_line():
    with pytest.raises(UserError, match=r"table_pages 'giant': allowed: auto, base, huge"):
        ServedModel("tiny", load_preset("tiny"), table_pages="giant")


@pytest.mark.parametrize(
    "asked, device, rates, chosen, said",
    [
        ("auto", "cpu", (5e9, 10e9), "huge", "huge pages are faster"),
        ("auto", "cpu", (5e9, 5.1e9), "base", "huge pages not 1.05x faster"),
        ("auto", "cpu", None, "base", "this machine's profile has no gather on 2 MiB pages"),
        ("auto", "cuda", (5e9, 10e9), "base", "served on cuda"),
        ("base", "cpu", (5e9, 10e9), "base", "--table-pages base"),
        ("huge", "cpu", None, "huge", "--table-pages huge"),
    ],
)
def test_auto_takes_huge_pages_only_where_the_machine_profile_measured_them_faster(
    monkeypatch, tmp_path, asked, device, rates, chosen, said
):
    """Read from the machine's profile, never measured at a server's start (a quick probe's gather is seconds)."""
    monkeypatch.setattr(huge_pages, "unsupported", lambda: None)
    monkeypatch.setattr("dlrm_lab.metrics.device_peaks.gather_on_pages", lambda *a: pytest.fail("measured at start"))
    if rates is not None:
        profile = store_profile(tmp_path)
        base, huge = rates
        pages = {"base_bytes_per_s": base, "huge_bytes_per_s": huge, "huge_error": None}
        profile["devices"]["cpu"]["threads"]["1"]["gather_pages"] = pages
        (path,) = tmp_path.glob("*.json")
        path.write_text(json.dumps(profile))
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    planner = Planner([ServedModel("tiny", load_preset("tiny"), table_pages=asked)], device=device, seed=0)
    planner.precision_choices["tiny"] = {}
    planner.choose_table_pages(planner.models["tiny"])
    choice = planner.precision_choices["tiny"]["table_pages_choice"]
    assert planner.models["tiny"].table_pages == chosen and choice["table_pages"] == chosen
    assert choice["requested"] == asked and said in choice["reason"]


def test_a_refused_mount_is_said_and_the_snapshot_written_on_base_pages(monkeypatch, tmp_path):
    """Not root: the mount is refused (EPERM), said in one line, and the snapshot is written all the same."""

    class RefusingLibc:
        def mount(self, *args):
            ctypes.set_errno(errno.EPERM)
            return -1

    monkeypatch.setattr(huge_pages, "unsupported", lambda: None)
    monkeypatch.setattr(huge_pages, "_c", lambda: RefusingLibc())
    spec = load_preset("tiny")
    library = PackedLibrary.generate(spec, None, 0, 64)
    written, why = write_snapshot(tmp_path / "snap", torch.nn.Linear(2, 2), library, "huge")
    assert why == "mounting a tmpfs on huge pages needs root (CAP_SYS_ADMIN); this process has not"
    assert written > 0 and not os.path.ismount(tmp_path / "snap") and (tmp_path / "snap" / "model.pt").is_file()


def test_a_server_on_huge_pages_maps_its_tables_whole_and_unmounts_when_it_stops(tmp_path):
    """As root: the snapshot is a tmpfs of 2 MiB pages while the server runs, each instance maps the tables on whole
    2 MiB pages (its smaps), the scores are the same, and the mount is gone with the server; a killed server's
    mounted snapshot is unmounted and removed by the next start."""
    if (why := _may_mount(tmp_path)) is not None:
        pytest.skip(f"no tmpfs of huge pages here: {why}")
    spec = load_preset("tiny", num_embeddings=[ROWS] * 4)
    # one build, not `auto`'s every build compiled (the pages are the property, not the build): 155 s on CI
    served = ServedModel(
        "tiny", spec, instances=1, max_batch=64, library_samples=1024, table_pages="huge", build="fused"
    )
    with InferenceServer(plan_serving([served], seed=0)) as server:
        (snap,) = server._snapshots
        assert os.path.ismount(snap)
        choice = server.precision_choices["tiny"]["table_pages_choice"]
        assert choice["table_pages"] == "huge" and choice["huge_bytes"] >= 2 * huge_pages.HUGE_PAGE, choice
        (info,) = server.instance_info
        assert huge_pages.pmd_mapped_bytes(info["pid"], snap) == choice["huge_bytes"]
    assert not snap.exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"dlrm-lab-{dead.stdout.strip()}-tiny-1"
    stale.mkdir()
    assert huge_pages.mount_huge_tmpfs(stale) is None
    (stale / "model.pt").write_bytes(b"x" * (4 << 20))
    assert remove_stale_snapshots(tmp_path) == [stale]
    assert not stale.exists()


def test_the_servers_record_of_the_pages_keeps_the_plans_and_adds_what_the_start_found(tmp_path):
    """A refused mount turns the plan's huge into base with why; the bytes mapped whole are added beside it; a model
    the plan recorded nothing for gets a record of its own."""
    from dlrm_lab.infer.snapshot import refused_pages, say_pages

    said: list[str] = []
    choices = {"kaggle": {"table_pages_choice": {"requested": "auto", "table_pages": "huge", "reason": "faster"}}}
    refused_pages(choices, "kaggle", "needs root", said.append)
    kept = {"requested": "auto", "table_pages": "base", "reason": "needs root"}
    assert choices["kaggle"]["table_pages_choice"] == kept
    say_pages("tiny", tmp_path, [os.getpid()], 2 << 20, choices, said.append)  # nothing of tmp_path mapped here
    assert choices["tiny"] == {"table_pages_choice": {"huge_bytes": 0}}
    assert said == ["kaggle: table pages base: needs root",
                    f"tiny: its snapshot on 2 MiB pages ({tmp_path}): 0 MiB of 2 mapped whole by each instance after "
                    "its warm-up"]  # fmt: skip
