"""Issue 32's failures (reliability, third round), each ended as the rule says, in-process: one `error:`
line naming the culprit, exit 2 for a user mistake, nothing written where nothing should be."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dlrm_lab.errors import UserError
from tests.conftest import run_cli_in_process, store_profile


def _deny_writes_under(monkeypatch, root: Path) -> None:
    """os.access says no write under `root` (root ignores permission bits, so chmod cannot stand in)."""
    import dlrm_lab.metrics.run as run_module

    real = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and Path(path).resolve().is_relative_to(root.resolve()):
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(run_module.os, "access", access)


@pytest.mark.parametrize(
    "args",
    [
        ("train", "--preset", "tiny", "--steps", "1"),
        ("infer", "run", "--model", "tiny", "--duration", "0.1"),
        ("data", "gen", "--preset", "tiny", "--rows", "10", "--out"),
    ],
)
def test_a_metrics_dir_that_cannot_be_written_is_refused_before_anything_starts(tmp_path, monkeypatch, args):
    locked = tmp_path / "locked"
    locked.mkdir()
    _deny_writes_under(monkeypatch, locked)
    target = locked / "sub" if args[0] == "data" else locked
    flag = () if args[0] == "data" else ("--metrics-dir",)
    code, out, err = run_cli_in_process(*args, *flag, str(target), *(() if args[0] == "data" else ("--no-progress",)))
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: --") and str(locked) in line and "not writable by this user" in line
    assert "Traceback" not in err and list(locked.iterdir()) == []
    assert "precision" not in err  # refused before anything was measured


@pytest.mark.parametrize(
    "args",
    [
        ("train", "--preset", "tiny", "--steps", "1", "--no-progress", "--metrics-dir"),
        ("infer", "run", "--model", "tiny", "--duration", "0.1", "--no-progress", "--metrics-dir"),
        ("report", ".", "--out"),
    ],
)
def test_a_path_that_is_not_utf8_is_refused_in_one_line(tmp_path, args):
    bad = os.fsdecode(os.fsencode(tmp_path) + b"/runs-\xff\xfe")  # a name made under another encoding
    code, _, err = run_cli_in_process(*args, bad)
    assert code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "/runs-\\xff\\xfe: not UTF-8" in line and list(tmp_path.iterdir()) == []


def test_a_probe_timeout_that_is_no_number_of_seconds_is_one_line():
    for value in ("inf", "nan", "0"):
        code, _, err = run_cli_in_process("machine", "probe", "--timeout", value)
        assert code == 2 and err.strip().endswith(": must be a finite number of seconds above 0"), err


def test_the_read_only_reason_is_named(tmp_path, monkeypatch):
    from dlrm_lab.metrics import run as run_module

    _deny_writes_under(monkeypatch, tmp_path)

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(run_module.os, "statvfs", lambda _path: ReadOnly())
    with pytest.raises(UserError, match=r"--metrics-dir .*/runs: .* is on a read-only file system; choose another"):
        run_module.check_writable(tmp_path / "runs", "--metrics-dir")
    with pytest.raises(UserError, match="is not a directory"):
        (tmp_path / "file").write_text("x")
        run_module.check_writable(tmp_path / "file" / "runs", "--metrics-dir")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("fp32", 0, "gemm_flops_per_s.fp32 = 0: must be a number > 0"),
        ("fp32", -1e9, "gemm_flops_per_s.fp32 = -1000000000.0: must be a number > 0"),
        ("fp32", "fast", "gemm_flops_per_s.fp32 = 'fast': must be a number > 0"),
        ("memory_bytes_per_s", None, "memory_bytes_per_s = None: must be a number > 0"),
        ("threads", [1], "devices.cpu.threads = [1]: must be a table per thread count"),
    ],
)
def test_a_machine_profile_with_impossible_peaks_is_refused_naming_file_and_field(tmp_path, monkeypatch, field,
                                                                                 value, message):  # fmt: skip
    from dlrm_lab.metrics.roofline import load_profile

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    profile = store_profile(tmp_path)
    cpu = profile["devices"]["cpu"]
    if field == "threads":
        cpu["threads"] = value
    elif field == "fp32":
        cpu["threads"]["1"]["gemm_flops_per_s"]["fp32"] = value
    else:
        cpu["threads"]["1"][field] = value
    path = tmp_path / f"{profile['fingerprint_id']}.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(UserError) as err:
        load_profile()
    assert str(err.value).startswith(f"{path}: devices.cpu") and message in str(err.value)
    assert "machine probe --force" in str(err.value)
    code, _, stderr = run_cli_in_process("machine", "show")
    assert code == 2 and "Traceback" not in stderr and message in stderr


def test_a_profile_directory_that_cannot_be_written_is_one_line_and_runs_go_on(tmp_path, monkeypatch):
    from dlrm_lab.metrics.measured import store_measured
    from dlrm_lab.metrics.roofline import ProfileNotStored, save_profile

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(blocked / "machines"))
    profile = {"fingerprint_id": "f" * 16, "devices": {}, "comms": {}, "probed_at": "now"}
    with pytest.raises(ProfileNotStored, match=r"cannot store the machine profile in .*machines: .*MACHINE_DIR"):
        save_profile(profile)
    assert str(store_measured(profile, "build_rates", "k", {"x": 1})).startswith("nowhere (cannot store")
    code, _, err = run_cli_in_process("machine", "probe", "--quick")  # refused before it measures anything
    assert code == 2 and "Traceback" not in err
    assert "DLRM_LAB_MACHINE_DIR" in err and "is not a directory" in err


@pytest.mark.parametrize("kind", ["preset", "grid", "data spec"])
def test_a_file_that_is_not_utf8_is_named_in_one_line(tmp_path, kind):
    bad = tmp_path / ("bad.toml")
    bad.write_bytes(b'name = "caf\xe9"\n')
    args = {"preset": ("train", "--preset", str(bad), "--steps", "1"), "grid": ("sweep", str(bad)),
            "data spec": ("train", "--preset", "tiny", "--data-spec", str(bad), "--steps", "1")}[kind]  # fmt: skip
    code, _, err = run_cli_in_process(*args, "--no-progress")
    assert code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert line == f"error: {bad}: not UTF-8 text (byte 0xe9 on line 1); TOML files are UTF-8: save it as UTF-8"


def test_files_that_are_not_regular_or_are_huge_are_named_before_they_are_read(tmp_path):
    fifo = tmp_path / "catalogue.toml"
    os.mkfifo(fifo)  # a read of it would wait for a writer forever
    huge = tmp_path / "huge.toml"
    with open(huge, "wb") as f:
        f.truncate(65 << 20)  # sparse: no disk spent
    for args, line in (
        (("machine", "prices", "--catalogue", "/dev/zero"),
         "error: /dev/zero: a character device, which may never end, not a price catalogue: give a regular file"),
        (("machine", "prices", "--catalogue", str(fifo)),
         f"error: {fifo}: a FIFO, which may never end, not a price catalogue: give a regular file"),
        (("presets", "show", "/dev/zero"),
         "error: /dev/zero: a character device, which may never end, not a preset file: give a regular file"),
        (("train", "--preset", str(tmp_path), "--steps", "1"),
         f"error: {tmp_path}: a directory, not a preset file: give a regular file"),
        (("train", "--preset", str(huge), "--steps", "1"),
         f"error: {huge}: 68,157,440 bytes, more than any preset file holds (at most 67,108,864)"),
    ):  # fmt: skip
        code, _, err = run_cli_in_process(*args)
        assert (code, err.strip()) == (2, line)


@pytest.mark.parametrize(("name", "value", "why"), [
    ("DLRM_LAB_FLUSH_SECONDS", "-1", "must be a number of seconds > 0"),
    ("DLRM_LAB_CANARY_S", "soon", "must be a number of seconds >= 0 (at most 3600"),
    ("DLRM_LAB_PROGRESS_INTERVAL_S", "nan", "must be a number of seconds >= 0"),
    ("DLRM_LAB_BUILD_WAIT_S", "-5", "must be a number of seconds >= 0"),
])  # fmt: skip
def test_a_bad_setting_in_the_environment_is_one_line_before_any_work(tmp_path, monkeypatch, name, value, why):
    """A bad DLRM_LAB_FLUSH_SECONDS was refused only when the run directory was made, after training's start-up
    trials (12 s in the suite), and a bad DLRM_LAB_BUILD_WAIT_S only once a build waited: every numeric setting is
    parsed as the command starts, before it prints or makes anything."""
    monkeypatch.setenv(name, value)
    code, out, err = run_cli_in_process("train", "--preset", "tiny", "--steps", "1", "--metrics-dir",
                                        str(tmp_path / "r"), "--no-progress")  # fmt: skip
    (line,) = err.splitlines()  # one line, naming the variable, its value and what it must be
    assert code == 2 and line.startswith(f"error: {name}={value!r}: {why}")
    assert out == "" and not (tmp_path / "r").exists()  # nothing set up: not even the model's line


def test_a_load_too_large_for_memory_is_refused_before_memory_is_spent(tmp_path):
    from dlrm_lab.infer.load import BYTES_PER_QUERY, Arrivals, check_planned

    check_planned(1000.0, 10.0, available_bytes=10**9)
    with pytest.raises(UserError, match=r"^qps 1e\+06 for duration_s 10 s: 1e\+07 queries planned, about 23.3 GiB"):
        check_planned(1e6, 10.0, available_bytes=10 * 2**30)
    with pytest.raises(UserError, match="at most"):
        Arrivals().schedule(1e12, 2.0, None)  # refused before numpy allocates anything
    assert BYTES_PER_QUERY > 1000
    code, _, err = run_cli_in_process("infer", "run", "--model", "tiny", "--qps", "1e9", "--duration", "2",
                                      "--metrics-dir", str(tmp_path), "--no-progress")  # fmt: skip
    assert code == 2 and "Traceback" not in err and "queries planned" in err and list(tmp_path.iterdir()) == []


def test_more_instance_threads_than_cores_warn_and_far_more_are_refused():
    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.served import OVERSUBSCRIPTION_LIMIT, ServedModel, check_cores

    tiny = load_preset("tiny")
    assert check_cores([ServedModel("a", tiny, instances=2)], cores=2) is None
    warning = check_cores([ServedModel("a", tiny, instances=2, threads=2)], cores=2)
    assert warning.startswith("warning: a: --instances 2 x --threads 2 = 4 threads on 2 usable cores")
    with pytest.raises(UserError, match=rf"= 64 threads on 2 usable cores, more than {OVERSUBSCRIPTION_LIMIT}x"):
        check_cores([ServedModel("a", tiny, instances=64)], cores=2)
    assert check_cores([ServedModel("a", tiny, instances=64)], cores=2, device="cuda") is None


def test_small_rates_keep_their_figures_and_sigterm_names_no_launcher_that_was_not_there(monkeypatch):
    import signal

    from dlrm_lab.errors import Terminated, raise_on_sigterm
    from dlrm_lab.metrics.precision import gflops

    assert (gflops(4.2e7), gflops(1.5e10), gflops(4.88e11)) == ("0.042", "15.0", "488.0")
    for var in ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    old = signal.getsignal(signal.SIGTERM)
    try:
        raise_on_sigterm()
        with pytest.raises(Terminated, match=r"SIGTERM \(sent by another process"):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        monkeypatch.setenv("SLURM_JOB_ID", "7")
        raise_on_sigterm()
        with pytest.raises(Terminated, match=r"SIGTERM \(a launcher stopped the job\)"):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_an_embedding_dim_the_kernels_cannot_run_is_refused_when_the_preset_is_read(tmp_path):
    from dlrm_lab.config import load_preset
    from dlrm_lab.config.specs import MAX_EMBEDDING_DIM

    text = (Path(__file__).parents[1] / "models" / "tiny.toml").read_text()
    for dim in (32_684, 16_388, 30):  # near fbgemm's CPU Adagrad backward's SIGSEGV; not a multiple of 4 (an assert)
        preset = tmp_path / f"wide{dim}.toml"
        preset.write_text(text.replace("embedding_dim = 8", f"embedding_dim = {dim}"))
        with pytest.raises(UserError, match=rf"embedding_dim = {dim}: must be a multiple of 4 up to 16,384"):
            load_preset(preset)
    assert MAX_EMBEDDING_DIM % 4 == 0


def test_a_sweep_point_killed_by_a_signal_names_it_and_its_run_is_failed(tmp_path, monkeypatch):
    import sys

    from dlrm_lab.metrics.run import read_manifest
    from dlrm_lab.sweep import run as sweep

    slot = tmp_path / "p0000-r00"
    child = ("import os, signal; from dlrm_lab.metrics.run import Run; "
             f"Run.create({str(slot)!r}, 'train', {{}}); os.kill(os.getpid(), signal.SIGSEGV)")  # fmt: skip
    monkeypatch.setattr(sweep, "point_command", lambda spec, params, slot: ([sys.executable, "-c", child], {}))
    status, _ = sweep._run_point(None, {}, slot)
    assert status == "failed"
    assert (slot / "point.log").read_text().splitlines()[
        -1
    ] == "sweep: the point's process was killed by signal SIGSEGV"
    (run_dir,) = [p for p in slot.iterdir() if p.is_dir()]
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["error"] == "the point's process was killed by signal SIGSEGV"


def test_a_run_whose_process_dies_of_a_signal_is_marked_failed_at_once_by_its_watcher(tmp_path):
    import subprocess
    import sys
    import time

    from dlrm_lab.metrics.run import read_manifest

    child = ("import os, signal; from dlrm_lab.metrics.run import Run; "
             f"Run.create({str(tmp_path)!r}, 'train', {{}}); os.kill(os.getpid(), signal.SIGSEGV)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", child], capture_output=True).returncode == -11
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    deadline = time.monotonic() + 30
    while read_manifest(run_dir)["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)  # no recovery asked for: the watcher marks it
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed", manifest
    assert manifest["error"] == "process killed by signal SIGSEGV (Segmentation fault); Python's report in fault.log"


def test_a_probe_is_judged_by_what_else_the_machine_did():
    from dlrm_lab.metrics.cpu import LoadWatch
    from dlrm_lab.metrics.trust import OTHER_CORES_LIMIT, judge

    quiet = judge(10.0, 0.05, 0.0, 1.1)
    assert quiet.trusted and quiet.why.startswith("quiet: other processes 0.05 cores")
    busy = judge(10.0, 1.3, 0.08, 2.5)
    assert not busy.trusted and busy.why == (f"other processes used 1.30 cores (limit {OTHER_CORES_LIMIT:g}); the "
                                             "host stole 8% of the cores' time (limit 5%); GEMM repeats differed "
                                             "2.50x (limit 1.5x)")  # fmt: skip
    with LoadWatch() as watch:  # this process's own work is not "other"
        sum(i * i for i in range(300_000))
    assert watch.seconds > 0 and watch.other_cores >= 0 and 0 <= watch.steal_share <= 1


def _probe_with_load(monkeypatch, tmp_path, gflops: float, trusted: bool, run: bool = True):
    """run_probe with a fake measurement: a profile of `gflops` fp32 (1 thread), judged `trusted`."""
    from dlrm_lab.metrics import probe
    from dlrm_lab.metrics.hardware import hardware_fingerprint
    from dlrm_lab.metrics.trust import judge

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))

    def fake_probe_machine(**_kwargs):
        peaks = {"gemm_flops_per_s": {"fp32": gflops * 1e9}, "memory_bytes_per_s": 1e10, "gather_bytes_per_s": 5e9}
        load = judge(5.0, 0.0 if trusted else 1.5, 0.0, 1.1)
        return {"fingerprint_id": hardware_fingerprint()["fingerprint_id"], "probed_at": f"probe-{gflops}",
                "devices": {"cpu": {"threads": {"1": peaks}}}, "comms": {}, "load": load.to_dict()}  # fmt: skip

    monkeypatch.setattr(probe, "probe_machine", fake_probe_machine)
    return probe.run_probe(quick=True, device="cpu") if run else None


def test_a_busy_probe_never_replaces_a_profile_and_a_better_peak_is_kept(tmp_path, monkeypatch):
    from dlrm_lab.metrics.roofline import load_profile

    def fp32():
        return load_profile()["devices"]["cpu"]["threads"]["1"]["gemm_flops_per_s"]["fp32"] / 1e9

    first = _probe_with_load(monkeypatch, tmp_path, 197.0, trusted=True)
    assert first.written and fp32() == 197.0
    busy = _probe_with_load(monkeypatch, tmp_path, 2.2, trusted=False)
    assert busy.written is None and "the machine was busy while probing (other processes used 1.50 cores" in (
        busy.refused
    )
    assert fp32() == 197.0 and load_profile()["probed_at"] == "probe-197.0"
    lower = _probe_with_load(monkeypatch, tmp_path, 180.0, trusted=True)  # quiet, but lower: the better is kept
    assert lower.written and fp32() == 197.0
    assert load_profile()["kept_from_earlier_probe"] == ["cpu.threads.1.gemm_flops_per_s.fp32"]
    _probe_with_load(monkeypatch, tmp_path, 2.2, trusted=False, run=False)
    code, _, err = run_cli_in_process("machine", "probe", "--quick")  # the CLI: one error line, exit 1
    assert code == 1 and err.startswith("error: the machine was busy while probing") and "--force" in err
    code, _, _ = run_cli_in_process("machine", "probe", "--quick", "--force")
    assert code == 0 and fp32() == 2.2  # --force stores it as it is


def test_a_busy_first_probe_is_stored_with_a_warning(tmp_path, monkeypatch):
    outcome = _probe_with_load(monkeypatch, tmp_path, 2.2, trusted=False)
    assert outcome.written and outcome.warning.startswith("warning: the machine was busy while probing")


def test_a_profile_that_disagrees_with_the_machine_now_is_warned_of(tmp_path, monkeypatch):
    from dlrm_lab.metrics.trust import AGREEMENT_MARGIN, quick_check

    profile = store_profile(tmp_path, gflops=2.2)
    spoiled = quick_check(profile, measure=lambda: 197e9)
    assert spoiled.startswith("warning: the machine profile's fp32 GEMM peak (2.2 GFLOP/s, probed 2026-11-22")
    assert "89.5x below what this machine does now (197.0 GFLOP/s)" in spoiled and "--force" in spoiled
    busy = quick_check(store_profile(tmp_path, gflops=197.0), measure=lambda: 50e9)
    assert busy.startswith("warning: this machine does 50.0 GFLOP/s of fp32 GEMM now, 3.9x below its profile")
    assert quick_check(profile, measure=lambda: 2.2e9 * AGREEMENT_MARGIN * 0.99) is None
    assert quick_check(None) is None and quick_check({"devices": {}}) is None
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    monkeypatch.setattr("dlrm_lab.metrics.trust.quick_gemm_flops", lambda: 197e9)
    store_profile(tmp_path, gflops=2.2)
    code, _, err = run_cli_in_process("machine", "show")
    assert code == 0 and "warning: the machine profile's fp32 GEMM peak (2.2 GFLOP/s" in err


def test_the_quick_check_times_every_product_the_fp32_peak_is_the_better_of(monkeypatch):
    """The rate the quick check compares with the profile's fp32 peak is timed through each product that peak is the
    better of (torch's mm, oneDNN's linear): through torch's mm alone a quiet Zen 5 read 2.1x "busy" against the
    oneDNN peak its probe stored, and every command said so."""
    import time

    from dlrm_lab.metrics import device_peaks
    from dlrm_lab.metrics.trust import quick_gemm_flops

    calls: list[str] = []

    def slow(a, b):
        calls.append("slow")
        time.sleep(0.002)  # at most 2 * 64^3 / 2 ms = 0.26 GFLOP/s
        return a

    def fast(a, b):
        calls.append("fast")
        return a

    ways = {"mkl": (slow, lambda m: m), "onednn": (fast, lambda m: m)}
    monkeypatch.setattr(device_peaks, "fp32_cpu_products", lambda: ways)
    rate = quick_gemm_flops(size=64, repeats=2)
    assert calls.count("slow") == 3 and calls.count("fast") == 3  # each: one untimed call, then the repeats
    assert rate > 2 * 64**3 / 0.002  # the better product's rate, not the first's
    assert set(device_peaks.fp32_cpu_products()) <= {"mkl", "onednn"}


def test_a_run_whose_load_stopped_early_is_marked_failed_with_the_reason(tmp_path, monkeypatch):
    from dlrm_lab.config import load_preset
    from dlrm_lab.infer import lab
    from dlrm_lab.infer.load import QuerySizes, Stream
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.metrics.run import read_manifest

    why = "the load stopped at query 7 of 30000: it was due 1.1 s ago (--max-issue-lag-ms 1000): ..."

    from contextlib import contextmanager

    from dlrm_lab.infer.sut import SutDescription

    class NoServer:
        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None: ...

        def describe(self) -> SutDescription:
            return SutDescription(models={})

    @contextmanager
    def reach(*args, **kwargs):
        yield NoServer

    monkeypatch.setattr(lab, "reach", reach)  # nothing planned or started: the load's end is what is tested
    monkeypatch.setattr(lab, "measure", lambda *a, **k: [{"point": 0, "model": "tiny", "issue_stopped": why}])
    served = [ServedModel("tiny", load_preset("tiny"))]
    run_dir = lab.run_inference(served, [Stream("tiny", 10.0, QuerySizes.parse("fixed:1"))],
                                lab.InferConfig(duration_s=0.1), metrics_dir=tmp_path)  # fmt: skip
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["error"] == f"point 0: {why}"


def test_a_dataset_of_an_unknown_format_version_is_refused(tmp_path):
    from dlrm_lab.data.parquet import DATASET_FILE, read_dataset_info

    (tmp_path / DATASET_FILE).write_text(json.dumps({"format_version": 7, "source": "synthetic"}))
    with pytest.raises(UserError, match=r"_dataset.json: format_version = 7: this dlrm-lab reads 1 \(written by"):
        read_dataset_info(tmp_path)
    (tmp_path / DATASET_FILE).write_text(json.dumps({"source": "synthetic"}))  # before the field: version 1
    assert read_dataset_info(tmp_path)["source"] == "synthetic"


SUMMARY_INVALID = """Result is : INVALID
  Performance constraints satisfied : Yes
  Min duration satisfied : Yes
  Early stopping satisfied: NO
