"""The serving build: each inference form of a DLRM scores as the eager model does, the lab picks
the fastest by measurement (rates injected here, so nothing depends on this CPU), checks its
accuracy, caches the rates in the machine profile, and warns about an explicit slower choice."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import dlrm_lab
from dlrm_lab.config.family import family_of
from dlrm_lab.data import synthetic_generator
from dlrm_lab.errors import UserError
from dlrm_lab.infer import accuracy
from dlrm_lab.infer import build as builds
from dlrm_lab.infer.batches import QueryRef, kernel_batch, pad_kernel_batch
from dlrm_lab.infer.builds import build_names
from dlrm_lab.infer.builds.fused import FusedDLRM
from dlrm_lab.infer.finalists import same_tables
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.serving_parts import make_runner
from dlrm_lab.model.dlrm import build_model

SEED = 0


def _model(**overrides):
    spec = dlrm_lab.load_preset("tiny", **overrides)
    torch.manual_seed(SEED)
    return build_model(spec).eval()


def _held_out(model, n: int = 2048):
    return synthetic_generator(model.spec, None, seed=SEED).samples(4096, 4096 + n)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"interaction": "cat", "embedding_dim": [8, 4, 8, 12]}, {"interaction": "dcnv2", "dcn": {"num_layers": 2,
                                                                                                "low_rank": 4}}],
    ids=["dot", "cat", "dcnv2"],
)  # fmt: skip
def test_an_fp32_fused_build_scores_every_sample_as_the_eager_model_does(overrides):
    model = _model(**overrides)
    block = _held_out(model)
    fused = builds.make_build(model, "fused", precision="fp32", table_precision="fp32")
    eager = accuracy.score_build(model, block, "fp32")
    assert np.abs(accuracy.score_build(fused, block, "fp32") - eager).max() <= accuracy.FP32_SCORE_TOLERANCE
    check = builds.check_accuracy(model, fused, "fused", block, precision="fp32", table_precision="fp32")
    assert check.passed and check.max_abs_diff <= 1e-5 and "1e-05" in check.rule


@pytest.mark.parametrize("table_precision", ["fp32", "int8"])
def test_no_build_copies_the_float_tables_and_the_model_served_keeps_its_own(monkeypatch, table_precision):
    """The eager and fused builds of quantised tables are made without a copy of the float tables (TorchRec's
    `quantize_embeddings` deep-copies the whole model: DLRMv2's builds at a table scale of 0.05 held 5.2 GB twice and
    met a 24 GiB machine's OOM killer), and the model they are made from keeps its float tables, unmarked."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    model = _model()
    (ebc,) = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    tables = {id(t) for t in ebc.parameters()}
    before = {name: t.detach().clone() for name, t in ebc.state_dict().items()}
    copied = []
    deepcopy = torch.nn.Parameter.__deepcopy__

    def watched(self, memo):  # a table deep-copied is a table held twice
        if id(self) in tables:
            copied.append(tuple(self.shape))
        return deepcopy(self, memo)

    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__", watched)
    made = builds.BuildSet(model, "fp32", table_precision)
    eager, fused = made["eager"], made["fused"]
    assert copied == []
    assert all(not hasattr(m, "qconfig") for m in model.modules())  # TorchRec marks what it quantises: a copy
    assert {n: torch.equal(t, before[n]) for n, t in ebc.state_dict().items()} == dict.fromkeys(before, True)
    block = _held_out(model)
    reference = accuracy.score_build(model, block, "fp32")
    for served in (eager, fused):
        assert np.abs(accuracy.score_build(served, block, "fp32") - reference).max() <= 0.02


def test_the_fused_runner_serves_library_queries_and_names_its_stages():
    model = _model()
    library = PackedLibrary.generate(model.spec, None, SEED, 512)
    fused = builds.make_build(model, "fused", precision="fp32", table_precision="fp32")
    runner, reference = (make_runner(m, library, torch.device("cpu"), "fp32") for m in (fused, model))
    refs = [QueryRef(1, 3, 10), QueryRef(2, 5, 100)]  # two queries in one batch
    np.testing.assert_allclose(runner(refs), reference(refs), atol=1e-6)
    assembly, lookup, dense, interaction = runner.stages
    assert all(t is not None and t >= 0 for t in (assembly, lookup, dense, interaction))
    assert all(t is not None for t in reference.stages)  # the eager model's forward in the same stages


def test_a_reduced_precision_build_is_held_to_the_auc_rule():
    model = _model()
    block = _held_out(model, 4096)
    fused = builds.make_build(model, "fused", precision="bf16", table_precision="int8")
    check = builds.check_accuracy(model, fused, "fused", block, precision="bf16", table_precision="int8")
    assert "AUC within 0.1%" in check.rule
    assert check.auc_fp32 > 0.8 and 0.4 < check.data_auc_fp32 < 0.6  # the teacher's skill; the untrained model's
    assert check.passed == (abs(check.auc - check.auc_fp32) <= 1e-3 * check.auc_fp32)
    broken = builds.make_build(model, "fused", precision="fp32", table_precision="fp32")
    with torch.no_grad():  # a build whose top MLP lost its weights ranks nothing
        for p in broken.dense.over_arch.parameters():
            p.zero_()
    bad = builds.check_accuracy(model, broken, "fused", block, precision="fp32", table_precision="fp32")
    assert not bad.passed and bad.max_abs_diff > 1e-3


def test_kernel_batches_pad_with_samples_that_have_no_ids():
    dense, ids, offsets = kernel_batch(np.ones((2, 3), np.float32), np.array([1, 2, 0, 1], np.int32),
                                              np.array([5, 6, 7, 8], np.int64))  # fmt: skip
    assert offsets.tolist() == [0, 1, 3, 3, 4] and ids.dtype == torch.int32
    d, i, o = pad_kernel_batch(dense, ids, offsets, features=2, size=4)
    assert d.shape == (4, 3) and d[2:].abs().sum() == 0
    assert o.tolist() == [0, 1, 3, 3, 3, 3, 4, 4, 4] and i is ids  # empty bags for the padding


class FakeTimes:
    """Batch times per build (ms, the same at every size) and the fused build's dense part."""

    def __init__(self, dense_ms: float = 0.1, spread: float = 0.0, **ms: float) -> None:
        self.ms, self.dense_ms, self.spread, self.calls = ms, dense_ms, spread, []

    def __call__(self, modules, sizes, threads):
        self.calls.append(sorted(modules))
        out = {b: {n: self.ms.get(b, 9.0) for n in sizes} | {builds.SPREAD: self.spread} for b in modules}
        if "fused" in out:
            out["fused"][-1] = self.dense_ms
        return out


def _choose(requested, times, **kw):
    model = _model()
    library = PackedLibrary.generate(model.spec, None, SEED, 256)
    kw = {"precision": "fp32", "table_precision": "fp32", "threads": 1, "sizes": [8, 64], "library": library,
          "check_block": _held_out(model, 512), "measure": times, **kw}  # fmt: skip
    return builds.choose_build(requested, model, **kw)


def test_auto_serves_the_fastest_build_and_records_why(monkeypatch, tmp_path):
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "a"))
    choice, module = _choose("auto", FakeTimes(eager=2.0, fused=1.0))
    assert choice.build == "fused" and isinstance(module, FusedDLRM)
    assert "fused 2.000 ms vs eager 4.000 ms" in choice.reason  # summed over the two batch sizes
    assert choice.accuracy.passed and "compiled" in choice.skipped  # its dense part is too small to compile
    record = choice.to_dict()
    assert record["batch_ms"]["eager"] == {"8": 2.0, "64": 2.0} and record["accuracy"]["samples"] == 512
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "b"))
    tie, module = _choose("auto", FakeTimes(eager=1.0, fused=0.97))  # within the margin: the model itself
    assert tie.build == "eager" and not isinstance(module, FusedDLRM)
    # a more complex build faster by less than the margin: the simpler served, and not called "the fastest"
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "c"))
    close, _ = _choose("auto", FakeTimes(dense_ms=10.0, eager=2.0, fused=1.0, openvino_int8=0.97))
    assert close.build == "fused" and "openvino_int8" not in close.skipped
    assert close.reason == ("auto: fused, the simplest of the fastest (fused 2.000 ms vs eager 4.000 ms over batches "
                            "of 8, 64); openvino_int8 1.940 ms faster by less than 1.05x: not worth a more complex "
                            "build")  # fmt: skip


