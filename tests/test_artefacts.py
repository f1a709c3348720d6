"""Serving artefacts on disk: keyed by what made them, rebuilt when partial or corrupt, built once when two
processes ask at once (the `aoti` build's own package from that cache: tests/test_checkpoint_serving.py)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import torch

from dlrm_lab.infer.artefacts import RECORD, cached_artefact, content_key


def _write(text: str, calls: Path | None = None, delay_s: float = 0.0):
    def build(path: Path) -> None:
        if calls is not None:
            with open(calls, "a") as f:
                f.write("built\n")
        time.sleep(delay_s)
        path.write_text(text)

    return build


def test_a_key_names_everything_that_makes_the_artefact():
    w = torch.ones(3, 2)
    base = content_key({"precision": "bf16", "torch": "2.13.0"}, [w])
    assert base == content_key({"torch": "2.13.0", "precision": "bf16"}, [w.clone()])  # order of parts is not content
    assert base != content_key({"precision": "fp32", "torch": "2.13.0"}, [w])
    assert base != content_key({"precision": "bf16", "torch": "2.14.0"}, [w])
    assert base != content_key({"precision": "bf16", "torch": "2.13.0"}, [w + 1e-7])  # other weights
    assert base != content_key({"precision": "bf16", "torch": "2.13.0"}, [w.view(2, 3)])  # other shape


def test_a_package_is_keyed_by_the_precisions_its_module_serves_in_whatever_its_build_says(monkeypatch):
    """`aoti_int8`'s package, made for fp32 tables, was served for int8 ones (its key named no table precision) and
    scored AUC 0.50: every dense package is keyed by its module's precisions, not by what each build passes."""
    from types import SimpleNamespace

    from dlrm_lab.infer import artefacts

    keys = []
    monkeypatch.setattr(artefacts, "cached_artefact", lambda key, *a, **k: keys.append(key))
    spec = SimpleNamespace(to_dict=lambda: {"name": "tiny"}, name="tiny")
    dense = torch.nn.Linear(2, 1)
    for precision, tables in (("fp32", "fp32"), ("fp32", "int8"), ("bf16", "int8"), ("fp32", "fp32")):
        module = SimpleNamespace(spec=spec, precision=precision, table_precision=tables, dense=dense)
        artefacts.dense_package("aoti_int8", module, ".pt2", lambda m, path: None, {"calibration": [0, 2048]})
    assert len(set(keys[:3])) == 3 and keys[3] == keys[0]


def test_a_partial_or_corrupt_artefact_is_rebuilt_never_served(monkeypatch, tmp_path):
    monkeypatch.setenv("DLRM_LAB_BUILD_DIR", str(tmp_path))
    first = cached_artefact("k", ".bin", _write("package"), {})
    assert first.built and first.path.read_text() == "package"
    again = cached_artefact("k", ".bin", _write("other"), {})
    assert not again.built and again.sha256 == first.sha256 and again.reason.startswith("found in the cache")
    first.path.write_text("packagf")  # a flipped byte
    fixed = cached_artefact("k", ".bin", _write("package"), {})
    assert fixed.built and "differ from its record" in fixed.reason and fixed.path.read_text() == "package"
    first.path.with_name(first.path.name + RECORD).unlink()  # the build died before its record
    assert "no record" in cached_artefact("k", ".bin", _write("package"), {}).reason
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.bin", "k.bin.json", "k.lock"]  # no temporaries left


def _race(directory: str, calls: str, out: str) -> None:
    import os

    os.environ["DLRM_LAB_BUILD_DIR"] = directory
    artefact = cached_artefact("same", ".bin", _write("package", Path(calls), delay_s=0.5), {})
    Path(out).write_text(artefact.sha256)


