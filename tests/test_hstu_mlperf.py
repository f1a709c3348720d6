"""MLPerf Inference's dlrm-v3 rules in the dlrmv3 preset ([mlperf]): the Server bound (p99 <= 80 ms) is the
default bound of `infer run` and `infer search` for it, a sample is a request of 2,048 candidates, and a
served build keeps 99.9% of the fp32 model's NE, accuracy and per-request AUC (docs/hstu.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm_lab.commands import infer_setup, search_setup
from dlrm_lab.config import load_any_preset
from dlrm_lab.config.family import family_of, spec_from_dict
from dlrm_lab.errors import UserError
from dlrm_lab.metrics.ranking import ranking_metrics

MODELS = Path(__file__).resolve().parents[1] / "models"
RULES = """
[mlperf]
benchmark = "dlrm-v3"
server_latency_ms = 80
accuracy_share = 0.999
reference = { ne = 0.86687, accuracy = 0.69651, auc = 0.78663 }
"""


def _with_rules(tmp_path: Path, rules: str = RULES, name: str = "hstu-mlperf") -> Path:
    """hstu-tiny with an [mlperf] table: a ranker small enough to build and score in a test."""
    path = tmp_path / f"{name}.toml"
    path.write_text((MODELS / "hstu-tiny.toml").read_text().replace('name = "hstu-tiny"', f'name = "{name}"') + rules)
    return path


def test_the_dlrmv3_preset_holds_mlperfs_dlrm_v3_rules():
    spec = load_any_preset("dlrmv3")
    rules = spec.mlperf
    assert rules.benchmark == "dlrm-v3" and rules.server_latency_ms == 80.0 and rules.accuracy_share == 0.999
    assert rules.reference == {"ne": 0.86687, "accuracy": 0.69651, "auc": 0.78663}  # fractions: the rules' percent
    assert spec.data.candidates == 2048  # a sample: one request of up to 2,048 candidates
    assert spec_from_dict(spec.to_dict()) == spec  # as a run's manifest holds it, rules included
    assert load_any_preset("hstu-tiny").mlperf is None
    lines, _ = family_of(spec).describe(spec)  # `presets show dlrmv3`
    assert any(line.startswith("MLPerf dlrm-v3: Server p99 <= 80 ms (the default --sla-ms)") for line in lines)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('server_latency_ms = 0\naccuracy_share = 0.999\nreference = { ne = 0.9, accuracy = 0.7, auc = 0.8 }',
         r"server_latency_ms = 0: a number of ms > 0"),
        ('server_latency_ms = 80\naccuracy_share = 99.9\nreference = { ne = 0.9, accuracy = 0.7, auc = 0.8 }',
         r"accuracy_share = 99.9: in \(0, 1\]"),
        ('server_latency_ms = 80\naccuracy_share = 0.999\nreference = { ne = 86.687, accuracy = 0.7, auc = 0.8 }',
         r"reference.ne = 86.687: a fraction in \(0, 1\] \(86.687% is 0.86687\)"),
        ('server_latency_ms = 80\naccuracy_share = 0.999\nreference = { ne = 0.9, auc = 0.8 }',
         r"reference = .*: a table of ne, accuracy, auc"),
        ("server_latency_ms = 80\naccuracy_share = 0.999", r"missing 'reference'"),
        ('server_latency_ms = 80\naccuracy_share = 0.999\nreference = { ne = 0.9, accuracy = 0.7, auc = 0.8 }\n'
         "percentile = 99", r"unknown key 'percentile'; allowed: benchmark, server_latency_ms"),
    ],
    ids=["bound", "share", "percent", "metrics", "missing", "unknown"],
)  # fmt: skip
def test_a_bad_mlperf_table_is_one_line_naming_the_file_and_field(tmp_path, table, message):
    path = _with_rules(tmp_path, f'\n[mlperf]\nbenchmark = "dlrm-v3"\n{table}\n')
    with pytest.raises(UserError, match=rf"hstu-mlperf.toml: \[mlperf\]: {message}") as info:
        load_any_preset(str(path))
    assert "\n" not in str(info.value)


def test_infer_run_bounds_a_preset_at_its_mlperf_server_bound_unless_told():
    """dlrmv3 under LoadGen's Server scenario: p99 <= 80 ms with no --sla-ms; per model where several are served;
    a given bound wins."""
    _, load, cfg = infer_setup({"model": ["dlrmv3"], "scenario": "server"})
    assert [s.sla_ms for s in load.streams] == [80.0] and (cfg.sla_percentile, cfg.sla_ms) == (99.0, 80.0)
    _, load, _ = infer_setup({"model": ["hstu-tiny", "dlrmv3"]})
    assert [s.sla_ms for s in load.streams] == [10.0, 80.0]  # hstu-tiny declares no rules: the lab's 10 ms
    _, load, cfg = infer_setup({"model": ["dlrmv3"], "sla_ms": ["25"]})
    assert [s.sla_ms for s in load.streams] == [25.0] and cfg.sla_ms == 25.0


def test_infer_search_bounds_a_preset_at_its_mlperf_server_bound_unless_told():
    _, stream, _, cfg, _ = search_setup({"model": ["dlrmv3"]})
    assert stream.sla_ms == cfg.sla_ms == 80.0 and cfg.sla_percentile == 99.0
    _, stream, _, cfg, _ = search_setup({"model": ["dlrmv3"], "sla_ms": 30})
    assert stream.sla_ms == cfg.sla_ms == 30.0
    _, stream, _, cfg, _ = search_setup({"model": ["tiny"]})
    assert stream.sla_ms == cfg.sla_ms == 10.0


def test_ranking_metrics_are_ne_accuracy_and_the_mean_auc_of_each_requests_candidates():
    """Against a direct computation: NE = cross entropy / that of predicting the label rate; accuracy at 0.5;
    AUC per request averaged over the requests that have both labels (one request here has none)."""
    from torchmetrics.functional.classification import binary_auroc

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 20, size=30)
    n = int(lengths.sum())
    p = rng.uniform(0.05, 0.95, n).astype(np.float32)
    y = (rng.random(n) < p).astype(np.float32)
    y[: lengths[0]] = 0  # a request without a positive: no AUC of its own
    got = ranking_metrics(p, y, lengths)
    pd, rate = p.astype(np.float64), y.mean()
    ce = -(y * np.log2(pd) + (1 - y) * np.log2(1 - pd)).sum()
    assert got["ne"] == pytest.approx(ce / -(y.sum() * np.log2(rate) + (1 - y).sum() * np.log2(1 - rate)), rel=1e-6)
    assert got["accuracy"] == pytest.approx(((p >= 0.5) == y).mean(), rel=1e-6)
    ends = np.cumsum(lengths)
    spans = [(b - k, b) for k, b in zip(lengths, ends, strict=True)]
    aucs = [float(binary_auroc(torch.from_numpy(p[a:b]), torch.from_numpy(y[a:b]).long()))
            for a, b in spans if 0 < y[a:b].sum() < b - a]  # fmt: skip
    assert len(aucs) < len(lengths) and got["auc"] == pytest.approx(np.mean(aucs), rel=1e-5)
    with pytest.raises(ValueError, match="disagree"):
        ranking_metrics(p, y, lengths[1:])


def test_the_rule_keeps_each_metric_in_its_own_direction():
    """NE is a loss: a build may be at most 0.1% worse (higher); accuracy and AUC at least 99.9% of fp32's."""
    rules = load_any_preset("dlrmv3").mlperf
    fp32 = {"ne": 0.9, "accuracy": 0.7, "auc": 0.8}
    assert all(rules.accuracy_kept(fp32, fp32).values())
    assert rules.accuracy_kept({**fp32, "ne": 0.9 / 0.999 * 1.0001}, fp32) == {"ne": False, "accuracy": True,
                                                                               "auc": True}  # fmt: skip
    assert rules.accuracy_kept({**fp32, "ne": 0.5}, fp32)["ne"]  # a lower loss is better, never refused
    assert not rules.accuracy_kept({**fp32, "auc": 0.8 * 0.998}, fp32)["auc"]
    assert not rules.accuracy_kept({**fp32, "accuracy": 0.7 * 0.998}, fp32)["accuracy"]
    assert "99.9%" in rules.accuracy_rule and "dlrm-v3" in rules.accuracy_rule