def test_auto_hands_its_instances_the_runners_up_close_to_its_choice_that_share_its_tables(monkeypatch, tmp_path):
    """Some builds' speed is drawn per process (`infer.finalists`): `auto` names, beside its choice, the runners-up
    within 1.25x of it that read the same table bytes and are served from one file (a package), each checked for
    accuracy; none where the choice is not a package, or nothing is close."""
    from dlrm_lab.infer.builds.aoti import AOTIBuild

    def packaged(self, module, export, made_by):  # no compile: the package's path only, the fused path serves
        module.package, module.package_reason = f"/packages/{self.name}.pt2", "made"
        return module

    monkeypatch.setattr(AOTIBuild, "packaged", packaged)
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "a"))
    times = FakeTimes(dense_ms=10.0, eager=4.0, fused=3.0, compiled=2.9, aoti=1.2, aoti_frozen=1.0, aoti_tuned=1.3,
                      aoti_int8=1.1, openvino=2.0, openvino_int8=2.0)  # fmt: skip
    choice, _ = _choose("auto", times)
    # aoti_tuned 1.3 > 1.25 x 1.0; openvino is not one file; aoti_int8 is made from a fused build of its own, whose
    # tables are the same bytes (an instance hands its package the tables it mapped)
    both = {"aoti": "/packages/aoti.pt2", "aoti_int8": "/packages/aoti_int8.pt2"}
    assert choice.build == "aoti_frozen" and choice.finalists == both
    assert choice.to_dict()["finalists"] == both
    assert choice.reason.endswith("its instances time it again against aoti, aoti_int8 (infer.finalists)")
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "b"))
    alone, _ = _choose("auto", FakeTimes(dense_ms=10.0, eager=4.0, fused=3.0, aoti=1.0, aoti_frozen=1.3))
    assert alone.build == "aoti" and alone.finalists == {}
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "c"))
    fused, _ = _choose("auto", FakeTimes(dense_ms=10.0, eager=4.0, fused=1.0, aoti=1.1))
    assert fused.build == "fused" and fused.finalists == {}  # the choice itself is no package to switch from
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "d"))
    real = builds.check_accuracy

    def aoti_fails(model, module, build, *a, **k):
        return builds.AccuracyCheck(**{**real(model, module, build, *a, **k).__dict__, "passed": build != "aoti"})

    monkeypatch.setattr(builds, "check_accuracy", aoti_fails)
    failed, _ = _choose("auto", times)
    assert failed.build == "aoti_frozen" and failed.finalists == {"aoti_int8": "/packages/aoti_int8.pt2"}
    assert "failed its accuracy" in failed.skipped["aoti"]
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "e"))
    asked, _ = _choose("aoti_frozen", times)
    assert asked.finalists == {}  # asked for by name: served as asked


