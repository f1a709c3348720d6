"""The widths a whole-batch package computes each GEMM's input at (`infer.gemm_widths`): padded layers score as the
model does, the choice is timed on the model's own layer shapes and recorded, and the packages are made at it."""

from __future__ import annotations

import copy

import pytest
import torch

import dlrm_lab
from dlrm_lab.infer import gemm_widths
from dlrm_lab.infer.build import make_build
from dlrm_lab.infer.gemm_widths import PaddedK, candidates, choose_widths, padded
from dlrm_lab.model.dlrm import build_model


@pytest.fixture(scope="module")
def fused():
    torch.manual_seed(0)
    model = build_model(dlrm_lab.load_preset("tiny", num_dense=5)).eval()  # K of 5, 16, 18 and 16
    return model, make_build(copy.deepcopy(model), "fused", precision="bf16", table_precision="fp32")


def test_padded_layers_score_the_same_and_leave_the_original_untouched():
    torch.manual_seed(0)
    part = torch.nn.Sequential(torch.nn.Linear(13, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5), torch.nn.Linear(5, 1))
    wide = padded(part, {"0": 32, "2": 4})  # a width below the layer's own K is no width: the layer keeps its own
    assert [type(m).__name__ for m in wide] == ["PaddedK", "ReLU", "Linear", "Linear"]
    assert wide[0].weight.shape == (8, 32) and float(wide[0].weight[:, 13:].abs().sum()) == 0.0
    assert isinstance(part[0], torch.nn.Linear) and part[0].weight.shape == (8, 13)  # the original untouched
    assert wide[2] is not part[2]  # a copy, not a view of the model
    even = padded(part, {"0": 32}, even=True)  # the template's AMX kernel: every other odd K made even
    assert [m.weight.shape[1] for m in even if hasattr(m, "weight")] == [32, 8, 6]
    assert padded(part, {}) is part and padded(part, {"2": 8}) is part  # nothing widens: the part itself
    x = torch.randn(7, 13)
    with torch.no_grad():
        assert torch.allclose(wide(x), part(x), atol=1e-6) and torch.allclose(even(x), part(x), atol=1e-6)
    with pytest.raises(ValueError, match="narrower"):
        PaddedK(part[0], 12)


def test_candidates_are_the_layers_own_k_and_k_rounded_up_to_each_block():
    assert candidates(367) == [367, 368, 384]
    assert candidates(13) == [13, 16, 32, 64] and candidates(512) == [512] and candidates(64) == [64]


def test_the_widths_are_timed_on_the_models_layers_and_a_wider_input_kept_only_past_the_margin(
    fused, monkeypatch, tmp_path
):
    _, module = fused
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))  # no profile: every choice measured now
    lines: list[str] = []
    record = choose_widths(module, sizes=[1, 16], threads=1, log=lines.append)
    timed = {name for name, layer in module.dense.named_modules() if isinstance(layer, torch.nn.Linear)}
    assert set(record["ms"]) == timed  # no layer of tiny is a whole number of 64 inputs
    for name, by_width in record["ms"].items():
        layer = module.dense.get_submodule(name)
        assert set(by_width) == {str(w) for w in candidates(layer.in_features)}
        assert all(set(by) == {"1", "16"} and min(by.values()) > 0 for by in by_width.values())
        total = {int(w): sum(by.values()) for w, by in by_width.items()}
        fastest = min(total, key=lambda w: total[w])
        wider = total[layer.in_features] >= gemm_widths.MARGIN * total[fastest]
        assert record["widths"].get(name) == (fastest if wider else None), (name, total)
    assert module.gemm_widths == record["widths"] and module.sibling().gemm_widths == record["widths"]
    assert lines[-1].startswith("GEMM widths ") and "bf16, 1 thread(s)" in record["reason"]
    # a layer made MARGIN faster at a wider K by the clock is kept at it; one within the margin is not
    monkeypatch.setattr(
        gemm_widths,
        "medians_by_size",
        lambda ways, _t, sizes, *_a, **_k: {w: {n: 1.0 for n in sizes} for w in ways} | {"32": {n: 0.5 for n in sizes}},
    )
    assert choose_widths(module, sizes=[4], threads=1)["widths"] == {
        name: 32 for name in timed if module.dense.get_submodule(name).in_features < 32
    }
    monkeypatch.setattr(
        gemm_widths,
        "medians_by_size",
        lambda ways, _t, sizes, *_a, **_k: (
            {w: {n: 1.0 for n in sizes} for w in ways} | {"32": {n: 0.97 for n in sizes}}
        ),
    )
    assert choose_widths(module, sizes=[4], threads=1)["widths"] == {} and module.gemm_widths == {}


