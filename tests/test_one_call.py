"""A served batch is one native call: the `aoti` builds' package holds fbgemm's lookup and the dense part, its
scores are the eager model's, the runner calls it once a batch with Python that does not grow with the batch, and
the tables it reads are the snapshot's mapping that every instance shares, not a copy."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dlrm_lab
from dlrm_lab.infer import accuracy
from dlrm_lab.infer.batches import PackagedRunner, QueryRef, bucket
from dlrm_lab.infer.build import make_build
from dlrm_lab.infer.builds import build_named
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.serving_parts import make_runner
from dlrm_lab.infer.snapshot import map_library, write_snapshot
from dlrm_lab.infer.table_lookup import table_weights
from dlrm_lab.model.dlrm import build_model

SEED = 0
ROWS = 250_000  # per table: 4 x 250k x 8 fp32 = 32 MB of tables, far above what a batch touches


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """tiny with large tables, its eager model, the `aoti` build of it at fp32 and a library."""
    spec = dlrm_lab.load_preset("tiny", num_embeddings=[ROWS] * 4)
    torch.manual_seed(SEED)
    model = build_model(spec).eval()
    library = PackedLibrary.generate(spec, None, SEED, 1024)
    module = make_build(model, "aoti", precision="fp32", table_precision="fp32")
    return model, module, library, tmp_path_factory.mktemp("snapshot")


def _eager_scores(model, library, refs):
    from dlrm_lab.infer.batches import assemble_batch

    dense, kjt = assemble_batch(library, refs, list(model.spec.feature_names))
    with torch.inference_mode():
        return torch.sigmoid(model(dense, kjt)).numpy()


def test_the_package_holds_the_lookup_and_scores_as_the_eager_model(served, monkeypatch):
    model, module, library, _ = served
    runner = make_runner(module, library, torch.device("cpu"), "fp32")
    assert isinstance(runner, PackagedRunner)

    def no_python_lookup(*_args, **_kw):
        raise AssertionError("the TBE module was called from Python: the lookup is not in the package")

    monkeypatch.setattr(type(module.tables), "forward", no_python_lookup)
    for refs in ([QueryRef(0, 1, 3)], [QueryRef(0, 5, 10), QueryRef(1, 40, 200), QueryRef(2, 1, 999)]):
        scores = runner(refs)
        eager = _eager_scores(model, library, refs)
        assert scores.shape == eager.shape and np.abs(scores - eager).max() <= accuracy.FP32_SCORE_TOLERANCE
    assert runner.stages[0] is not None and runner.stages[1:] == (None, None, None)  # one call: no stages apart


def test_a_reduced_precision_package_pads_in_place_and_keeps_each_querys_scores(served):
    """bf16 pads batches to their bucket inside the runner's own buffers: a padded batch's scores are the unpadded
    fused build's, query by query."""
    model, _, library, _ = served
    fused = make_build(model, "fused", precision="bf16", table_precision="fp16")
    packaged = make_build(model, "aoti", precision="bf16", table_precision="fp16")
    plain, whole = (make_runner(m, library, torch.device("cpu"), "bf16") for m in (fused, packaged))
    for refs in ([QueryRef(0, 3, 7)], [QueryRef(0, 17, 0), QueryRef(1, 60, 500)], [QueryRef(0, 1, 1023)]):
        assert np.abs(whole(refs) - plain(refs)).max() <= 1e-2
    assert whole.dense.shape[0] >= 128  # grown to the largest bucket seen (77 samples -> 128), then reused


def test_queries_with_their_own_samples_go_through_the_same_package(served):
    """A query that carries its samples (a gRPC or REST client's) is its own library for the package: its scores are
    those of the same samples served from the instance's library, alone or batched with library queries."""
    _, module, library, _ = served
    runner = make_runner(module, library, torch.device("cpu"), "fp32")
    own = PackedLibrary.from_columns(*library.columns(300, 12))
    from_library = runner([QueryRef(0, 12, 300)])
    assert np.abs(runner([QueryRef(0, 12, 0, own)]) - from_library).max() <= 1e-6
    mixed = runner([QueryRef(0, 5, 40), QueryRef(1, 12, 0, own)])
    assert np.abs(mixed[5:] - from_library).max() <= 1e-6
    assert np.abs(mixed[:5] - runner([QueryRef(0, 5, 40)])).max() <= 1e-6


def _python_calls(runner, refs) -> tuple[int, int]:
    """(Python frames entered, calls of the package's native runner) during `runner(refs)`."""
    frames, native = 0, 0
    call = type(runner).__call__.__code__  # the package's C++ `run`, called from the runner itself

    def profile(_frame, event, arg):
        nonlocal frames, native
        if event == "call":
            frames += 1
        elif event == "c_call" and getattr(arg, "__name__", "") == "run" and _frame.f_code is call:
            native += 1

    runner(refs)  # warm: buffers grown
    sys.setprofile(profile)
    try:
        runner(refs)
    finally:
        sys.setprofile(None)
    return frames, native


