"""--precision auto: the dense precision is chosen from rates measured on this machine.

Every test injects the rates (a fake measurement), so none depends on the CPU it runs on.
"""

import json

import pyarrow.parquet as pq
import pytest

import dlrm_lab
from dlrm_lab.metrics import precision as prec
from dlrm_lab.metrics.roofline import load_profile

GF = 1e9


class FakeRates:
    """Stands in for measure_shape_rates: fixed GFLOP/s per precision, counting calls."""

    def __init__(self, **gflops: float) -> None:
        self.gflops = gflops
        self.calls: list[tuple] = []

    def __call__(self, shapes, precisions, device, threads):
        self.calls.append((tuple(shapes), tuple(precisions), threads))
        return {p: self.gflops[p] * GF for p in precisions}


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An empty profile directory and a fake quick probe that records being called."""
    from conftest import store_profile

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    probes = []

    def fake_probe(quick=False, devices=None, log=None, comms=True):
        assert not comms  # rank 0 probes alone while the other ranks wait: no collectives
        probes.append((quick, devices))
        return store_profile(tmp_path / "probe-out")

    monkeypatch.setattr("dlrm_lab.metrics.probe.probe_machine", fake_probe)
    return {"dir": tmp_path / "machines", "probes": probes}


def choose(requested, rates, spec=None, **kw):
    spec = spec or dlrm_lab.load_preset("kaggle", max_rows=1000)
    return prec.choose_precision(requested, spec, allowed=("fp32", "bf16"), threads=2, rows=2048, measure=rates, **kw)


def test_auto_picks_fp32_where_bf16_is_slow_and_bf16_where_it_is_measurably_faster(machine, monkeypatch):
    def on_new_machine(name, **gflops):
        monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(machine["dir"] / name))  # nothing cached yet
        return choose("auto", FakeRates(**gflops))

    avx2 = on_new_machine("avx2", fp32=73, bf16=1.7)
    assert avx2.precision == "fp32" and avx2.warning is None
    assert "73.0" in avx2.reason and "1.7" in avx2.reason
    amx = on_new_machine("amx", fp32=150, bf16=900)
    assert amx.precision == "bf16" and "6.00x" in amx.reason
    near_tie = on_new_machine("tie", fp32=100, bf16=110)  # within the margin: numerics win the tie
    assert near_tie.precision == "fp32"


def test_first_sight_of_a_machine_runs_a_quick_probe_and_caches_the_rates(machine):
    log = []
    rates = FakeRates(fp32=73, bf16=1.7)
    first = choose("auto", rates, log=log.append)
    assert machine["probes"] == [(True, ["cpu"])] and any("quick probe" in line for line in log)
    assert "measured now" in first.source
    stored = load_profile()
    assert stored is not None and len(stored["precision_rates"]) == 1  # cached under the fingerprint
    entry = next(iter(stored["precision_rates"].values()))
    assert entry["flops_per_s"] == {"fp32": 73 * GF, "bf16": 1.7 * GF}
    second = choose("auto", rates)
    assert len(rates.calls) == 1 and len(machine["probes"]) == 1  # neither probed nor measured again
    assert second.precision == "fp32" and second.source.startswith("cached in")
    other_threads = prec.choose_precision(
        "auto", dlrm_lab.load_preset("kaggle", max_rows=1000), allowed=("fp32", "bf16"), threads=1, rows=2048,
        measure=rates,
    )  # fmt: skip
    assert len(rates.calls) == 2 and other_threads.threads == 1  # another thread count is measured on its own


def test_rates_are_measured_on_the_models_gemm_shapes(machine):
    rates = FakeRates(fp32=73, bf16=1.7)
    choose("auto", rates, spec=dlrm_lab.load_preset("kaggle", max_rows=1000))
    shapes, precisions, threads = rates.calls[0]
    # kaggle: bottom 13-512-256-64-16, top 367-512-256-1, rows capped at 512
    assert shapes[:4] == ((512, 13, 512), (512, 512, 256), (512, 256, 64), (512, 64, 16))
    assert shapes[4:] == ((512, 367, 512), (512, 512, 256), (512, 256, 1))
    assert precisions == ("fp32", "bf16") and threads == 2
    dcn = prec.model_gemm_shapes(dlrm_lab.load_preset("dcnv2", table_scale=0.0001), rows=64)
    spec = dlrm_lab.load_preset("dcnv2", table_scale=0.0001)
    n, r = spec.over_arch_in_features, spec.dcn_low_rank
    assert dcn.count((64, n, r)) == spec.dcn_num_layers and dcn.count((64, r, n)) == spec.dcn_num_layers


def test_explicit_slow_precision_runs_with_one_warning_naming_both_rates(machine, monkeypatch):
    slow = choose("bf16", FakeRates(fp32=73, bf16=1.7))
    assert slow.precision == "bf16"
    assert slow.warning and "bf16 1.7 GFLOP/s" in slow.warning and "fp32 73.0 GFLOP/s" in slow.warning
    assert machine["probes"] == []  # an explicit choice measures its GEMMs but never probes the machine
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(machine["dir"] / "amx"))
    fast = choose("bf16", FakeRates(fp32=73, bf16=300))
    assert fast.precision == "bf16" and fast.warning is None


def test_explicit_fp32_is_not_measured(machine):
    def never(*_a):
        raise AssertionError("fp32 asked for: nothing to measure")

    choice = choose("fp32", never)
    assert choice.precision == "fp32" and choice.rates_flops_per_s == {} and machine["probes"] == []


def test_products_too_small_to_matter_stay_fp32_whatever_the_rates(machine):
    tiny = dlrm_lab.load_preset("tiny")  # ~0.5 MFLOP a pass: 5 us at 100 GFLOP/s
    choice = choose("auto", FakeRates(fp32=100, bf16=900), spec=tiny)
    assert choice.precision == "fp32" and choice.negligible and "too little for precision to matter" in choice.reason
    assert prec.contenders(choice) == ["fp32"]  # nor is precision searched for it


def test_search_grid_holds_a_precision_only_where_it_can_win(machine):
    def choice_with(**gflops):
        return prec.PrecisionChoice("auto", "fp32", "", {k: v * GF for k, v in gflops.items()})

    assert prec.contenders(choice_with(fp32=73, bf16=1.7, fp16=1.3)) == ["fp32"]
    assert prec.contenders(choice_with(fp32=150, bf16=900)) == ["bf16"]
    assert prec.contenders(choice_with(fp32=100, bf16=105)) == ["fp32", "bf16"]  # a near tie is searched


def test_unknown_precision_is_a_one_line_error(machine):
    from dlrm_lab.errors import UserError

    with pytest.raises(UserError, match="^precision 'int3': allowed: auto, fp32, bf16"):
        choose("int3", FakeRates(fp32=1, bf16=1))


def test_measure_shape_rates_times_every_precision_on_this_cpu():
    import torch

    rates = prec.measure_shape_rates([(64, 32, 16), (64, 16, 8)], ["bf16", "fp32"], torch.device("cpu"), 1)
    assert set(rates) == {"fp32", "bf16"} and all(v > 0 for v in rates.values())


def test_training_with_auto_runs_and_records_the_measured_choice(machine, monkeypatch, tmp_path):
    from dlrm_lab.config import TrainConfig
    from dlrm_lab.train import preflight, train

    # an AMX-like machine, slowed down so that tiny's small products count
    monkeypatch.setattr(prec, "measure_shape_rates", FakeRates(fp32=0.001, bf16=0.004))
    log = []
    result = train(
        preflight(dlrm_lab.load_preset("tiny"), TrainConfig(steps=3, batch_size=32, precision="auto")),
        metrics_dir=tmp_path / "runs", log=log.append,
    )  # fmt: skip
    assert result.summary["precision"] == "bf16"
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    choice = manifest["config"]["precision_choice"]
    assert choice["requested"] == "auto" and choice["precision"] == "bf16"
    assert choice["gemm_gflops_per_s"] == {"fp32": 0.001, "bf16": 0.004} and "4.00x" in choice["reason"]
    assert manifest["config"]["train"]["precision"] == "bf16"
    assert pq.read_table(result.run_dir / "summary.parquet").column("precision").to_pylist() == ["bf16"]
    assert any(line.startswith("precision bf16: auto") for line in log)


def test_cli_warns_once_before_training_in_a_slow_precision(machine, monkeypatch, tmp_path):
    from conftest import run_cli_in_process

    monkeypatch.setattr(prec, "measure_shape_rates", FakeRates(fp32=73, bf16=1.7))
    code, out, err = run_cli_in_process(
        "train", "--preset", "tiny", "--steps", "2", "--batch-size", "16", "--precision", "bf16", "--no-progress",
        "--metrics-dir", str(tmp_path / "runs"),
    )  # fmt: skip
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "bf16 1.7 GFLOP/s" in warnings[0] and "fp32 73.0 GFLOP/s" in warnings[0]


def test_a_search_grids_every_precision_that_can_win_and_records_why(machine, monkeypatch):
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.search import _search_precisions
    from dlrm_lab.infer.served import ServedModel

    base = ServedModel("kaggle", dlrm_lab.load_preset("kaggle", max_rows=1000), precision="auto")
    choices: dict = {}
    monkeypatch.setattr(prec, "measure_shape_rates", FakeRates(fp32=100, bf16=105, fp16=1))  # a near tie
    assert _search_precisions(base, 1, 256, InferConfig(), None, choices) == ["fp32", "bf16"]
    assert choices["1 threads"]["searched"] == ["fp32", "bf16"] and choices["1 threads"]["precision"] == "fp32"
    monkeypatch.setattr(prec, "measure_shape_rates", FakeRates(fp32=73, bf16=1.7, fp16=1.3))  # AVX2-like
    assert _search_precisions(base, 2, 256, InferConfig(), None, choices) == ["fp32"]
    explicit = ServedModel("kaggle", base.spec, precision="bf16")
    assert _search_precisions(explicit, 2, 256, InferConfig(), None, choices) == ["bf16"]  # as asked