def test_an_explicit_slower_build_runs_with_one_warning_naming_both_times(monkeypatch, tmp_path):
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    choice, module = _choose("eager", FakeTimes(eager=3.0, fused=1.0))
    assert choice.build == "eager" and not isinstance(module, FusedDLRM)
    assert "--build eager is slower than fused" in choice.warning
    assert "eager 6.000 ms vs fused 2.000 ms" in choice.warning and choice.line.startswith("warning: ")
    allowed = (
        "auto, eager, fused, compiled, aoti, aoti_frozen, aoti_tuned, aoti_buckets, aoti_int8, openvino, openvino_int8"
    )
    with pytest.raises(UserError, match=f"^build 'jit': allowed for a DLRM: {allowed}"):
        _choose("jit", FakeTimes(eager=1.0, fused=1.0))


def test_a_build_that_fails_its_accuracy_check_is_not_served(monkeypatch, tmp_path):
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    real = builds.check_accuracy

    def fused_fails(model, module, build, *a, **k):
        check = real(model, module, build, *a, **k)
        return check if build != "fused" else builds.AccuracyCheck(**{**check.__dict__, "passed": False})

    monkeypatch.setattr(builds, "check_accuracy", fused_fails)
    log = []
    choice, module = _choose("auto", FakeTimes(eager=2.0, fused=1.0), log=log.append)
    assert choice.build == "eager" and "failed its accuracy check" in choice.skipped["fused"]
    assert any("build fused: failed its accuracy check" in line for line in log)
    assert choice.reason.startswith("auto: eager, the fastest that passed its accuracy check (fused failed it; ")


