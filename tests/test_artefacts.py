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
