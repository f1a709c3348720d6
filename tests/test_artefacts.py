"""Serving artefacts on disk: keyed by what made them, rebuilt when partial or corrupt, built once when two
processes ask at once; the `aoti` build serves a package from that cache and never a damaged one."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import dlrm_lab
from dlrm_lab.data import synthetic_generator
from dlrm_lab.infer import accuracy
from dlrm_lab.infer.artefacts import RECORD, cached_artefact, content_key
from dlrm_lab.infer.build import make_build
from dlrm_lab.infer.builds import build_named
from dlrm_lab.model.dlrm import build_model


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


def test_the_aoti_build_loads_its_package_from_the_cache_and_refuses_a_damaged_one():
    torch.manual_seed(0)
    model = build_model(dlrm_lab.load_preset("tiny")).eval()
    block = synthetic_generator(model.spec, None, seed=0).samples(0, 512)
    first = make_build(model, "aoti", precision="fp32", table_precision="fp32")
    second = make_build(model, "aoti", precision="fp32", table_precision="fp32")  # the same weights: cached
    assert first.package == second.package and second.package_reason.startswith("found in the cache")
    eager = accuracy.score_build(model, block, "fp32")
    assert np.abs(accuracy.score_build(second, block, "fp32") - eager).max() <= accuracy.FP32_SCORE_TOLERANCE
    snapshot = build_named("aoti").for_snapshot(second)
    assert snapshot.compiled is None  # instances load the package themselves
    data = Path(first.package).read_bytes()
    Path(first.package).write_bytes(data[:-16])  # truncated on disk after it was built
    with pytest.raises(RuntimeError, match="partial or corrupt"):
        build_named("aoti").in_instance(snapshot, torch.device("cpu"), precision="fp32", table_precision="fp32")
    Path(first.package).write_bytes(data)