def test_build_times_are_cached_in_the_machine_profile(monkeypatch, tmp_path):
    from conftest import store_profile

    from dlrm_lab.metrics.roofline import load_profile

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    store_profile(tmp_path)
    times = FakeTimes(eager=2.0, fused=1.0)
    first, _ = _choose("auto", times)
    assert "stored in" in first.source and len(load_profile()["build_rates"]) == 1
    second, _ = _choose("auto", times)
    assert times.calls == [["eager", "fused"]] and second.source.startswith("cached in")
    assert second.build == "fused"
    _choose("auto", times, threads=2)  # another thread count is another measurement
    assert len(times.calls) == 2
    # a timing taken while the machine was noisy is used once and measured again next time, never kept
    noisy = FakeTimes(eager=1.0, fused=2.0, spread=0.6)
    for _ in range(2):
        choice, _ = _choose("auto", noisy, threads=3)
        assert choice.build == "eager" and "not stored: the machine was noisy" in choice.source
    assert len(noisy.calls) == 2 and len(load_profile()["build_rates"]) == 2


def test_build_timings_carry_their_spread():
    model = _model()
    library = PackedLibrary.generate(model.spec, None, SEED, 256)
    made = builds.BuildSet(model, "fp32", "fp32")
    rates = builds.time_builds(made.subset(["fused"]), [4, 16], 1, library, "fp32", repeats=5)
    assert rates["fused"][builds.SPREAD] >= 0 and rates["fused"][16] > 0 and -1 in rates["fused"]


def test_a_compiled_build_scores_as_the_eager_model_and_is_timed_where_the_dense_part_is_large(monkeypatch, tmp_path):
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    times = FakeTimes(dense_ms=1.0, eager=3.0, fused=2.0, compiled=1.0, aoti=1.5, aoti_frozen=1.52, aoti_tuned=1.55,
                      aoti_buckets=1.56, aoti_int8=1.6, openvino=1.7, openvino_int8=1.8)  # fmt: skip
    choice, module = _choose("auto", times)
    later = ["aoti", "aoti_buckets", "aoti_frozen", "aoti_int8", "aoti_tuned", "compiled", "openvino", "openvino_int8"]
    assert times.calls == [["eager", "fused"], later]
    assert choice.build == "compiled"
    assert choice.accuracy.passed and choice.accuracy.build == "compiled"  # checked compiled, scores within 1e-5
    assert isinstance(module, FusedDLRM) and module.compiled is None  # each instance compiles its own


def _ranker():
    from dlrm_lab.config import load_any_preset
    from dlrm_lab.model.hstu import build_ranker

    torch.manual_seed(SEED)
    return build_ranker(load_any_preset("hstu-tiny")).eval()


def _held_out_requests(model, n: int = 256):
    from dlrm_lab.data.sequences import SequenceGenerator

    return SequenceGenerator(model.spec.data, seed=SEED).requests(0, n, "train")


def test_the_hstu_rankers_fused_build_scores_as_the_eager_model_and_reuses_histories_in_its_precision():
    """The ranker's `fused` build: its sequence tables in TorchRec's fused quantised EmbeddingCollection,
    the rest stored in the precision served. At fp32 every candidate's score within 1e-5 of the eager
    model's, through the instance's runner too, with history reuse; at bf16 the runner does not
    autocast and the history cache holds bf16 keys."""
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

    from dlrm_lab.infer.requests import RequestLibrary

    model = _ranker()
    block = _held_out_requests(model)
    fused = builds.make_build(model, "fused", precision="fp32", table_precision="fp32")
    assert isinstance(fused.tables, QuantEmbeddingCollection) and type(model.tables).__name__ == "EmbeddingCollection"
    assert all(not hasattr(m, "qconfig") for m in model.tables.modules())  # quantised from a copy: a later build
    check = builds.check_accuracy(model, fused, "fused", block, precision="fp32", table_precision="fp32")
    assert check.passed and check.max_abs_diff <= 1e-5 and check.samples == int(block.candidate_lengths.sum())
    library = RequestLibrary.from_block(block)
    refs = [QueryRef(1, 3, 10), QueryRef(2, 5, 100), QueryRef(3, 4, 10)]  # the third reuses the first's users
    runners = [make_runner(m, library, torch.device("cpu"), "fp32", history_cache_mb=64) for m in (fused, model)]
    for _ in range(2):  # the second round reuses every history
        np.testing.assert_allclose(runners[0](refs), runners[1](refs), atol=1e-5)
    assert runners[0].counts[:, 0].sum() > 0
    half = builds.make_build(model, "fused", precision="bf16", table_precision="int8")
    assert {p.dtype for n, p in half.named_parameters() if not n.startswith("tables")} == {torch.bfloat16}
    runner = make_runner(half, library, torch.device("cpu"), "bf16", history_cache_mb=64)
    assert not runner.autocast
    runner(refs)
    runner(refs)
    entry = next(iter(runner.cache.entries.values()))
    assert entry.keys[0].dtype == torch.bfloat16 and runner.counts[:, 0].sum() > 0
    int8 = builds.check_accuracy(model, half, "fused", block, precision="bf16", table_precision="int8")
    assert "AUC within 0.1%" in int8.rule and int8.max_abs_diff > 0