def test_two_processes_building_one_key_at_once_build_it_once(tmp_path):
    calls = tmp_path / "calls"
    spawn = multiprocessing.get_context("fork")  # the child only hashes and writes a file
    procs = [spawn.Process(target=_race, args=(str(tmp_path / "cache"), str(calls), str(tmp_path / f"out{i}")))
             for i in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert calls.read_text() == "built\n"  # the second waited on the lock and found the first's
    assert (tmp_path / "out0").read_text() == (tmp_path / "out1").read_text()


def test_a_cache_that_cannot_take_a_build_is_named_and_a_whole_artefact_is_served_from_it(monkeypatch, tmp_path):
    """A read-only cache still serves what it holds whole; a build into it, or into a full disk, is one line
    naming the directory, never a traceback (issue 57 C16, C17)."""
    import os
    import shutil

    import pytest

    from dlrm_lab.errors import DiskFull, UserError
    from dlrm_lab.infer import artefacts

    monkeypatch.setenv("DLRM_LAB_BUILD_DIR", str(tmp_path))
    built = cached_artefact("k", ".bin", _write("package"), {})
    os.chmod(tmp_path, 0o555)
    try:
        if os.access(tmp_path, os.W_OK):  # root writes anyway: the check is the same one as for a read-only mount
            monkeypatch.setattr(
                Path, "touch", lambda *_a, **_k: (_ for _ in ()).throw(OSError(30, "Read-only file system"))
            )
        again = cached_artefact("k", ".bin", _write("other"), {})
        assert not again.built and again.path == built.path  # served from the read-only cache, not rebuilt
        with pytest.raises(UserError, match=f"^the build cache {tmp_path} is not writable .*DLRM_LAB_BUILD_DIR"):
            cached_artefact("new", ".bin", _write("x"), {})
    finally:
        os.chmod(tmp_path, 0o755)
    monkeypatch.undo()
    monkeypatch.setenv("DLRM_LAB_BUILD_DIR", str(tmp_path))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(artefacts.shutil, "disk_usage", lambda _p: usage._replace(free=10 << 20))
    with pytest.raises(DiskFull, match=r"^the build cache .* has 10 MiB free; this build needs about 2\d\d MiB"):
        cached_artefact("new", ".bin", _write("x"), {})


def test_a_build_waiting_on_anothers_lock_says_who_and_stops_at_its_bound(monkeypatch, tmp_path, capsys):
    import fcntl
    import re

    import pytest

    from dlrm_lab.errors import ServingFault, UserError
    from dlrm_lab.infer import artefacts

    monkeypatch.setenv("DLRM_LAB_BUILD_DIR", str(tmp_path))
    for bad in ("abc", "nan", "inf", "-5"):  # one line naming the variable, where a build would wait
        monkeypatch.setenv("DLRM_LAB_BUILD_WAIT_S", bad)
        said = rf"^DLRM_LAB_BUILD_WAIT_S='{re.escape(bad)}': must be a number of seconds >= 0"
        with pytest.raises(UserError, match=said):
            artefacts.build_wait_s()
    monkeypatch.setenv("DLRM_LAB_BUILD_WAIT_S", "0.5")
    with open(tmp_path / "k.lock", "a+") as held:  # another holder: its own open file, as another process has
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 since 2026-11-29T00:00:00+00:00")
        held.flush()
        with pytest.raises(ServingFault, match=r"^the build of k is held by pid 4242 since .* for \d s"):
            cached_artefact("k", ".bin", _write("x"), {})
    assert "waiting for pid 4242" in capsys.readouterr().err
    assert cached_artefact("k", ".bin", _write("x"), {}).built  # released: built at once


def test_temporaries_of_writers_that_died_are_removed_on_the_next_use(monkeypatch, tmp_path):
    """A writer killed mid-build (OpenVINO's .xml and .bin parts included) leaves temporaries; the next use of the
    cache removes those whose process is gone and keeps a live writer's (issue 57 A4)."""
    import os

    monkeypatch.setenv("DLRM_LAB_BUILD_DIR", str(tmp_path))
    dead = 2**22 + 17  # above any pid this kernel hands out
    stale = [
        tmp_path / f".k1.{dead}.tmp.npz.xml",
        tmp_path / f".k1.{dead}.tmp.npz.bin",
        tmp_path / f".k2.{dead}.tmp.pt2",
    ]
    live = tmp_path / f".k3.{os.getppid()}.tmp.pt2"
    for path in (*stale, live):
        path.write_bytes(b"partial")
    cached_artefact("k", ".bin", _write("package"), {})
    assert not any(p.exists() for p in stale) and live.exists()