def test_a_package_is_made_at_the_chosen_widths_keyed_by_them_and_scores_as_the_dense_part(
    fused, monkeypatch, tmp_path
):
    """The widths reach the exported graph (caught before its compile) and the package's record, and so its key."""
    from dlrm_lab.infer.builds import aoti, build_named

    model, module = fused
    monkeypatch.setenv("DLRM_LAB_BUILD_DIR", str(tmp_path))  # no package cached: each is exported
    module.gemm_widths = {"dense_arch.model._mlp.0._linear": 16, "over_arch.model.0._mlp.0._linear": 32}
    made: list[dict] = []

    class Exported(Exception):
        pass

    def export(_module, _path, dense_part=None, **kw):
        made.append({"dense_part": dense_part, **kw})
        raise Exported

    monkeypatch.setattr(aoti, "export_whole", export)
    for build in ("aoti_frozen", "aoti_tuned"):
        with pytest.raises(Exported):
            build_named(build).make(model, module, precision="bf16", table_precision="fp32")
    frozen, tuned = (
        [m.weight.shape[1] for m in d["dense_part"].modules() if isinstance(m, (PaddedK, torch.nn.Linear))]
        for d in made
    )
    assert frozen == [16, 16, 32, 16] and tuned == [16, 16, 32, 16]  # even already: the template adds nothing
    embedded = torch.randn(6, 5, dtype=torch.bfloat16)
    pooled = torch.randn(6, module.dense.pooled_shape[0] * module.dense.pooled_shape[1], dtype=torch.bfloat16)
    with torch.no_grad():
        want = module.dense(embedded, pooled).float()
        got = made[0]["dense_part"](embedded, pooled).float()
    assert torch.allclose(got, want, atol=2e-2), (got - want).abs().max()
    # the record a package is keyed and loaded by names its widths
    recorded: list[dict] = []
    monkeypatch.setattr(aoti, "dense_package", lambda name, m, ext, ex, made_by: recorded.append(made_by) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        build_named("aoti_frozen").make(model, module, precision="bf16", table_precision="fp32")
    assert recorded[0]["widths"] == module.gemm_widths
    module.gemm_widths = {}


def test_the_widths_timings_are_kept_in_the_machines_profile_and_read_by_a_later_run(fused, monkeypatch, tmp_path):
    """A choice that flipped between runs would make each run compile its packages anew: the timings are stored in
    the machine's profile under the layers' shapes, and a later run reads them (and chooses the same) instead of
    timing again; another batch size is another entry."""
    from conftest import store_profile

    _, module = fused
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    store_profile(tmp_path)
    first = choose_widths(module, sizes=[2, 8], threads=1)
    assert "stored in" in first["reason"]

    def timed_again(*_a, **_k):
        raise AssertionError("timed again though the profile holds the timings")

    monkeypatch.setattr(gemm_widths, "_time_layers", timed_again)
    again = choose_widths(module, sizes=[2, 8], threads=1)
    assert "cached in" in again["reason"] and again["widths"] == first["widths"] and again["ms"] == first["ms"]
    with pytest.raises(AssertionError, match="timed again"):
        choose_widths(module, sizes=[2, 16], threads=1)
    module.gemm_widths = {}


def test_a_model_whose_every_k_is_whole_blocks_times_nothing_and_stores_nothing(monkeypatch, tmp_path):
    """No layer to time: no profile entry (an empty one would read back as damaged, one warning a run)."""
    from types import SimpleNamespace

    from conftest import store_profile

    from dlrm_lab.metrics.roofline import load_profile

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    store_profile(tmp_path)
    dense = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 1))
    module = SimpleNamespace(dense=dense, precision="fp32", dtype=torch.float32, gemm_widths={"x": 1})
    lines: list[str] = []
    for _ in range(2):
        record = choose_widths(module, sizes=[1, 8], threads=1, log=lines.append)
        assert record["widths"] == {} and record["ms"] == {} and module.gemm_widths == {}
        assert "every layer's K is a whole number of blocks" in record["reason"]
    assert not any("warning" in line for line in lines) and not load_profile().get("gemm_widths")


def test_the_labs_interaction_writes_a_widened_top_layers_zero_columns_itself(fused):
    """Where the lab's interaction kernel feeds a widened first top layer, the kernel writes the zero columns (no pad
    op in the exported graph: Inductor's pad after a fallback op is a copy of its own); torch's interaction keeps the
    pad, which Inductor fuses into its own kernel. Scores as the dense part's, the original untouched."""
    from dlrm_lab.model import native

    assert native.load() is None
    _, module = fused
    part = copy.deepcopy(module.dense)
    part.inter_arch.use("native")
    top = next(n for n, m in part.named_modules() if n.startswith("over_arch") and isinstance(m, torch.nn.Linear))
    wide = padded(part, {top: 32})
    assert wide.inter_arch.out_width == 32 and part.inter_arch.out_width == 0
    torch.manual_seed(1)
    embedded = torch.randn(6, 5, dtype=torch.bfloat16)
    pooled = torch.randn(6, part.pooled_shape[0] * part.pooled_shape[1], dtype=torch.bfloat16)
    with torch.no_grad():
        want, got = part(embedded, pooled).float(), wide(embedded, pooled).float()
        exported = torch.export.export(wide, (embedded, pooled)).graph_module
    assert torch.allclose(got, want, atol=2e-2), (got - want).abs().max()
    calls = [  # the graph's and its autocast regions' (`wrap_with_autocast` holds its own graph)
        str(node.target)
        for graph in exported.modules()
        if isinstance(graph, torch.fx.GraphModule)
        for node in graph.graph.nodes
        if node.op == "call_function"
    ]
    assert "dlrm_lab.dot_interaction_padded.default" in calls, calls
    assert not [c for c in calls if "pad" in c and "dot_interaction" not in c], calls
    part.inter_arch.use("fp32")
    assert padded(part, {top: 32}).inter_arch.out_width == 0