Early Stopping Result:
 * Processed 58 queries.
 * Would need to run at least 401 more queries,
99.00 percentile latency (ns)   : 8469209
"""


def test_a_loadgen_run_too_short_for_a_verdict_is_refused_and_an_invalid_one_says_why(tmp_path):
    from dlrm_lab.infer.loadgen import (
        check_loadgen_duration,
        early_stopping_queries,
        loadgen_duration,
        parse_loadgen_summary,
    )

    assert (early_stopping_queries(99), early_stopping_queries(90)) == (459, 44)  # 58 + 401 above
    (tmp_path / "s.txt").write_text(SUMMARY_INVALID)
    parsed = parse_loadgen_summary(tmp_path / "s.txt")
    assert parsed["loadgen_result"] == "INVALID" and parsed["loadgen_reason"] == (
        "early stopping not met (processed 58 queries, would need at least 401 more, all within the bound)"
    )
    check_loadgen_duration(20.0, 23.0, 99.0)
    with pytest.raises(UserError, match=r"20 for duration_s 10 s is 200 queries; .* at least 459 .*duration_s 23 or"):
        check_loadgen_duration(20.0, 10.0, 99.0)
    assert loadgen_duration(20.0, 10.0, 99.0) == 26.0 and loadgen_duration(100.0, 10.0, 99.0) == 10.0
    code, _, err = run_cli_in_process(
        "infer",
        "run",
        "--model",
        "tiny",
        "--scenario",
        "server",
        "--qps",
        "20",
        "--duration",
        "10",
        "--metrics-dir",
        str(tmp_path / "r"),
        "--no-progress",
    )
    assert code == 2 and "Traceback" not in err and not (tmp_path / "r").exists()


def test_a_model_whose_dense_part_cannot_fit_is_refused_before_it_is_built(tmp_path):
    from dlrm_lab.config import TrainConfig, load_preset
    from dlrm_lab.families.dlrm import check_training_fits
    from dlrm_lab.model.cost import training_memory

    n = 2000  # tables of one feature each: the dot interaction's pairs make the top MLP's input 2M wide
    preset = tmp_path / "many.toml"
    lines = ['name = "many"', "num_dense = 4", f"num_embeddings = {[10] * n}", "embedding_dim = 8",
             "bottom_mlp = [16, 8]", "top_mlp = [512, 1]", 'interaction = "dot"']  # fmt: skip
    preset.write_text("\n".join(lines) + "\n")
    spec = load_preset(preset)
    need = training_memory(spec, 512)
    assert spec.dense_parameters > 1e9 and need.dense == 4 * spec.dense_parameters * 3  # weights, grads, Adagrad
    assert need.activations == 2 * 4 * 512 * (24 + 8 * n + spec.over_arch_in_features + 513 + (n + 1) ** 2)
    with pytest.raises(UserError, match=r"training many at --batch-size 512 needs [\d,.]+ GiB before its tables"):
        check_training_fits(spec, TrainConfig(batch_size=512), available_bytes=16 * 2**30)
    check_training_fits(load_preset("kaggle"), TrainConfig(batch_size=2048), available_bytes=16 * 2**30)
    code, _, err = run_cli_in_process("train", "--preset", str(preset), "--steps", "1", "--metrics-dir",
                                      str(tmp_path / "r"), "--no-progress")  # fmt: skip
    assert code == 2 and "Traceback" not in err and "before its tables" in err and not (tmp_path / "r").exists()


def test_a_ranker_too_big_for_this_machine_is_refused_before_it_is_built(tmp_path):
    from dlrm_lab.config import TrainConfig, load_any_preset
    from dlrm_lab.families.hstu import check_ranker_fits

    dlrmv4 = load_any_preset("dlrmv4")
    with pytest.raises(UserError, match=r"^training dlrmv4 needs [\d,.]+ GiB before its activations: tables [\d,.]+ "
                       r"GiB at fp32, dense part [\d.]+ GiB .* 16.0 GiB available: scale the tables"):  # fmt: skip
        check_ranker_fits(dlrmv4, TrainConfig(), available_bytes=16 * 2**30)
    check_ranker_fits(load_any_preset("hstu-tiny"), TrainConfig(), available_bytes=16 * 2**30)
    code, _, err = run_cli_in_process("train", "--preset", "dlrmv4", "--steps", "1", "--metrics-dir",
                                      str(tmp_path / "r"), "--no-progress")  # fmt: skip
    assert code == 2 and "Traceback" not in err and "before its activations" in err and not (tmp_path / "r").exists()


def test_a_sweep_killed_takes_its_point_with_it_and_a_resume_stops_a_live_orphan(tmp_path):
    import subprocess
    import sys
    import time

    from dlrm_lab.metrics.run import Run, read_manifest
    from dlrm_lab.sweep.run import stop_orphans

    child_pid = tmp_path / "child.pid"
    sweep = f"""