def test_the_hstu_rankers_build_is_chosen_by_measurement_and_an_hstu_preset_has_no_compiled_build(
    monkeypatch, tmp_path
):
    from dlrm_lab.config import load_any_preset
    from dlrm_lab.infer.requests import RequestLibrary
    from dlrm_lab.infer.served import ServedModel

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    spec = load_any_preset("hstu-tiny")
    with pytest.raises(UserError, match=r"^build compiled: hstu-tiny is an HSTU preset \(allowed: auto, eager, fused"):
        ServedModel("h", spec, build="compiled")
    assert ServedModel("h", spec, build="fused").build == "fused"
    model = _ranker()
    block = _held_out_requests(model, 128)
    library = RequestLibrary.from_block(block)
    times = FakeTimes(eager=3.0, fused=2.0)
    choice, module = builds.choose_build("auto", model, precision="fp32", table_precision="fp32", threads=1,
                                         sizes=[4, 16], library=library, check_block=block, measure=times)  # fmt: skip
    assert times.calls == [["eager", "fused"]] and choice.build == "fused" and choice.accuracy.passed
    assert "HSTU ranker" in choice.skipped["compiled"] and module.served_precision == "fp32"
    slower = FakeTimes(eager=2.0, fused=3.0)
    choice, module = builds.choose_build("fused", model, precision="fp32", table_precision="fp32", threads=1,
                                         sizes=[4, 8], library=library, check_block=block, measure=slower)  # fmt: skip
    assert choice.build == "fused" and "--build fused is slower than eager" in choice.warning
    with pytest.raises(UserError, match="allowed for the HSTU ranker: auto, eager, fused"):
        builds.choose_build("compiled", model, precision="fp32", table_precision="fp32", threads=1, sizes=[4],
                            library=library, check_block=block, measure=times)  # fmt: skip


def test_an_auto_precision_that_fails_the_accuracy_rule_in_every_build_falls_back_to_fp32(monkeypatch, tmp_path):
    """`--precision auto` chose bf16 for speed; if no build at bf16 keeps MLPerf's accuracy rule (dcnv2 at bf16 did
    not), the model is served in fp32, said in one line and recorded with the precision choice. An explicit
    precision is served as asked."""
    from dlrm_lab.infer.plan import Planner
    from dlrm_lab.infer.served import ServedModel

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    real = builds.check_accuracy

    def bf16_fails(model, module, build, block, *, precision, table_precision, **kw):
        check = real(model, module, build, block, precision=precision, table_precision=table_precision, **kw)
        return check if precision == "fp32" else builds.AccuracyCheck(**{**check.__dict__, "passed": False})

    monkeypatch.setattr(builds, "check_accuracy", bf16_fails)
    # the builds' times injected: every build alike, the fused dense part too small to compile (measured, a busy
    # machine's or a slow bf16's timing opened that gate and every package was compiled only to be timed)
    times = FakeTimes(eager=1.0, fused=1.0)
    monkeypatch.setattr(builds, "time_builds", lambda modules, sizes, threads, *_, **__: times(modules, sizes, threads))
    spec = dlrm_lab.load_preset("tiny")
    torch.manual_seed(0)
    model = build_model(spec).eval()
    library = PackedLibrary.generate(spec, None, 0, 512)
    held_out = synthetic_generator(spec, None, seed=0).samples(512, 512 + 2048)
    for requested, served_in in (("auto", "fp32"), ("bf16", "bf16")):
        lines: list[str] = []
        planner = Planner([ServedModel("tiny", spec, precision="bf16", build="eager")], device="cpu", seed=0,
                          log=lines.append)  # fmt: skip
        planner.precision_choices["tiny"] = {"requested": requested, "precision": "bf16", "reason": "measured"}
        choice, _, m = planner._checked_build(planner.models["tiny"], model, library, held_out)
        assert m.precision == served_in and planner.plan.models["tiny"].precision == served_in
        assert choice.accuracy.passed == (served_in == "fp32")
        record = planner.plan.precision_choices["tiny"]
        if requested == "auto":
            assert record["precision"] == "fp32" and not record["accuracy_fallback"]["passed"]
            assert lines[-1].startswith("tiny: precision bf16 fails the accuracy rule with --build eager (AUC within")
        else:
            assert "accuracy_fallback" not in record and record["precision"] == "bf16"
    assert all(timed == ["eager", "fused"] for timed in times.calls)  # nothing compiled to be timed


