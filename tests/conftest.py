import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if os.environ.get("PYTEST_XDIST_WORKER"):
    # make test runs a worker per core: two workers of two OpenMP threads each on two cores spin against each other
    # (a 3 s test took 42 s). The product's own runs set their threads; this is the tests' in-process default.
    torch.set_num_threads(1)
# a training run that only a signal ends (fault tests): tiny, small batches, a million steps
ENDLESS_TRAIN = ("train", "--preset", "tiny", "--steps", "1000000", "--batch-size", "32", "--no-progress")
# every choice a training run on several CPU ranks would otherwise time at start-up, given: for the tests of
# launching, failing and scaling ranks, whose property is none of these choices (their own tests time them)
DECIDED = ("--sharding", "table_wise", "--precision", "fp32", "--table-pages", "base", "--table-update", "fbgemm",
           "--prefetch", "0", "--collectives", "gloo")  # fmt: skip


def pytest_ignore_collect(collection_path, config):
    """`-m gpu` (the GPU check, `lab-gpu-check.sh`) collects test_gpu.py alone: every GPU test is there, and the
    other files import the CPU suite's extras (duckdb, polars, OpenVINO) that a GPU host does not carry."""
    if config.getoption("markexpr", "") == "gpu" and collection_path.suffix == ".py":
        return collection_path.name.startswith("test_") and collection_path.name != "test_gpu.py"
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU visible to this torch build")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None, **kwargs
) -> subprocess.CompletedProcess:
    """Run `dlrm-lab ARGS` as a user would, in a fresh process (`env`: extra variables)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dlrm_lab", *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


def run_cli_in_process(*args: str) -> tuple[int, str, str]:
    """`dlrm-lab ARGS` through the CLI's own entry point inside this process: (exit code,
    stdout, stderr). For the error paths, where starting an interpreter per case (~5 s of
    imports) would cost more than the case; the real process is exercised by run_cli."""
    import contextlib
    import io

    from dlrm_lab.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def make_batch(spec, batch_size: int, seed: int = 0, offset: int = 0):
    """One batch of the preset's synthetic data (samples offset .. offset + batch_size)."""
    from dlrm_lab.data import SyntheticSource, synthetic_generator

    return SyntheticSource(synthetic_generator(spec, seed=seed), batch_size, offset=offset).batch(0)


