"""The C allocator an instance runs (`infer.allocator`): found where installed, chosen by its trial, preloaded into
the processes spawned with it, and checked by each instance at its start."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import fake_shared_library

from dlrm_lab.errors import FieldError
from dlrm_lab.infer import allocator, batch_memory

LAYERS = [(13, 64), (64, 16), (40, 32), (32, 1)]


def test_allocators_are_found_by_their_library_names_in_the_directories_searched(tmp_path, monkeypatch):
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert allocator.installed([tmp_path]) == {
        "glibc": "",
        "jemalloc": str(tmp_path / "libjemalloc.so.2"),
        "tcmalloc": str(tmp_path / "libtcmalloc.so.4"),
    }
    monkeypatch.setenv(allocator.DIRS_ENV, "")  # as the suite runs: none but glibc's
    assert allocator.installed() == {"glibc": ""}
    monkeypatch.setenv(allocator.DIRS_ENV, f"{tmp_path / 'none'}:{tmp_path}")
    assert set(allocator.installed()) == {"glibc", "jemalloc", "tcmalloc"}


def test_the_allocator_a_process_runs_is_read_from_its_mappings():
    line = "7f00-7f10 r-xp 00000000 08:01 42    {}\n"
    glibc = line.format("/usr/lib/x86_64-linux-gnu/libc.so.6") + "7ffd-7ffe rw-p 00000000 00:00 0   [stack]\n"
    assert allocator.in_use(glibc) == "glibc"
    assert (
        allocator.in_use(glibc + line.format("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10")) == "tcmalloc"
    )
    assert allocator.in_use(line.format("/opt/j/lib/libjemalloc.so.2") + glibc) == "jemalloc"
    assert allocator.in_use() == "glibc"  # this test process: nothing preloaded
    allocator.check_running("glibc", glibc)
    with pytest.raises(RuntimeError, match="runs glibc's malloc where its plan says jemalloc"):
        allocator.check_running("jemalloc", glibc)


def test_preloaded_puts_the_chosen_library_first_drops_other_allocators_and_restores(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so /usr/lib/libjemalloc.so.2")
    with allocator.preloaded("/usr/lib/libtcmalloc_minimal.so.4"):
        assert os.environ["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/x/libfoo.so"
    assert os.environ["LD_PRELOAD"] == "/x/libfoo.so /usr/lib/libjemalloc.so.2"
    with allocator.preloaded(""):  # glibc's: no allocator's library left
        assert os.environ["LD_PRELOAD"] == "/x/libfoo.so"
    monkeypatch.delenv("LD_PRELOAD")
    with allocator.preloaded(""):
        assert "LD_PRELOAD" not in os.environ
    with allocator.preloaded("/l/libjemalloc.so.2"):
        assert os.environ["LD_PRELOAD"] == "/l/libjemalloc.so.2"
    assert "LD_PRELOAD" not in os.environ


def test_an_allocator_asked_for_by_name_must_be_installed():
    found = {"glibc": ""}
    with pytest.raises(FieldError, match=r"allocator.*'jemalloc': not installed on this machine.*installed: glibc"):
        allocator.choose("jemalloc", LAYERS, "fp32", 1, [1, 8], found=found)
    with pytest.raises(FieldError, match="allowed: auto, glibc, jemalloc, tcmalloc"):
        allocator.library_of("hoard", found)
    named = allocator.choose("tcmalloc", LAYERS, "fp32", 1, [1, 8], found={**found, "tcmalloc": "/l/t.so"})
    assert (named.allocator, named.library, named.reason) == ("tcmalloc", "/l/t.so", "--allocator tcmalloc")


def _never(*_a):
    raise AssertionError("no trial expected")


def test_auto_times_nothing_where_glibc_is_alone_or_must_be_kept():
    alone = allocator.choose("auto", LAYERS, "fp32", 1, [1, 8], found={"glibc": ""}, trial=_never)
    assert alone.allocator == "glibc" and "the only one installed" in alone.reason and alone.batch_ms == {}
    found = {"glibc": "", "jemalloc": "/l/libjemalloc.so.2"}
    kept = allocator.choose("auto", LAYERS, "fp32", 1, [1, 8], only_glibc="told to keep", found=found, trial=_never)
    assert (kept.allocator, kept.library, kept.reason) == ("glibc", "", "auto: glibc's malloc: told to keep")


def test_auto_serves_another_allocator_only_where_its_trial_is_faster_by_the_margin_and_stores_it(
    tmp_path, monkeypatch
):
    from dlrm_lab.metrics.hardware import hardware_fingerprint
    from dlrm_lab.metrics.roofline import load_profile, save_profile
    from tests.test_roofline import fake_profile

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    save_profile(fake_profile(str(hardware_fingerprint()["fingerprint_id"])))
    found = {"glibc": "", "jemalloc": "/l/libjemalloc.so.2", "tcmalloc": "/l/libtcmalloc.so.4"}
    calls = []

    def trial(ms):
        def run(f, layers, dtype, threads, rows):
            calls.append((dict(f), list(layers), dtype, threads, list(rows)))
            return {a: {n: v for n in rows} for a, v in ms.items()}

        return run

    close = allocator.choose("auto", LAYERS, "bf16", 1, [1, 8], found=found, trial=trial(
        {"glibc": 1.0, "jemalloc": 0.97, "tcmalloc": 0.99}))  # fmt: skip
    assert close.allocator == "glibc" and "none 1.05x faster" in close.reason
    assert calls == [(found, LAYERS, "bf16", 1, [1, 8])] and "stored in" in close.source
    # the same shape again: the profile's figures, no trial
    again = allocator.choose("auto", LAYERS, "bf16", 1, [1, 8], found=found, trial=_never)
    assert again.allocator == "glibc" and again.source.startswith("cached in")
    stored = load_profile()["allocator_rates"]
    assert len(stored) == 1 and set(next(iter(stored.values()))["batch_ms"]) == set(found)
    # another shape: measured; the later allocator wins only by the margin over the one kept before it
    faster = allocator.choose("auto", LAYERS[:2], "bf16", 1, [1, 8], found=found, trial=trial(
        {"glibc": 1.0, "jemalloc": 0.9, "tcmalloc": 0.88}))  # fmt: skip
    assert (faster.allocator, faster.library) == ("jemalloc", "/l/libjemalloc.so.2")
    assert faster.batch_ms["tcmalloc"] == {1: 0.88, 8: 0.88} and faster.to_dict()["batch_ms"]["glibc"]["8"] == 1.0
    assert len(calls) == 2

    def broken(*_a):
        raise RuntimeError("allocator trial under jemalloc (/l/libjemalloc.so.2): None, no answer in 120 s")

    failed = allocator.choose("auto", LAYERS[:3], "bf16", 1, [1, 8], found=found, trial=broken)
    assert failed.allocator == "glibc" and "no answer in 120 s" in failed.reason


def test_batch_memory_is_left_to_an_allocator_that_is_not_glibcs():
    def batch():
        raise AssertionError("nothing timed")

    chosen = batch_memory.choose("auto", batch, 32, allocator="jemalloc")
    assert chosen == {"batch_memory": "release", "reason": "jemalloc's own (mallopt is glibc's)", "samples": None,
                      "ms": {}}  # fmt: skip


def test_served_models_refuse_an_allocator_that_cannot_keep_memory_as_asked():
    import dlrm_lab
    from dlrm_lab.infer.served import ServedModel

    spec = dlrm_lab.load_preset("tiny")
    with pytest.raises(FieldError, match="allocator.*'hoard': allowed"):
        ServedModel(name="m", spec=spec, allocator="hoard")
    with pytest.raises(FieldError, match="'jemalloc': --batch-memory keep is told to glibc's malloc"):
        ServedModel(name="m", spec=spec, allocator="jemalloc", batch_memory="keep")
    with pytest.raises(FieldError, match="'tcmalloc': --idle-hold keep-memory"):
        ServedModel(name="m", spec=spec, allocator="tcmalloc", idle_hold="keep-memory")
    assert ServedModel(name="m", spec=spec, allocator="auto", batch_memory="keep").describe()["allocator"] == "auto"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to make a library under an allocator's name")
def test_trial_processes_run_under_the_library_preloaded_and_say_so(tmp_path):
    """The trial spawns each allocator's process with its library first in LD_PRELOAD, and each process reads
    its own mappings: a library under jemalloc's name (made here, as CI has no allocator) is found mapped."""
    fake = fake_shared_library(tmp_path, "libjemalloc.so.2")
    ms = allocator.run_trials({"glibc": "", "jemalloc": str(fake)}, LAYERS, "fp32", 1, [1, 4], rounds=1)
    assert set(ms) == {"glibc", "jemalloc"} and all(v > 0 for per in ms.values() for v in per.values())
    assert set(ms["glibc"]) == {1, 4}
    # a process that does not run what it was started for is named, not timed
    with pytest.raises(RuntimeError, match=r"allocator trial under tcmalloc .*'jemalloc'"):
        allocator.run_trials({"tcmalloc": str(fake)}, LAYERS, "fp32", 1, [1], rounds=1)