def test_a_server_executes_a_resolved_plan_and_chooses_nothing(monkeypatch, tmp_path):
    """`infer.plan.plan_serving` makes every choice (precision, build, with their records) before a server starts;
    a server given the plan chooses nothing again (the choosers would raise) and serves it as planned."""
    from dlrm_lab.infer import plan as plans
    from dlrm_lab.infer.plan import plan_serving
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.server import InferenceServer

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    plan = plan_serving([ServedModel("tiny", dlrm_lab.load_preset("tiny"))], seed=SEED)
    m = plan.models["tiny"]
    assert m.precision in ("fp32", "bf16", "fp16") and m.build in build_names()  # nothing left auto
    assert {"requested", "reason", "build_choice"} <= set(plan.precision_choices["tiny"])
    chosen = plan.precision_choices["tiny"]["build_choice"]  # the packages' lookup and GEMM widths chosen together
    assert (chosen["widths"] is None) == (chosen["lookup"] is None), chosen
    assert set(plan.modules) == set(plan.libraries) == {"tiny"}

    def chosen_again(*_a, **_k):
        raise AssertionError("a server given a plan chose again")

    monkeypatch.setattr(plans, "choose_precision", chosen_again)
    monkeypatch.setattr(builds, "choose_build", chosen_again)
    with InferenceServer(plan, pin_cores=False) as server:
        served = server.describe().models["tiny"]
        assert (served.precision, served.build) == (m.precision, m.build)
        assert server.precision_choices["tiny"]["build_choice"] == plan.precision_choices["tiny"]["build_choice"]


def test_the_plan_of_an_hstu_ranker_keeps_its_measured_attention_path(monkeypatch, tmp_path):
    """The ranker's attention path chosen by measurement stays in the served model after its build is chosen."""
    from dlrm_lab.config import load_any_preset
    from dlrm_lab.infer.plan import plan_serving
    from dlrm_lab.infer.served import ServedModel

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    plan = plan_serving([ServedModel("h", load_any_preset("hstu-tiny"), max_batch=8, precision="fp32",
                                     library_samples=64)], seed=SEED)  # fmt: skip
    m = plan.models["h"]
    chosen = plan.precision_choices["h"]["attention_choice"]["attention"]
    assert m.attention in ("padded", "jagged") and m.attention == chosen
    assert m.build in family_of(m.spec).builds and m.describe()["attention"] == m.attention


def test_the_roof_reads_each_builds_dense_weights_as_it_stores_them():
    from dlrm_lab.infer.builds import dense_weight_bytes

    assert dense_weight_bytes("eager", "bf16") == 4.0  # the trained fp32 weights, cast per call under autocast
    assert [dense_weight_bytes(b, "bf16") for b in ("fused", "compiled", "aoti")] == [2.0, 2.0, 2.0]
    assert dense_weight_bytes("aoti_int8", "bf16") == 1.0 and dense_weight_bytes("aoti", "fp32") == 4.0
    assert dense_weight_bytes("a remote server's", "bf16") == 4.0


def test_an_explicit_build_whose_engine_is_missing_is_one_line_naming_what_to_install(monkeypatch, tmp_path):
    """`auto` skips a build whose engine cannot be imported; an explicit one says so in one line before anything
    is built (issue 57 C18), as every build's own `skip` says it."""
    from dlrm_lab.infer.builds import aoti_int8, openvino

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    monkeypatch.setattr(openvino, "openvino_missing", lambda quantise: "OpenVINO is not installed: pip install x")
    monkeypatch.setattr(aoti_int8, "torchao_missing", lambda: "torchao is not installed: pip install y")
    for build, said in (
        ("openvino", "pip install x"),
        ("openvino_int8", "pip install x"),
        ("aoti_int8", "pip install y"),
    ):
        with pytest.raises(UserError, match=f"^build {build}: cannot be made here: .*{said}"):
            _choose(build, FakeTimes(eager=3.0, fused=1.0))