def wait_for_files(root: Path, pattern: str, timeout_s: float = 120) -> list[Path]:
    """Files matching `pattern` under `root` once some exist (empty after `timeout_s`):
    used to act on a live run only after it has flushed rows."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(root.glob(pattern))
        if found:
            return found
        time.sleep(0.2)
    return []


@pytest.fixture(scope="session", autouse=True)
def isolated_machine_profiles(tmp_path_factory):
    """Tests never read or write this machine's real profile (~/.cache/dlrm-lab/machines) or its serving
    packages, nor run its other C allocators: runs see an empty profile directory unless a test stores one there."""
    os.environ["DLRM_LAB_MACHINE_DIR"] = str(tmp_path_factory.mktemp("machines"))
    os.environ["DLRM_LAB_BUILD_DIR"] = str(tmp_path_factory.mktemp("builds"))  # serving packages: one per session
    # no C allocator but glibc's, as on CI's machines (a test that wants one points this at a directory of its own)
    os.environ["DLRM_LAB_ALLOCATOR_DIRS"] = ""
    yield


class ConstantPower:
    """A power sensor that always reads `watts` (stands in for NVML/RAPL, absent here)."""

    name = "fake"

    def __init__(self, watts: float) -> None:
        self.watts = watts
        self.closed = False

    def channels(self) -> list[str]:
        return ["dev0"]

    def read(self) -> dict:
        from dlrm_lab.metrics.sensors import Reading

        return {"dev0": Reading("power_w", self.watts)}

    def close(self) -> None:
        self.closed = True


def store_profile(
    directory: Path,
    gflops: float = 100.0,
    gather_gb: float = 5.0,
    comms: dict | None = None,
    ceiling: dict[int, float] | None = None,
) -> dict:
    """A machine profile of this machine's fingerprint with round peaks, stored in `directory`
    (`ceiling`: N processes -> the GEMM and copy efficiency of N pinned processes at once)."""
    import json

    from dlrm_lab.metrics.hardware import hardware_fingerprint

    fid = hardware_fingerprint()["fingerprint_id"]
    peaks = {
        "gemm_flops_per_s": {"fp32": gflops * 1e9, "bf16": 2 * gflops * 1e9},
        "memory_bytes_per_s": 20e9,
        "gather_bytes_per_s": gather_gb * 1e9,
    }
    profile = {
        "fingerprint_id": fid,
        "probed_at": "2026-11-22T00:00:00+00:00",
        "devices": {"cpu": {"threads": {"1": peaks, str(os.cpu_count() or 1): peaks}}},
        "comms": comms or {},
    }
    if ceiling:
        profile["devices"]["cpu"]["ceiling"] = {
            str(n): {"processes": n, "gemm": {"efficiency": e}, "copy": {"efficiency": e}} for n, e in ceiling.items()
        }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{fid}.json").write_text(json.dumps(profile))
    return profile


# The registered table (`metrics.columns`) that each Parquet file of a run directory is, by file and run kind.
_TABLE_OF_FILE = {"steps": "steps", "eval": "eval", "queries": "queries", "frontier": "frontier",
                  "gap": "scale gap", "profile": "profile", "points": "sweep points"}  # fmt: skip
_TABLES_OF_KIND = {
    "train": {"summary": "train summary", "telemetry": "train telemetry"},
    "infer": {"summary": "infer summary", "telemetry": "infer telemetry"},
    "infer-search": {"summary": "search summary", "telemetry": "infer telemetry"},
    "scale": {"summary": "scale summary"},
}


def assert_tables_registered(run_dir: Path) -> list[str]:
    """Every Parquet table a run wrote is its registered table, column for column: names, order and Arrow
    types (`run_id` first). Returns the tables checked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dlrm_lab.metrics import read_manifest
    from dlrm_lab.metrics.columns import schema_of

    kind = read_manifest(run_dir)["kind"]
    checked = []
    for path in sorted(Path(run_dir).glob("*.parquet")):
        table = _TABLES_OF_KIND.get(kind, {}).get(path.stem) or _TABLE_OF_FILE.get(path.stem)
        assert table is not None, f"{path.name} of a {kind} run is no registered table"
        written = pq.read_schema(path).remove_metadata()
        expected = schema_of(table)
        if "run_id" in written.names:  # the run's tables lead with it (`metrics.tables`)
            expected = expected.insert(0, pa.field("run_id", pa.string()))
        assert written.equals(expected), f"{path.name}: {written} is not {table!r}: {expected}"
        checked.append(table)
    return checked


def _process_state() -> dict:
    """What a test must leave as it found it in this shared process: each later test would run under it (a test
    that told glibc's malloc to keep memory made rm2's training 40 s instead of 17; malloc's options cannot be read
    back, so that one is kept out by running it in a process of its own)."""
    # (a command run in-process installs its signal handlers for the process's life, as the real command does)
    return {
        "cpu affinity": os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None,
        "torch threads": torch.get_num_threads(),
        "GIL switch interval": int(sys.getswitchinterval() * 1e6),  # whole microseconds, as the interpreter keeps it
        "cwd": os.getcwd(),
    }


@pytest.fixture(autouse=True)
def _leaves_the_process_as_it_found_it(request):
    before = _process_state()
    yield
    after = _process_state()
    changed = {k: (before[k], after[k]) for k in before if after[k] != before[k]}
    if changed:  # put back, so that later tests are not slowed or changed by it, then fail this one
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, before["cpu affinity"])
        torch.set_num_threads(before["torch threads"])
        sys.setswitchinterval(before["GIL switch interval"] / 1e6)
        os.chdir(before["cwd"])
        pytest.fail(f"{request.node.nodeid} left this process changed: {changed}", pytrace=False)


def fake_shared_library(directory: Path, name: str) -> Path:
    """A shared library under another's file name (an allocator's: what it is called is what the lab checks)."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "empty.c"
    source.write_text("int dlrm_lab_fake_library = 1;\n")
    out = directory / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(source)], check=True, capture_output=True)
    return out
