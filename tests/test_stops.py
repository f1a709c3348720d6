"""A stop signal ends the lab cleanly wherever it arrives: the signal stack it is handled on stays valid whatever
native code set and freed meanwhile (`errors.keep_signal_stack`), and clean-up it interrupts runs whole first
(`errors.stops_deferred`): the run closed, the serving snapshot removed."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys

import pytest

from dlrm_lab.errors import Terminated, keep_signal_stack, raise_on_sigterm, stops_deferred

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sigaltstack as Linux has it")


class _Stack(ctypes.Structure):
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)


def _altstack() -> _Stack:
    current = _Stack()
    assert _LIBC.sigaltstack(None, ctypes.byref(current)) == 0
    return current


def _set_altstack(stack: _Stack) -> None:
    assert _LIBC.sigaltstack(ctypes.byref(stack), None) == 0, ctypes.get_errno()


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.fixture
def own_altstack():
    """The test's thread's signal stack put back as it was (pytest's fault handler sets one)."""
    before = _altstack()
    yield
    if before.ss_flags & 2:  # SS_DISABLE
        _set_altstack(_Stack(None, 2, 0))
    else:
        _set_altstack(before)


def test_a_foreign_signal_stack_is_replaced_by_the_labs_own_once(own_altstack):
    foreign = ctypes.create_string_buffer(1 << 16)
    _set_altstack(_Stack(ctypes.addressof(foreign), 0, ctypes.sizeof(foreign)))
    assert keep_signal_stack() is True
    mine = _altstack()
    assert mine.ss_sp != ctypes.addressof(foreign) and mine.ss_size >= 1 << 16 and _mapped(mine.ss_sp)
    assert keep_signal_stack() is False  # already the lab's: left alone
    assert _altstack().ss_sp == mine.ss_sp
    _set_altstack(_Stack(None, 2, 0))
    assert keep_signal_stack() is False  # none set: signals run on the thread's own stack


def test_openvino_engines_freed_in_the_order_made_leave_a_valid_signal_stack(own_altstack, tmp_path):
    """OpenVINO's CPU plugin sets a signal stack on the thread that makes its engine and, when the engine goes,
    puts back the one it found there: two engines freed in the order they were made put back the first's, already
    unmapped, and the next SIGTERM died of a kernel-forced SIGSEGV (a kaggle serving start, 8 of 19 tries)."""
    pytest.importorskip("openvino", reason="the openvino build needs the optional extra dlrm-lab[openvino]")
    import torch

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.build import make_build
    from dlrm_lab.infer.builds.openvino import OpenVINODense
    from dlrm_lab.model.dlrm import build_model

    spec = load_preset("tiny")
    torch.manual_seed(0)
    module = make_build(build_model(spec).eval(), "openvino", precision="fp32", table_precision="fp32")
    dense, pooled = torch.zeros(2, spec.num_dense), torch.zeros(2, len(spec.feature_names) * spec.embedding_dim)
    first, second = OpenVINODense(module.package, "fp32"), OpenVINODense(module.package, "fp32")
    for engine in (first, second):
        assert engine(dense, pooled).shape == (2,)  # compiled: its engine made
    module.compiled = None
    del engine, first
    gc.collect()
    del second
    gc.collect()
    stack = _altstack()
    assert not stack.ss_flags & 2 and _mapped(stack.ss_sp) and _mapped(stack.ss_sp + stack.ss_size - 1)


def test_a_stop_within_clean_up_is_raised_after_it():
    before = signal.getsignal(signal.SIGTERM)
    done = []
    try:
        raise_on_sigterm()
        with pytest.raises(Terminated, match="SIGTERM"):
            with stops_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("after the signal")
                os.kill(os.getpid(), signal.SIGTERM)  # a second stop is still one
                done.append("the rest")
            done.append("not reached")  # raised at the block's end
        assert done == ["after the signal", "the rest"]
        assert signal.getsignal(signal.SIGTERM) is not None  # the lab's handler put back
        with stops_deferred():  # nothing sent: nothing raised
            done.append("quiet")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert done[-1] == "quiet"


def test_a_sigterm_while_the_server_stops_still_removes_its_snapshot_and_ends_its_instances():
    """A SIGTERM arriving as an Offline run ended interrupted the instances' join: the snapshot (a tmpfs of 2 MiB
    pages, its tables in RAM) stayed mounted. Now the stop runs whole and the SIGTERM is raised after it."""
    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.plan import plan_serving
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.server import InferenceServer

    served = ServedModel("tiny", load_preset("tiny"), max_delay_ms=0.0, library_samples=256)
    before = signal.getsignal(signal.SIGTERM)
    try:
        raise_on_sigterm()
        server = InferenceServer(plan_serving([served]), pin_cores=False).start()
        (snapshot,) = server._snapshots
        assert snapshot.is_dir()
        procs = list(server.instances._procs)
        real_stop = server.instances.stop

        def stop_and_signalled(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # as the instances are told to end
            real_stop(*args, **kwargs)

        server.instances.stop = stop_and_signalled
        with pytest.raises(Terminated):
            server.stop()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not snapshot.exists() and not any(p.is_alive() for p in procs)


def test_a_sigterm_while_a_run_closes_still_closes_it(tmp_path, monkeypatch):
    """The run's tables merged and its manifest written before the stop is raised: never a run left `running`; a
    stop while it waits for its peers (a barrier that may never return) ends the wait and closes it failed."""
    import time

    import pyarrow as pa

    import dlrm_lab.metrics.run as run_module
    from dlrm_lab.metrics.run import Run, read_manifest

    schema = pa.schema([("query_id", pa.int64()), ("latency_ms", pa.float64())])
    before = signal.getsignal(signal.SIGTERM)
    real_consolidate = run_module.consolidate_run

    def consolidate_and_signalled(path):
        os.kill(os.getpid(), signal.SIGTERM)  # the stop arrives as the run closes
        return real_consolidate(path)

    def barrier_never_returning():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)

    try:
        raise_on_sigterm()
        closing = Run.create(tmp_path / "runs", kind="infer", config={})
        closing.table("queries", schema).append({"query_id": 1, "latency_ms": 2.5})
        monkeypatch.setattr(run_module, "consolidate_run", consolidate_and_signalled)
        with pytest.raises(Terminated):
            closing.finish("ok")
        monkeypatch.setattr(run_module, "consolidate_run", real_consolidate)
        waiting = Run.create(tmp_path / "runs", kind="train", config={})
        waiting.table("queries", schema).append({"query_id": 2, "latency_ms": 1.0})
        waiting.before_finish(barrier_never_returning)
        started = time.monotonic()
        with pytest.raises(Terminated):
            waiting.finish("ok")
        assert time.monotonic() - started < 30  # the wait ended by the stop, not deferred over it
    finally:
        signal.signal(signal.SIGTERM, before)
    assert read_manifest(closing.dir)["status"] == "ok" and (closing.dir / "queries.parquet").exists()
    manifest = read_manifest(waiting.dir)
    assert manifest["status"] == "failed" and manifest["error"].startswith("Terminated: terminated by signal SIGTERM")
    assert (waiting.dir / "queries.parquet").exists()