def test_a_reduced_precision_build_of_a_preset_with_mlperf_rules_is_judged_by_them(tmp_path):
    """The serving build's accuracy check of a ranker whose preset declares [mlperf]: NE, accuracy and per-request
    AUC of the build and of the fp32 model on the same labels, each kept or not; a build whose head lost its
    weights fails."""
    from dlrm_lab.data.sequences import SequenceGenerator
    from dlrm_lab.infer import accuracy
    from dlrm_lab.infer import build as builds
    from dlrm_lab.model.hstu import build_ranker

    spec = load_any_preset(str(_with_rules(tmp_path)))
    torch.manual_seed(0)
    model = build_ranker(spec).eval()
    block = SequenceGenerator(spec.data, seed=0).requests(0, 256, "train")
    half = builds.make_build(model, "fused", precision="bf16", table_precision="fp32")
    check = accuracy.check_accuracy(model, half, "fused", block, precision="bf16", table_precision="fp32")
    assert check.rule == spec.mlperf.accuracy_rule and set(check.mlperf) == {"build", "fp32", "kept"}
    assert check.mlperf["kept"] == spec.mlperf.accuracy_kept(check.mlperf["build"], check.mlperf["fp32"])
    assert check.passed == all(check.mlperf["kept"].values())
    assert check.mlperf["fp32"]["auc"] > 0.6  # the labels carry the fp32 model's ranking
    assert check.to_dict()["mlperf_metrics"] == check.mlperf
    broken = builds.make_build(model, "fused", precision="bf16", table_precision="fp32")
    with torch.no_grad():
        for p in broken.head.parameters():
            p.zero_()
    bad = accuracy.check_accuracy(model, broken, "fused", block, precision="bf16", table_precision="fp32")
    assert not bad.passed and not bad.mlperf["kept"]["auc"]
    exact = accuracy.check_accuracy(model, model, "eager", block, precision="fp32", table_precision="fp32")
    assert exact.passed and exact.mlperf is None and "1e-05" in exact.rule  # fp32 stays held to every score