def test_openvinos_telemetry_is_declined_even_where_its_consent_file_says_yes(monkeypatch, tmp_path):
    """OpenVINO and NNCF share one telemetry singleton; the lab configures it first and declines it, so no build
    sends usage data or starts a sender (issue 57 C19)."""
    telemetry = pytest.importorskip("openvino_telemetry")
    from dlrm_lab.infer.builds.openvino import telemetry_off

    (tmp_path / "intel").mkdir()
    (tmp_path / "intel" / "openvino_telemetry").write_text("1")  # a user who once said yes
    monkeypatch.setenv("HOME", str(tmp_path))
    telemetry_off()
    later = telemetry.Telemetry(app_name="nncf", app_version="3.4.0", tid="G-0", backend="ga4")
    assert later.consent is False


def test_a_build_is_timed_at_the_batches_the_load_will_make_thousands_where_offline_chooses_its_max_batch():
    """DLRMv2 at fp16 served Offline chose `aoti_frozen` timed at 200 and 256 samples (11.8 against `aoti`'s 14.2
    ms), then batched 2,496 samples, where it is the slower (89 against 72 ms at 2,048): 55.9 queries/s a core where
    `aoti` served 72.6. Where the whole load is queued and the max batch is auto, the largest batch timed is the
    auto rule's cap; elsewhere the largest batch served, as before. The instances warm up to it and judge their
    batch memory there (they timed it at a 350-sample warm-up and gave back the memory a 4,096 batch gains from)."""
    from dlrm_lab.infer.drivers import scenario
    from dlrm_lab.infer.lab import for_load
    from dlrm_lab.infer.load import QuerySizes, Stream
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.tune import MAX_AUTO_BATCH

    served = ServedModel(name="tiny", spec=dlrm_lab.load_preset("tiny"), instances=2, max_batch=256)
    stream = Stream("tiny", 300.0, QuerySizes.parse("fixed:200"))
    assert scenario("offline").queues_whole_load and not scenario("server").queues_whole_load
    assert for_load(served, stream, auto_batch_queued=True).batches_to_time() == [200, MAX_AUTO_BATCH]
    assert for_load(served, stream).batches_to_time() == [200, 256]
    assert for_load(served, stream, auto_batch_queued=True).largest_batch() == MAX_AUTO_BATCH
    assert for_load(served, stream).largest_batch() == served.piece_limit() == 256
    given = dataclasses.replace(served, build_batches=(7, 9))
    assert for_load(given, stream, auto_batch_queued=True).batches_to_time() == [7, 9]


def test_a_package_is_checked_at_batch_sizes_beside_its_traced_one():
    """Inductor may keep a shape from the trace (torch 2.13's max_autotune wrote the interaction's bmm operand at
    the traced 64 rows, and the package raised at a batch of 1): each package runs at 1, 2 and 65 samples and
    scores each sample as within a batch of 64, or it does not serve."""
    from dlrm_lab.infer.builds import BuildFailed
    from dlrm_lab.infer.builds.aoti import EXAMPLE_BATCH, check_batch_sizes

    model = _model()
    module = dataclasses.make_dataclass("Module", ["spec"])(model.spec)
    calls = []

    def right(dense, ids, offsets):
        calls.append(dense.shape[0])
        assert ids.shape[0] == len(model.spec.feature_names) * dense.shape[0] == offsets.shape[0] - 1
        return torch.sigmoid(dense.sum(1))

    check_batch_sizes("aoti", module, right)
    assert sorted(set(calls)) == [1, 2, EXAMPLE_BATCH, EXAMPLE_BATCH + 1]

    def kept_its_trace(dense, ids, offsets):
        if dense.shape[0] != EXAMPLE_BATCH:
            raise RuntimeError("Expected size for first two dimensions of batch2 tensor to be: [1, 16] but got: "
                               "[64, 16].\nException raised from ...")  # fmt: skip
        return right(dense, ids, offsets)

    with pytest.raises(BuildFailed, match=r"^aoti_tuned: its package fails at a batch of 1: Expected size .*\]\.$"):
        check_batch_sizes("aoti_tuned", module, kept_its_trace)

    def rescored(dense, ids, offsets):  # reads another sample's rows past the trace's batch
        return right(dense.roll(1, 0) if dense.shape[0] > EXAMPLE_BATCH else dense, ids, offsets)

    with pytest.raises(BuildFailed, match="scores a batch of 65 otherwise than a batch of 64"):
        check_batch_sizes("aoti", module, rescored)
    with pytest.raises(BuildFailed, match=r"returned \(1,\) scores for a batch of 2"):
        check_batch_sizes("aoti", module, lambda d, i, o: torch.zeros(1) if d.shape[0] == 2 else right(d, i, o))