import sys
from pathlib import Path
from dlrm_lab.sweep import run as sweep
child = "import os, time; open({str(child_pid)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
sweep.point_command = lambda spec, params, slot: ([sys.executable, "-c", child], {{}})
sweep._run_point(None, {{}}, Path({str(tmp_path / "slot")!r}))
"""
    parent = subprocess.Popen([sys.executable, "-c", sweep])
    deadline = time.monotonic() + 60
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    pid = int(child_pid.read_text())
    parent.kill()  # SIGKILL: the sweep cannot pass anything on
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)  # the parent-death signal ended the point too

    slot = tmp_path / "orphaned"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(0.2)
    run = Run.create(slot, "train", {})  # as if the orphan had made it: its pid, started after the process
    _amend_pid(run.dir, orphan.pid)
    try:
        assert stop_orphans(slot, grace_s=5) == [orphan.pid]
        assert not _alive(orphan.pid)
    finally:
        orphan.kill()
    assert "stopped pid" in (slot / "point.log").read_text()
    assert read_manifest(run.dir)["status"] == "running"  # the resume sets the attempt aside as before
    reused = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        later = Run.create(tmp_path / "reused", "train", {})
        _amend_pid(later.dir, reused.pid, start_time="2020-01-01T00:00:00.000+00:00")  # the pid came later
        assert stop_orphans(tmp_path / "reused", grace_s=1) == [] and reused.poll() is None
    finally:
        reused.kill()


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _amend_pid(run_dir: Path, pid: int, **fields) -> None:
    from dlrm_lab.metrics.run import amend_manifest

    amend_manifest(run_dir, pid=pid, **fields)


def test_a_run_whose_process_dies_of_a_fatal_signal_is_marked_with_it(tmp_path):
    import subprocess
    import sys

    from dlrm_lab.metrics.fault_log import FAULT_LOG
    from dlrm_lab.metrics.run import Run, read_manifest, recover_run

    crash = (f"from dlrm_lab.metrics.run import Run; Run.create({str(tmp_path)!r}, 'train', {{}}); "
             "import ctypes; ctypes.string_at(0)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", crash], capture_output=True).returncode == -11
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / FAULT_LOG).read_text().startswith("Fatal Python error: Segmentation fault")
    manifest = recover_run(run_dir)
    assert manifest["status"] == "failed" and manifest["error"] == (
        f"process killed by signal SIGSEGV (Segmentation fault); Python's report in {FAULT_LOG}"
    )
    with Run.create(tmp_path / "fine", "train", {}) as run:  # a run that closes leaves no empty log
        pass
    assert not (run.dir / FAULT_LOG).exists() and read_manifest(run.dir)["status"] == "ok"


def test_torchs_is_fx_tracing_notice_is_filtered_and_nothing_else():
    import logging

    import dlrm_lab.model  # noqa: F401 - installs the filter

    logger = logging.getLogger("torch.fx._symbolic_trace")

    def record(msg: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, (), None)

    assert not logger.filter(record("is_fx_tracing will return true for both fx.symbolic_trace and torch.export."))
    assert logger.filter(record("another warning"))


def test_a_worker_of_the_lab_ends_with_its_parent_even_when_the_parent_is_killed(tmp_path):
    """A probe killed by SIGKILL left its two workers and the resource tracker running (issue 57 A8). Every worker the
    lab starts (a probe's, a client's, a serving instance, a sweep's point) asks for its parent's death as its own,
    and leaves Ctrl-C to its parent (a worker's own KeyboardInterrupt was a traceback, E26). A process property:
    the parent is a real process, killed."""
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent("""
        import multiprocessing as mp, os, signal, sys, time
        from dlrm_lab.errors import end_with_parent

        def child(out):
            end_with_parent()
            out.put((os.getpid(), signal.getsignal(signal.SIGINT) == signal.SIG_IGN))
            time.sleep(60)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            ctx.Process(target=child, args=(out,)).start()
            print(*out.get(timeout=60), flush=True)
            time.sleep(60)
    """)
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pid, ignores_interrupt = parent.stdout.readline().split()
        assert ignores_interrupt == "True"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(int(pid)):
            time.sleep(0.05)
        assert not _alive(int(pid)), "the worker outlived its killed parent"
    finally:
        parent.kill()


def test_a_worker_whose_parent_is_pid_1_is_not_an_orphan(monkeypatch):
    """The lab run as a container's PID 1 is its workers' live parent; an orphan goes to the nearest subreaper,
    not always PID 1: a worker tells its parent died by its parent pid changing, not by it being 1."""
    import multiprocessing
    import types

    from dlrm_lab.errors import parent_died

    assert not parent_died()  # this test's process: no multiprocessing parent, nothing to tell
    monkeypatch.setattr("os.getppid", lambda: 1)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: types.SimpleNamespace(pid=1))
    assert not parent_died()  # started by PID 1, and it lives
    assert parent_died(parent=4321)  # started by 4321, now under PID 1: orphaned
    monkeypatch.setattr("os.getppid", lambda: 77)  # under a subreaper that is not PID 1
    assert parent_died(parent=4321)


def test_sigterm_during_a_package_compile_stops_the_build(monkeypatch, tmp_path):
    """Inductor's compile catches `Exception` in places; SIGTERM during an `aoti` build was lost there and the run
    served its whole load with its record `ok` (issue 57 A3). `Terminated` is a BaseException, so it comes through."""
    import signal
    import threading
    import time

    import torch

    import dlrm_lab
    from dlrm_lab.errors import Terminated, raise_on_sigterm
    from dlrm_lab.infer.build import make_build
    from dlrm_lab.model.dlrm import build_model

    monkeypatch.setenv("DLRM_LAB_BUILD_DIR", str(tmp_path))  # nothing cached: it compiles
    torch.manual_seed(1234)
    model = build_model(dlrm_lab.load_preset("tiny")).eval()
    make_build(model, "fused", precision="fp32", table_precision="fp32")  # tables first: the signal hits the compile
    # and Inductor imported first: a signal that cut its first import in half left this test process unable to import
    # it again ("duplicate template name"), and every later compile in the same worker failed (a fresh clone's suite)
    import torch._inductor.compile_fx  # noqa: F401

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    raise_on_sigterm()
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(Terminated, match="terminated by signal SIGTERM"):
            make_build(model, "aoti", precision="fp32", table_precision="fp32")
            time.sleep(30)  # built before the signal came: it still must stop here, not pass
    finally:
        timer.cancel()
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_stop_that_lands_in_a_finaliser_is_raised_after_it_not_lost(monkeypatch, signum):
    """The signal handler runs wherever the main thread is: a stop raised inside a `__del__` or a weakref callback is
    printed and ignored by Python, and the run went on (the compile test above lost its SIGTERM in a WeakSet's
    callback). The lab's hook sends it again: the stop is raised at the next line; other unraisable errors still
    reach the hook before it."""
    import signal
    import sys
    import time

    from dlrm_lab.errors import Terminated, raise_on_sigterm

    seen: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise_on_sigterm()
    raise_on_sigterm()  # twice: one hook, not a chain of them
    sig = getattr(signal, signum)

    class StoppedWhileFinalised:
        def __del__(self) -> None:
            os.kill(os.getpid(), sig)  # delivered here: the handler raises inside the finaliser
            for _ in range(1000):
                pass

    class Broken:
        def __del__(self) -> None:
            raise ValueError("a finaliser's own error")

    try:
        broken = Broken()
        del broken
        assert [type(e) for e in seen] == [ValueError]  # passed on, not resent as a signal
        stopped = StoppedWhileFinalised()
        with pytest.raises(Terminated if signum == "SIGTERM" else KeyboardInterrupt):
            del stopped
            time.sleep(5)  # lost, it would sleep and pass
        assert len(seen) == 1  # the stop was not printed as an ignored error
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _nap() -> None:
    import time

    time.sleep(3)


def test_a_worker_started_with_interrupt_blocked_outlives_a_ctrl_c_while_it_starts():
    """Issue 57 E26's sibling: a Ctrl-C while a spawned worker still imports (before it can ignore it) was a
    KeyboardInterrupt traceback per worker; started inside `interrupt_blocked` it ignores it from its first instruction,
    and the parent's own mask and handler are given back."""
    import multiprocessing
    import signal

    from dlrm_lab.errors import interrupt_blocked

    ctx = multiprocessing.get_context("spawn")
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    handler = signal.getsignal(signal.SIGINT)
    with interrupt_blocked():
        worker = ctx.Process(target=_nap, daemon=True)
        worker.start()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before and signal.getsignal(signal.SIGINT) is handler
    try:
        worker.join(0.05)
        os.kill(worker.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole group, while it starts up
        worker.join(1.0)
        assert worker.is_alive()  # no KeyboardInterrupt ended it
        status = Path(f"/proc/{worker.pid}/status").read_text()
        ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1))  # inherited ignored, and kept so by the interpreter
    finally:
        worker.kill()
        worker.join(5)


def test_every_serving_option_is_either_the_servers_or_the_clients_with_a_remote_target():
    """Where a serving option is added, it is said whether a remote target refuses it (`--batch-memory` was not,
    until `--allocator` came beside it)."""
    from dataclasses import fields

    from dlrm_lab.commands import CLIENT_SIDE, SERVER_SIDE
    from dlrm_lab.infer.options import ServingOptions

    names = {f.name for f in fields(ServingOptions)}
    assert names <= set(SERVER_SIDE) | set(CLIENT_SIDE), names - set(SERVER_SIDE) - set(CLIENT_SIDE)
    assert not set(SERVER_SIDE) & set(CLIENT_SIDE)


@pytest.mark.parametrize("option", [("--build", "aoti"), ("--instances", "2"), ("--precision", "bf16"),
                                    ("--max-delay-ms", "3"), ("--idle-hold", "cpu-latency"),
                                    ("--batch-memory", "keep"), ("--allocator", "glibc")])  # fmt: skip
def test_how_the_labs_own_server_serves_is_refused_with_a_remote_target(tmp_path, option):
    """Issue 57 D23's class: with a remote --target, an option of how the lab's own server would serve (its build,
    instances, precision, batching) is one line before anything connects, as --checkpoint is: the run would record
    what the remote server never served."""
    for command in (["infer", "run"], ["infer", "search"]):
        if command[1] == "search" and option[0] == "--instances":
            continue  # a search's layouts are its own option
        code, _, err = run_cli_in_process(*command, "--model", "tiny", "--target", "grpc://127.0.0.1:1", *option,
                                          "--metrics-dir", str(tmp_path))  # fmt: skip
        assert code == 2 and err.startswith(f"error: {option[0]} {option[1]}: --target grpc://127.0.0.1:1: a remote")
        assert len(err.splitlines()) == 1 and not list(tmp_path.iterdir()), err


def test_a_build_this_machine_cannot_make_is_refused_before_any_run_directory(tmp_path, monkeypatch):
    """Issue 57 C18's sibling: `serve` and `infer search` (as `infer run`) refuse an engine that is missing before
    their run directory exists, where they used to leave a `failed` one behind the one line."""
    import sys

    monkeypatch.setitem(sys.modules, "openvino", None)  # not installed, as far as the lab can tell
    for command in (["serve", "--preset", "tiny", "--port", "0"], ["infer", "search", "--model", "tiny"],
                    ["infer", "run", "--model", "tiny", "--qps", "10"]):  # fmt: skip
        code, _, err = run_cli_in_process(*command, "--build", "openvino", "--metrics-dir", str(tmp_path))
        assert code == 2 and err.startswith("error: --build openvino: cannot be made here: OpenVINO is not"), err
        assert not list(tmp_path.iterdir()), command


def test_a_child_killed_while_the_oom_killer_ran_is_said_to_be_out_of_memory(monkeypatch):
    """A SIGKILL'd child is named as out of memory where the kernel's OOM killer has run since this process started
    (/proc/vmstat), and only then; a benchmark's failed child says how it ended (it printed only "failed:")."""
    import importlib.util
    import signal
    import subprocess

    from dlrm_lab import errors

    assert isinstance(errors.oom_kills(), int)  # Linux: the counter is there to read
    monkeypatch.setattr(errors, "_OOM_KILLS_AT_START", 3)
    monkeypatch.setattr(errors, "oom_kills", lambda: 3)
    assert errors.exit_description(-signal.SIGKILL) == "was killed by signal SIGKILL"
    monkeypatch.setattr(errors, "oom_kills", lambda: 4)
    killed = errors.exit_description(-signal.SIGKILL)
    assert killed.startswith("was killed by signal SIGKILL (out of memory: the kernel's OOM killer has run")
    assert errors.exit_description(-signal.SIGSEGV) == "was killed by signal SIGSEGV"  # only a SIGKILL is the OOM's
    assert errors.exit_description(3) == "exited with code 3"

    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    found = importlib.util.spec_from_file_location("benchmark_common", root / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(found)
    found.loader.exec_module(common)
    done = subprocess.CompletedProcess(["x"], -signal.SIGKILL, stdout="built aoti\n", stderr="")
    assert str(common.child_failed("dlrm-lab infer run", done)) == f"dlrm-lab infer run {killed}:\nbuilt aoti\n"