def test_a_batch_is_one_native_call_and_its_python_does_not_grow_with_samples_or_queries(served):
    _, module, library, _ = served
    runner = make_runner(module, library, torch.device("cpu"), "fp32")
    one = _python_calls(runner, [QueryRef(0, 1, 0)])
    many_samples = _python_calls(runner, [QueryRef(0, 256, 0)])
    two_queries = _python_calls(runner, [QueryRef(0, 8, 0), QueryRef(1, 8, 500)])
    many_queries = _python_calls(runner, [QueryRef(k, 8, 8 * k) for k in range(32)])
    assert one[1] == many_samples[1] == two_queries[1] == many_queries[1] == 1  # the package, once a batch
    assert one[0] == many_samples[0] and two_queries[0] == many_queries[0], (one, many_samples, many_queries)
    assert many_queries[0] <= 40  # the runner, the gather and numpy's Python wrappers: a constant, whatever the batch


def test_one_query_of_fixed_width_bags_is_copied_in_slices_and_scores_as_gathered(served):
    """A batch of one library query whose bags all hold one id (Criteo's) takes the slice path (its dense rows and
    ids copied, the offsets written when the batch's shape changes): scores equal to the eager model's and to the
    gathered path's, padded or not, as shapes change and come back."""
    model, module, library, _ = served
    features, samples = library.lengths.shape[0], 300
    ids = np.random.default_rng(SEED).integers(0, ROWS, features * samples)
    fixed = PackedLibrary.from_columns(library.dense[:samples], np.ones((features, samples), np.int32), ids)
    assert fixed.bag_width == 1
    runner = make_runner(module, fixed, torch.device("cpu"), "fp32")
    for pad in (False, True):  # padded to the bucket, as below fp32
        runner.pad = pad
        for at, n in ((0, 1), (5, 3), (100, 37), (7, 3), (200, 64), (9, 37)):
            one = runner([QueryRef(0, n, at)])
            size = bucket(n) if pad else n
            assert runner.shape == (n, size)  # the slice path ran
            np.testing.assert_allclose(one, _eager_scores(model, fixed, [QueryRef(0, n, at)]), rtol=1e-5, atol=1e-6)
            if n > 1:  # the same samples as two queries: the gathered path
                two = runner([QueryRef(0, 1, at), QueryRef(1, n - 1, at + 1)])
                assert runner.shape is None
                np.testing.assert_array_equal(one, two)


def test_the_instances_package_reads_the_snapshots_tables_without_a_copy(served):
    """An instance maps the snapshot and hands that mapping to the package: the tables' bytes stay in the shared
    file mapping (no private copy), however many batches it serves."""
    _, module, library, directory = served
    build = build_named("aoti")
    write_snapshot(directory / "s", build.for_snapshot(module), library)
    try:
        mapped = torch.load(directory / "s" / "model.pt", mmap=True, weights_only=False)
        instance = build.in_instance(mapped, torch.device("cpu"), precision="fp32", table_precision="fp32")
        mapped_library = map_library(directory / "s", instance.spec)
        runner = make_runner(instance, mapped_library, torch.device("cpu"), "fp32")
        tables = table_weights(instance.tables)
        assert runner.tables.data_ptr() == tables.data_ptr()
        assert tables.numel() >= 4 * ROWS * 8 * 4
        for k in range(20):
            runner([QueryRef(k, 50, 50 * k)])
        # the tables and the library (rows, lengths, ids) are read through the files' own pages: none copied into
        # this process (a copy-on-write copy is `Anonymous`)
        arrays = [runner.library.dense, runner.library.lengths, runner.library.values]
        for address, file in [(tables.data_ptr(), "model.pt"), *((a.ctypes.data, "library.pt") for a in arrays)]:
            mapping = _mapping_of(address)
            assert mapping["path"] == str(directory / "s" / file)
            assert mapping["Rss"] > 0 and mapping["Anonymous"] == 0, mapping
    finally:
        build.in_instance(module, torch.device("cpu"), precision="fp32", table_precision="fp32")  # the fixture's


def _mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry holding `address`: its path and counters (kB)."""
    entry: dict = {}
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            if found:
                break
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            found = lo <= address < hi
            entry = {"path": head[5] if len(head) > 5 else ""}
        elif found and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
            entry[head[0][:-1]] = int(head[1])
    assert found, "the tables' address is in no mapping"
    return entry


def test_an_idle_hold_locks_the_tables_or_holds_the_cpu_latency_and_a_bad_one_is_refused(served):
    """`--idle-hold lock-tables` locks the instance's tables and library in memory (their pages counted `Locked`);
    `cpu-latency` holds /dev/cpu_dma_latency at 0, or says it needs root; anything else is refused by name."""
    from dlrm_lab.errors import UserError
    from dlrm_lab.infer.instance import IdleHold
    from dlrm_lab.infer.served import ServedModel

    _, module, library, _ = served
    hold = IdleHold.take("lock-tables", module, library)
    try:
        assert _mapping_of(table_weights(module.tables).data_ptr())["Locked"] > 0
        assert _mapping_of(library.values.ctypes.data)["Locked"] > 0
    finally:
        import ctypes

        libc = ctypes.CDLL(None)
        for address, size in hold.handle:
            libc.munlock(ctypes.c_void_p(address), ctypes.c_size_t(size))
    try:
        latency = IdleHold.take("cpu-latency", module, library)
    except RuntimeError as exc:
        assert "cpu_dma_latency" in str(exc) and "root" in str(exc)
    else:
        assert latency.handle.fileno() >= 0
        latency.handle.close()  # released: the kernel drops the request with the file
    allowed = "none, cpu-latency, lock-tables, keep-memory, halt-poll"
    with pytest.raises(UserError, match=rf"idle_hold.*'sleep': allowed: {allowed}"):
        ServedModel("tiny", dlrm_lab.load_preset("tiny"), idle_hold="sleep")


KEEPS_FREED_BLOCKS = """
import numpy as np, psutil
from dlrm_lab.infer.batch_memory import keep_batch_memory
me = psutil.Process()
keep_batch_memory()
# 24 MiB: over glibc's default mmap threshold; 96 MiB: over the most that threshold can be (32 MiB), as a large
# batch's buffers are
for mib in (24, 96):
    block = np.ones(mib << 20, dtype=np.uint8)
    held = me.memory_info().rss
    del block
    assert me.memory_info().rss > held - (8 << 20), mib  # given back, it would drop by the block