def test_a_build_that_fails_a_batch_size_is_left_out_by_auto_and_asked_for_is_one_line(monkeypatch, tmp_path):
    """A build made here that cannot serve (its package failing a batch size, or its warm-up raising) is timed no
    further: `auto` serves another and says why; `--build` naming it stops with one line, not a traceback."""
    from conftest import store_profile

    from dlrm_lab.infer.builds import BuildFailed, build_named

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    store_profile(tmp_path)
    aoti = build_named("aoti")

    def fails(*a, **k):
        raise BuildFailed("aoti: its package fails at a batch of 1: Expected size [1, 16] but got [64, 16].")

    monkeypatch.setattr(aoti, "make", fails)
    monkeypatch.setattr(aoti, "skip", lambda dense_ms, smallest=None: None)  # timed even with tiny's small dense part
    log = []
    choice, _ = _choose("auto", None, log=log.append)
    assert choice.build in ("eager", "fused") and "aoti" not in choice.batch_ms
    assert choice.skipped["aoti"].startswith("aoti: its package fails at a batch of 1")
    assert any(line.startswith("build aoti: not served: aoti: its package fails") for line in log)
    # kept in the machine's profile with why: a later run neither makes it nor times it again to find the same (the
    # base builds may be timed again: a timing taken in a noisy minute is not kept)
    made_again: list[str] = []
    monkeypatch.setattr(aoti, "make", lambda *a, **k: made_again.append("aoti") or fails())
    again, _ = _choose("auto", None)
    assert again.skipped["aoti"] == choice.skipped["aoti"] and not made_again
    with pytest.raises(UserError, match=r"^build aoti: its package fails at a batch of 1: .*--build auto serves "):
        _choose("aoti", None)
    assert not made_again
    # a warm-up that raises: the build left out with the batch sizes it was warmed at; a base build's error stands
    model = _model()
    library = PackedLibrary.generate(model.spec, None, SEED, 256)
    made = builds.BuildSet(model, "fp32", "fp32")

    class Raises:
        def warm_up(self, largest):
            raise RuntimeError("bmm: shapes differ\nframe #0: ...")

    real = builds.make_runner
    monkeypatch.setattr(builds, "make_runner", lambda m, *a: Raises() if m == "broken" else real(m, *a))
    failed = {}
    rates = builds.time_builds({"fused": made["fused"], "aoti": "broken"}, [4, 16], 1, library, "fp32", 3, failed)
    assert set(rates) == {"fused"}
    assert failed == {"aoti": "aoti: fails in its warm-up (batches of 1 to 16): bmm: shapes differ"}
    with pytest.raises(RuntimeError, match="shapes differ"):
        builds.time_builds({"fused": "broken"}, [4], 1, library, "fp32", 3, {})


def test_package_builds_share_tables_only_where_their_bytes_are_the_same():
    """`same_tables`: one tensor, or equal bytes (a fused build made apart at another dense precision); another table
    precision or other weights are not the same tables."""
    from dlrm_lab.infer.table_lookup import table_weights

    model = _model()
    fused = builds.make_build(model, "fused", precision="fp32", table_precision="fp32")

    def same(a, b):
        return same_tables(table_weights(a.tables), table_weights(b.tables))

    assert same(fused, fused.sibling())
    assert same(fused, builds.make_build(model, "fused", precision="bf16", table_precision="fp32"))
    assert not same(fused, builds.make_build(model, "fused", precision="fp32", table_precision="fp16"))
    torch.manual_seed(SEED + 1)
    other = builds.make_build(build_model(model.spec).eval(), "fused", precision="fp32", table_precision="fp32")
    assert not same(fused, other)
