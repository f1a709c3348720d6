"""Two ranks under torchrun train exactly like one rank over the same global batches."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

import dlrm_lab
from dlrm_lab.distributed.sharding import SHARDING_TYPES, gather_tables, init_tables

GLOBAL_BATCH, STEPS = 64, 6


def torchrun(*args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    ref = subprocess.run(
        [sys.executable, "tests/dist_worker.py", str(one), str(GLOBAL_BATCH), str(STEPS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = torchrun("tests/dist_worker.py", str(two), str(GLOBAL_BATCH), str(STEPS))
    assert out.returncode == 0, out.stderr[-3000:]
    return one, two


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", SHARDING_TYPES)
def test_two_ranks_match_one_rank(runs, sharding):
    one, two = runs
    a = json.loads((one / f"{sharding}.json").read_text())
    b = json.loads((two / f"{sharding}.json").read_text())
    assert {t["sharding_type"] for t in b["plan"]["tables"]} == {sharding}
    if sharding != "data_parallel":  # model-parallel: the tables are spread over both ranks
        assert all(sum(b["plan"]["bytes_per_rank"]) >= t["bytes"] for t in b["plan"]["tables"])
    for la, lb in zip(a["losses"], b["losses"], strict=True):
        assert abs(la - lb) <= 1e-5 * abs(la), (a["losses"], b["losses"])
    wa, wb = torch.load(one / f"{sharding}.pt"), torch.load(two / f"{sharding}.pt")
    for name, table in wa["tables"].items():
        torch.testing.assert_close(wb["tables"][name], table, rtol=1e-5, atol=1e-6)
    # the tables really trained (else equal weights would prove nothing)
    plain = dlrm_lab.build_model(dlrm_lab.load_preset("tiny"))
    init_tables(plain, seed=3)
    initial = gather_tables(plain)
    for name, table in wa["tables"].items():
        assert not torch.equal(table, initial[name]), name
    for key, value in wa["dense"].items():
        torch.testing.assert_close(wb["dense"][key], value, rtol=1e-5, atol=1e-6)