"""


def test_keep_memory_keeps_a_freed_batch_buffer_mapped(served, monkeypatch):
    """`--idle-hold keep-memory` keeps malloc's freed memory as `--batch-memory keep` does: after it, a large block
    freed stays in the process (no trim, no munmap), so the next batch's buffers come back without page faults.
    Shown in a process of its own: once told, glibc never raises its mmap threshold again, and this suite's process
    ran every later test so (rm2's training 40 s against 17)."""
    import subprocess

    from dlrm_lab.infer import batch_memory
    from dlrm_lab.infer.instance import IdleHold

    _, module, library, _ = served
    told: list[bool] = []
    monkeypatch.setattr(batch_memory, "keep_batch_memory", lambda: told.append(True))
    IdleHold.take("keep-memory", module, library)
    assert told == [True]
    subprocess.run([sys.executable, "-c", KEEPS_FREED_BLOCKS], check=True, timeout=60)


def test_batch_memory_auto_keeps_memory_only_where_the_largest_batch_is_faster_by_the_margin(monkeypatch):
    """`--batch-memory auto`: an instance's largest batch timed as glibc gives memory back, then as it keeps it
    (each way after an untimed batch); kept only where 5% faster, else glibc's own rule for a large block put back
    (its mmap count and trim threshold); keep and release as asked, untimed; a bad value is one line."""
    from types import SimpleNamespace

    from dlrm_lab.errors import UserError
    from dlrm_lab.infer import batch_memory
    from dlrm_lab.infer.served import ServedModel

    for keep_ms, chosen in ((90.0, "keep"), (97.0, "release")):
        clock, state, told = [0.0], {"kept": False}, []
        monkeypatch.setattr(batch_memory, "time", SimpleNamespace(perf_counter=lambda clock=clock: clock[0]))
        monkeypatch.setattr(batch_memory, "keep_batch_memory", lambda state=state: state.update(kept=True))
        monkeypatch.setattr(
            batch_memory, "_mallopt", lambda told=told: lambda option, value: told.append((option, value)) or 1
        )
        batches = []

        def batch(clock=clock, state=state, keep_ms=keep_ms, batches=batches):
            batches.append(state["kept"])
            clock[0] += (keep_ms if state["kept"] else 100.0) / 1e3

        choice = batch_memory.choose("auto", batch, 4096)
        assert batches == [False] * 4 + [True] * 4  # given back first: glibc's defaults cannot be put back after
        assert choice["batch_memory"] == chosen and choice["samples"] == 4096
        assert choice["ms"] == pytest.approx({"release": 100.0, "keep": keep_ms})
        if chosen == "keep":
            assert (
                told == []
                and choice["reason"] == "auto: memory kept: a 4,096-sample batch 90.00 ms kept vs 100.00 ms given back"
            )
        else:
            assert told == [(batch_memory.M_MMAP_MAX, 65536), (batch_memory.M_TRIM_THRESHOLD, 64 << 20)]
            assert choice["reason"].startswith("auto: memory given back (kept is not 1.05x faster)")
    for asked in ("keep", "release"):
        state = {"kept": False}
        monkeypatch.setattr(batch_memory, "keep_batch_memory", lambda state=state: state.update(kept=True))
        choice = batch_memory.choose(asked, lambda: pytest.fail("timed"), 4096)
        assert choice == {"batch_memory": asked, "reason": f"--batch-memory {asked}", "samples": None, "ms": {}}
        assert state["kept"] == (asked == "keep")
    # memory kept by the idle hold is never given back by auto's trial; on a GPU malloc is not asked
    held = batch_memory.choose("auto", lambda: pytest.fail("timed"), 4096, held=True)
    assert held["batch_memory"] == "keep" and held["reason"] == "kept by --idle-hold keep-memory"
    gpu = batch_memory.choose("auto", lambda: pytest.fail("timed"), 4096, device="cuda")
    assert gpu["batch_memory"] == "release" and gpu["reason"] == "on cuda: a batch's buffers are the device's"
    with pytest.raises(UserError, match=r"batch_memory 'sometimes': allowed: auto, release, keep$"):
        ServedModel("tiny", dlrm_lab.load_preset("tiny"), batch_memory="sometimes")


def test_an_instance_serves_the_fastest_of_its_finalists_by_the_builds_margin(monkeypatch):
    """`infer.finalists.choose`: each finalist timed in turn at each size after an untimed batch each; at each size
    the simplest kept unless a later build is 5% faster, as the serving process's rule; the build served is the
    largest size's, the sizes another won named (`by_size`); nothing timed without a runner-up."""
    from types import SimpleNamespace

    from dlrm_lab.infer import finalists

    assert finalists.sizes_to_time(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert finalists.sizes_to_time(200) == [1, 2, 4, 8, 16, 32, 64, 128, 200]
    assert finalists.sizes_to_time(1) == [1]
    for frozen_ms, chosen in ((90.0, "aoti_frozen"), (97.0, "aoti")):
        clock, calls = [0.0], []
        monkeypatch.setattr(finalists, "time", SimpleNamespace(perf_counter=lambda clock=clock: clock[0]))

        def batch(build, ms, n, clock=clock, calls=calls):
            calls.append((build, n))
            clock[0] += ms / 1e3

        batches = {"aoti_frozen": lambda n, ms=frozen_ms: batch("aoti_frozen", ms, n),
                   "aoti": lambda n: batch("aoti", 100.0, n)}  # fmt: skip
        choice = finalists.choose("aoti_frozen", batches, [4096])
        assert calls == [("aoti_frozen", 4096), ("aoti", 4096)] * 4  # in turn: a phase of the host slows both alike
        assert choice["build"] == chosen and choice["samples"] == 4096 and choice["by_size"] == {}
        assert choice["ms"] == pytest.approx({"aoti": 100.0, "aoti_frozen": frozen_ms})
        verdict = "as the serving process chose" if chosen == "aoti_frozen" else "not aoti_frozen, which"
        assert choice["reason"].startswith(f"{chosen} in this process, {verdict}"), choice["reason"]
    # by size: aoti_tuned (a later build) 0.6x at a few samples, 1.3x at the largest
    clock = [0.0]
    monkeypatch.setattr(finalists, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    cost = {"aoti_frozen": lambda n: 0.5 + 0.002 * n, "aoti_tuned": lambda n: 0.3 + 0.004 * n}

    def timed(build, n):
        clock[0] += cost[build](n) / 1e3

    by = finalists.choose("aoti_frozen", {b: lambda n, b=b: timed(b, n) for b in cost}, [1, 8, 64, 256])
    assert by["build"] == "aoti_frozen" and by["samples"] == 256
    assert by["by_size"] == {1: "aoti_tuned", 8: "aoti_tuned", 64: "aoti_tuned"}  # 64: 0.556 against 0.628 ms
    assert by["ms"] == pytest.approx({"aoti_frozen": 1.012, "aoti_tuned": 1.324})
    assert "; up to 1 samples aoti_tuned (0.304 against 0.502 ms), 8 samples aoti_tuned" in by["reason"]
    alone = finalists.choose("aoti", {"aoti": lambda n: pytest.fail("timed")}, [4096])
    assert alone == {"build": "aoti", "reason": "no finalist: served as the serving process chose", "samples": None,
                     "ms": {}, "by_size": {}}  # fmt: skip


def test_a_packaged_runner_serves_each_batch_size_by_the_package_routed_to_it(served):
    """`PackagedRunner.route`: a batch goes to the run of the smallest routed size that holds it (padded sizes and
    batches of a query's own samples alike), one beyond the largest routed size to the runner's own package; one
    run a batch, its scores as the runner's own."""
    _, module, library, _ = served
    runner = make_runner(module, library, torch.device("cpu"), "fp32")
    expected = runner([QueryRef(0, 5, 0)])
    called: list[tuple[str, int]] = []

    def via(name, run):
        return lambda inputs: called.append((name, inputs[0].shape[0])) or run(inputs)

    own = runner.native
    runner.native = via("own", own)
    runner.route({1: via("one", own), 8: via("eight", own)})
    np.testing.assert_array_equal(runner([QueryRef(0, 5, 0)]), expected)
    for n in (1, 8, 9, 64):
        runner([QueryRef(0, n, 0)])
    assert called == [("eight", 5), ("one", 1), ("eight", 8), ("own", 9), ("own", 64)]
    payload = PackedLibrary.from_columns(*library.columns(0, 3))
    np.testing.assert_array_equal(runner([QueryRef(0, 3, 0, payload)]), expected[:3])
    assert called[-1] == ("eight", 3)


def test_finalists_are_the_close_runners_up_served_from_one_file_and_only_those_are_made():
    """`finalists_of`: within 1.25x of the choice (summed batch times) or 5% faster at one size timed, a file each
    (None: not), the choice a file too; the artefact is asked only of builds close enough (asking may make the
    build); nothing for a choice that was not timed."""
    from dlrm_lab.infer.finalists import finalists_of

    asked: list[str] = []

    def artefact(b):
        asked.append(b)
        return None if b in ("fused", "openvino") else f"/{b}.pt2"

    total = {"eager": 5.0, "fused": 1.2, "aoti": 1.2, "aoti_frozen": 1.0, "aoti_tuned": 1.3, "openvino": 1.1}
    assert finalists_of("aoti_frozen", total, artefact) == {"aoti": "/aoti.pt2"}
    assert sorted(asked) == ["aoti", "aoti_frozen", "fused", "openvino"]  # not eager (5x), not aoti_tuned (1.3x)
    assert finalists_of("fused", total, artefact) == {}  # the choice is no file to switch from
    assert finalists_of("aoti", {"aoti": 1.0, "eager": 2.0}, artefact) == {}  # nothing close
    assert finalists_of("compiled", total, artefact) == {}  # not among the timed
    # beyond 1.25x in all, but 5% faster at one size timed: a finalist (an instance may serve it at that size)
    per_size = {"aoti_frozen": {1: 0.5, 256: 0.5}, "aoti_tuned": {1: 0.3, 256: 1.0}, "aoti": {1: 0.49, 256: 0.71}}
    assert finalists_of("aoti_frozen", total, artefact, per_size) == {
        "aoti": "/aoti.pt2",
        "aoti_tuned": "/aoti_tuned.pt2",
    }
    per_size["aoti_tuned"][1] = 0.48  # faster by less than the margin
    assert finalists_of("aoti_frozen", total, artefact, per_size) == {"aoti": "/aoti.pt2"}


def test_a_finalist_package_serves_from_the_instances_own_tables(served):
    """In an instance, a finalist is its package loaded beside the tables the instance mapped (a sibling module, no
    copy of them), and scores as the build it replaces; a build served from more than one file has no artefact."""
    model, module, library, _ = served
    other = build_named("aoti_frozen").from_artefact(module, module.package)
    assert other is not module and other.package == module.package and other.whole is not module.whole
    assert table_weights(other.tables).data_ptr() == table_weights(module.tables).data_ptr()
    refs = [QueryRef(0, 64, 0)]
    runners = [make_runner(m, library, torch.device("cpu"), "fp32") for m in (module, other)]
    np.testing.assert_array_equal(runners[0](refs), runners[1](refs))
    assert build_named("aoti").artefact(module) == module.package
    for name in ("eager", "fused", "compiled", "openvino"):
        assert build_named(name).artefact(module) is None
        with pytest.raises(NotImplementedError, match=f"{name} is not served from one file"):
            build_named(name).from_artefact(module, module.package)


def test_an_instance_routes_the_sizes_another_finalist_won_to_its_package(served, monkeypatch):
    """`instance._final_build`: package runners are timed at every size the instance serves (`sizes_to_time`), and
    the sizes another finalist won go to that finalist's package within the runner served."""
    from types import SimpleNamespace

    from dlrm_lab.infer import finalists, instance

    _, module, library, _ = served
    asked: list[list[int]] = []

    def choose(served_build, batches, sizes):
        asked.append(list(sizes))
        return finalists.FinalChoice(build="aoti", reason="", samples=64, ms={}, by_size={1: "aoti_frozen"})

    monkeypatch.setattr(finalists, "choose", choose)
    plan = SimpleNamespace(build="aoti", finalists=(("aoti_frozen", module.package),), precision="fp32",
                           history_cache_mb=0)  # fmt: skip
    served_module, runner, chosen = instance._final_build(plan, module, library, torch.device("cpu"), 64)
    assert asked == [[1, 2, 4, 8, 16, 32, 64]] and served_module is module and chosen["by_size"] == {1: "aoti_frozen"}
    assert runner.limits == [1, 2, 4, 8, 16, 32, 64]
    assert runner.runs[0] is not runner.native and all(run is runner.native for run in runner.runs[1:])
    np.testing.assert_array_equal(
        runner([QueryRef(0, 1, 0)]), make_runner(module, library, torch.device("cpu"), "fp32")([QueryRef(0, 1, 0)])
    )


def test_an_instance_times_its_finalists_where_it_serves_and_the_server_serves_what_it_chose(served):
    """A plan's finalists reach each instance, which times them against the plan's build at its largest batch and
    serves the faster (its choice and both times in the manifest's record of it); the server then serves, and
    describes, the build its instances chose."""
    from dlrm_lab.infer.plan import ServingPlan
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.server import InferenceServer

    model, module, library, _ = served
    m = ServedModel("tiny", model.spec, max_batch=64, build="aoti", finalists=(("aoti_frozen", module.package),))
    snapshot = build_named("aoti").for_snapshot(module.sibling())  # the fixture's own module keeps its package
    plan = ServingPlan({"tiny": m}, modules={"tiny": snapshot}, libraries={"tiny": library},
                       precision_choices={"tiny": {}})  # fmt: skip
    lines: list[str] = []
    with InferenceServer(plan, pin_cores=False, log=lines.append) as server:
        (info,) = server.instances.info
        chosen = info["build"]
        assert set(chosen["ms"]) == {"aoti", "aoti_frozen"} and chosen["samples"] == 64, chosen
        assert server.describe().models["tiny"].build == chosen["build"]
        assert any(f"build {chosen['reason']}" in line for line in lines), lines
    if chosen["build"] == "aoti_frozen":
        assert "tiny: served as aoti_frozen: every instance timed it faster than aoti" in lines


def test_halt_poll_is_raised_while_held_and_put_back_after_its_owner_was_killed(served, tmp_path, monkeypatch):
    """`--idle-hold halt-poll`: the haltpoll window raised while an instance lives, the old value put back when it
    ends; a value a killed owner left behind is put back by the next hold; a machine without the driver (or without
    root) gets one line saying so."""
    from dlrm_lab.infer import instance

    _, module, library, _ = served
    knob, saved = tmp_path / "guest_halt_poll_ns", tmp_path / "saved"
    monkeypatch.setattr(instance, "HALT_POLL", knob)
    monkeypatch.setattr(instance, "HALT_POLL_SAVED", saved)
    with pytest.raises(RuntimeError, match=r"--idle-hold halt-poll: cannot set .*guest_halt_poll_ns.*root"):
        instance.IdleHold.take("halt-poll", module, library)
    knob.write_text("0\n")
    owner = instance.IdleHold.take("halt-poll", module, library)
    assert int(knob.read_text()) == instance.HALT_POLL_NS and saved.read_text() == f"{os.getpid()} 0"
    second = instance.IdleHold.take("halt-poll", module, library)  # another instance: not the owner
    second.handle.release()
    assert int(knob.read_text()) == instance.HALT_POLL_NS
    owner.handle.release()
    assert knob.read_text() == "0" and not saved.exists()
    saved.write_text("4194303 200000")  # an owner killed with the window raised
    knob.write_text(str(instance.HALT_POLL_NS))
    again = instance.IdleHold.take("halt-poll", module, library)
    assert again.handle.old == 200000
    again.handle.release()
    assert knob.read_text() == "200000"


def test_a_library_of_fixed_width_bags_gathers_as_the_ragged_path_does():
    """Criteo's one id a feature: `gather_into` takes the fixed-width path (no ragged index), and writes the same
    dense rows, bag offsets and ids as the general path, for one query and for several."""
    spec = dlrm_lab.load_preset("kaggle", max_rows=1000)
    library = PackedLibrary.generate(spec, None, SEED, 300)
    assert library.bag_width == 1
    general = PackedLibrary(library.dense, library.lengths, None, library.values)
    general.__dict__["bag_width"] = None  # the ragged path, on the same samples
    features = library.lengths.shape[0]
    for sizes, offsets in (([1], [7]), ([3, 1, 40], [250, 0, 100])):
        sizes, offsets = np.array(sizes), np.array(offsets)
        n = int(sizes.sum())
        out = [[np.zeros((n, spec.num_dense), np.float32), np.zeros(features * n + 1, np.int32),
                np.zeros(features * n, np.int32)] for _ in range(2)]  # fmt: skip
        assert library.gather_into(sizes, offsets, *out[0]) == general.gather_into(sizes, offsets, *out[1])
        for fast, ragged in zip(*out, strict=True):
            np.testing.assert_array_equal(fast, ragged)
        assert out[0][1][-1] == features * n


def _compiled_calls(package: str) -> set[str]:
    import re
    import zipfile

    with zipfile.ZipFile(package) as z:
        source = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    return set(re.findall(r"aoti_torch_cpu_\w+", source))


def test_a_frozen_package_prepacks_its_dense_layers_and_lowers_int8_to_onednn_and_aoti_keeps_plain_weights(
    served, monkeypatch, tmp_path
):
    """Inductor freezes a graph only with grad off, and otherwise compiles it unfrozen without a word: the packages
    were made so for days (`aoti_int8` dequantised its int8 weights each call to run fp32 GEMMs: 7.4 us a kaggle
    sample against 2.2 frozen). Frozen or not is now each build's own, checked in the package it wrote: a frozen one
    calls oneDNN's prepacked layers and never `addmm`; `aoti` keeps plain weights (`addmm`, packed as it runs)."""
    from dlrm_lab.infer.builds import aoti
    from dlrm_lab.infer.gemm_widths import PaddedK

    model, module, _, _ = served
    calls = _compiled_calls(module.package)
    assert "aoti_torch_cpu_addmm_out" in calls and "aoti_torch_cpu__linear_pointwise" not in calls, calls
    int8 = make_build(model, "aoti_int8", precision="fp32", table_precision="fp32")  # made by export_whole, frozen
    calls = _compiled_calls(int8.package)
    assert "aoti_torch_cpu__qlinear_pointwise_tensor" in calls and not any("addmm" in c for c in calls), calls

    class Exported(Exception):  # `aoti_frozen` asks export_whole for a frozen package (its compile: int8's above)
        pass

    def record(_module, _path, dense_part=None, **kw):
        raise Exported({**kw, "dense_part": dense_part})

    monkeypatch.setenv("DLRM_LAB_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(aoti, "export_whole", record)
    for build, frozen in (("aoti_frozen", True), ("aoti_tuned", True), ("aoti", False)):
        with pytest.raises(Exported) as asked:
            make_build(model, build, precision="fp32", table_precision="fp32")
        assert asked.value.args[0]["frozen"] is frozen, build
        widened = [m for m in asked.value.args[0]["dense_part"].modules() if isinstance(m, PaddedK)]
        assert not widened, build  # fp32: the template's fp32 kernel takes any K; no widths chosen
    # at 16 bits, aoti_tuned's GEMMs get an even K (its template's AMX kernel) and the others keep the model's
    odd_model = build_model(dlrm_lab.load_preset("tiny", num_dense=5)).eval()  # the bottom MLP's K: 5
    for build, padded in (("aoti_tuned", True), ("aoti_frozen", False)):
        with pytest.raises(Exported) as asked:
            make_build(odd_model, build, precision="bf16", table_precision="fp32")
        dense_part = asked.value.args[0]["dense_part"]
        assert any(isinstance(m, PaddedK) for m in dense_part.modules()) is padded, build
        if padded:
            ks = [m.weight.shape[1] for m in dense_part.modules() if hasattr(m, "weight") and m.weight.dim() == 2]
            assert 6 in ks and all(k % 2 == 0 for k in ks), ks


def test_a_batch_shapes_package_inputs_are_made_once_bounded_in_number_and_remade_when_the_buffers_grow(
    served, monkeypatch
):
    """The package's inputs (views of the runner's buffers, and the tables) are made once a batch shape, not three
    tensor slices a batch; a shape served again reuses them and scores the same; at most MAX_SHAPES are kept (a
    ragged library's batches differ in ids); buffers grown for a larger batch are viewed afresh."""
    from dlrm_lab.infer import batches

    _, module, library, _ = served
    runner = make_runner(module, library, torch.device("cpu"), "fp32")
    runner.warm_up(8)  # buffers for 8 samples, so that the shapes below fit them
    first = runner([QueryRef(0, 3, 10)])
    (shape, inputs), *_ = [(k, v) for k, v in runner.inputs.items() if k[0] == 3]
    runner([QueryRef(0, 5, 100)])
    assert np.array_equal(runner([QueryRef(0, 3, 10)]), first) and runner.inputs[shape] is inputs
    assert inputs[0].data_ptr() == runner.views[0].data_ptr() and inputs[3] is runner.tables
    monkeypatch.setattr(batches, "MAX_SHAPES", 2)
    for n in (1, 2, 4, 6):
        runner([QueryRef(0, n, 50)])
        assert len(runner.inputs) <= 2
    grown = runner([QueryRef(0, 600, 0)])  # past the buffers: grown, every kept shape dropped with the old ones
    assert all(v[0].data_ptr() == runner.views[0].data_ptr() for v in runner.inputs.values())
    assert np.abs(grown[:3] - runner([QueryRef(0, 3, 0)])).max() <= 1e-6


def test_a_package_with_the_labs_interaction_kernel_calls_it_and_scores_as_the_eager_model(served):
    """The interaction as the lab's kernel (`model.native`) exports into the package as one op (its name in the
    package's graph, asserted), keys a package of its own, loads in a process that builds the kernel, and scores as
    the eager model."""
    import copy
    import zipfile

    from dlrm_lab.infer.interaction import put, uses_native

    model, module, library, _ = served
    with_kernel = copy.deepcopy(model)
    put(with_kernel, "native")
    packaged = make_build(with_kernel, "aoti", precision="fp32", table_precision="fp32")
    assert uses_native(packaged) and not uses_native(module) and packaged.package != module.package
    with zipfile.ZipFile(packaged.package) as z:
        assert any(b"dlrm_lab::dot_interaction" in z.read(name) for name in z.namelist() if not name.endswith(".so"))
    runner = make_runner(packaged, library, torch.device("cpu"), "fp32")
    for refs in ([QueryRef(0, 1, 3)], [QueryRef(0, 5, 10), QueryRef(1, 40, 200)]):
        assert np.abs(runner(refs) - _eager_scores(model, library, refs)).max() <= accuracy.FP32_SCORE_TOLERANCE


def test_the_serving_plan_times_the_interaction_both_ways_and_puts_its_choice_in_the_model(served, monkeypatch):
    import copy

    from dlrm_lab.infer import interaction

    model = copy.deepcopy(served[0])
    lines = []
    record = interaction.choose_interaction(
        model, precision="fp32", sizes=[1, 64], threads=1, device="cpu", log=lines.append
    )
    assert set(record["ms"]) == {"torch", "native"} and set(record["ms"]["native"]) == {"1", "64"}
    assert all(v > 0 for by in record["ms"].values() for v in by.values())
    assert interaction.uses_native(model) == (record["interaction"] == "native") and lines[-1].startswith("dot")
    # a kernel that does not build: torch's ops, and why
    monkeypatch.setattr(interaction.native, "load", lambda: "the lab's C++ kernels did not build: no compiler")
    record = interaction.choose_interaction(
        model, precision="fp32", sizes=[8], threads=1, device="cpu", log=lines.append
    )
    assert record["interaction"] == "torch" and "no compiler" in record["reason"] and not interaction.uses_native(model)


def test_aoti_buckets_serves_small_batches_by_static_packages_and_keeps_only_those_faster(served, monkeypatch):
    """`aoti_buckets`: a package made for each small batch size alone, kept only where it times faster than the
    dynamic package (the first size not kept ends the list; none kept: the build fails); the runner calls it once
    for a batch of its size, scoring as the eager model; its one file names its packages and loads them beside the
    instance's own tables; an instance routing a size to it pads as its own runner pads."""
    from types import SimpleNamespace

    from dlrm_lab.infer import finalists, instance
    from dlrm_lab.infer.builds import BuildFailed, aoti_buckets

    model, packaged, library, _ = served
    monkeypatch.setattr(aoti_buckets, "FROZEN", build_named("aoti"))  # its dynamic package: the fixture's, cached
    monkeypatch.setattr(aoti_buckets.TUNED, "inductor_configs", {})  # the template's autotuning: seconds a GEMM
    faster = {1: True, 2: False, 4: True, 8: True}
    timed: list[int] = []

    def time_against(_static, _dynamic, _module, n, _tables):
        timed.append(n)
        return (0.1, 0.3) if faster[n] else (0.3, 0.3)

    monkeypatch.setattr(aoti_buckets, "_time_against", time_against)
    module = make_build(model, "aoti_buckets", precision="fp32", table_precision="fp32")
    assert timed == [1, 2] and sorted(module.static) == [1]  # 2 lost: 4 and 8 never made
    assert "static packages for [1] samples" in module.static_reason
    runner = make_runner(module, library, torch.device("cpu"), "fp32")
    assert runner.limits == [1] and runner.exact == 1
    assert runner.run_at(1) is module.whole.static_runs[1] and runner.run_at(2) is runner.native
    for refs in ([QueryRef(0, 1, 5)], [QueryRef(0, 1, 900)], [QueryRef(0, 3, 0)]):
        scores = runner(refs)
        assert np.abs(scores - _eager_scores(model, library, refs)).max() <= accuracy.FP32_SCORE_TOLERANCE
        assert _python_calls(runner, refs)[1] == 1  # one native call a batch, static or not
    # its one file: the packages, loaded beside the tables this instance mapped
    artefact = build_named("aoti_buckets").artefact(module)
    other = build_named("aoti_buckets").from_artefact(module, artefact)
    assert other.static == module.static and other.package == module.package
    assert table_weights(other.tables).data_ptr() == table_weights(module.tables).data_ptr()
    # an instance serving aoti routes a batch of one to aoti_buckets' static package
    choice = finalists.FinalChoice(build="aoti", reason="", samples=8, ms={}, by_size={1: "aoti_buckets"})
    monkeypatch.setattr(finalists, "choose", lambda *_a: choice)
    plan = SimpleNamespace(build="aoti", finalists=(("aoti_buckets", artefact),), precision="fp32",
                           history_cache_mb=0)  # fmt: skip
    _, served_runner, _ = instance._final_build(plan, packaged, library, torch.device("cpu"), 8)
    assert served_runner.exact == 1 and served_runner.limits == [1, 2, 4, 8] and served_runner._padded(3) == 3
    assert served_runner.runs[0] is not served_runner.native
    refs = [QueryRef(0, 1, 40)]
    np.testing.assert_allclose(served_runner(refs), runner(refs), atol=1e-6)
    # `auto` does not make it where the median query is larger than its largest static size, nor where the dense
    # part is too small to compile
    buckets = build_named("aoti_buckets")
    assert "hold 16 samples or more (the median query)" in buckets.skip(10.0, smallest=16)
    assert buckets.skip(10.0, smallest=8) is None and "compiling cannot repay" in buckets.skip(0.01, smallest=1)
    faster[1] = False
    with pytest.raises(BuildFailed, match="no static package beats the dynamic one"):
        make_build(model, "aoti_buckets", precision="fp32", table_precision="fp32")


def test_a_runner_pads_batches_up_to_its_static_sizes_whatever_the_precision(served):
    """`PackagedRunner.route(..., exact=)`: at fp32 (which pads nothing otherwise) a batch of up to `exact` samples
    is padded to its bucket, so a package made for that size alone gets exactly its size; beyond it, as it came."""
    _, module, library, _ = served
    runner = make_runner(module, library, torch.device("cpu"), "fp32")
    assert not runner.pad
    expected = {n: runner([QueryRef(0, n, 0)]) for n in (3, 5, 9)}
    got: list[int] = []
    own = runner.native

    def static(size):
        def run(inputs):
            assert inputs[0].shape[0] == size, (inputs[0].shape, size)
            got.append(size)
            return own(inputs)

        return run

    runner.route({1: static(1), 2: static(2), 4: static(4), 8: static(8)}, exact=8)
    payload = PackedLibrary.from_columns(*library.columns(0, 5))
    for n, refs in ((3, [QueryRef(0, 3, 0)]), (5, [QueryRef(0, 5, 0, payload)]), (9, [QueryRef(0, 9, 0)])):
        np.testing.assert_allclose(runner(refs), expected[n], atol=1e-6)
    assert got == [4, 8]  # 3 -> 4, 5 -> 8, 9: the runner's own package, unpadded
