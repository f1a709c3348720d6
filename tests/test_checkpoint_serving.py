"""Serving what was trained: a `train --checkpoint-dir` checkpoint goes into every serving build, scores its
held-out samples as training evaluated them, and judges reduced-precision builds on the data's own labels."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dlrm_lab
from dlrm_lab.config import TrainConfig
from dlrm_lab.config.family import family_of
from dlrm_lab.errors import UserError
from dlrm_lab.infer import accuracy
from dlrm_lab.infer.build import make_build
from dlrm_lab.infer.builds import build_named
from dlrm_lab.infer.plan import plan_serving
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.model.checkpoint import TRAINED, check_spec, read_checkpoint
from dlrm_lab.train import preflight, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tiny, trained 40 steps with its checkpoint written at the end."""
    root = tmp_path_factory.mktemp("checkpoint")
    spec = dlrm_lab.load_preset("tiny")
    result = train(preflight(spec, TrainConfig(steps=40, batch_size=256, seed=3, prefetch=0, eval_batches=4,
                                     checkpoint_dir=str(root))))  # fmt: skip
    return root, result


def _served(root, **kw):
    return ServedModel(
        "tiny", dlrm_lab.load_preset("tiny", **kw.pop("preset", {})), checkpoint=read_checkpoint(root), **kw
    )


def test_the_checkpoint_records_what_serving_needs(trained):
    root, result = trained
    checkpoint = read_checkpoint(root)
    assert checkpoint.step == 40 and checkpoint.path == root / "step-00000040"
    assert checkpoint.held_out_auc == pytest.approx(result.evals[-1]["auc"])
    assert checkpoint.about["eval"]["samples"] == 1024 and checkpoint.about["seed"] == 3
    assert read_checkpoint(checkpoint.path).step == 40  # a step directory names itself


def test_a_served_checkpoint_scores_as_training_evaluated_it_in_every_build(trained):
    root, result = trained
    served = _served(root)
    family = family_of(served.spec)
    model, _, _ = family.serving_model(served, 0, lambda _line: None)
    held_out = family.held_out(served, None, 0)
    first = held_out.slice(0, read_checkpoint(root).about["eval"]["samples"])  # the samples training scored
    eager = accuracy.score_build(model, first, "fp32")
    assert accuracy.auc(eager, first.labels) == pytest.approx(result.evals[-1]["auc"], abs=1e-6)
    untrained = family.serving_model(ServedModel("tiny", served.spec), 0, lambda _line: None)[0]
    assert accuracy.auc(accuracy.score_build(untrained, first, "fp32"), first.labels) < result.evals[-1]["auc"] - 0.05
    # the trained weights reach every inference form; `compiled` serves `fused`'s own module, compiled in place by
    # each instance (no weights of its own to carry: tests/test_serving_build.py compiles it)
    # (`aoti_frozen`, `aoti_tuned` and `aoti_buckets` are `aoti`'s graph compiled with other options or batch shapes:
    # tests/test_one_call.py)
    for build in (b for b in family.builds if b not in ("compiled", "aoti_frozen", "aoti_tuned", "aoti_buckets")):
        module = make_build(model, build, precision="fp32", table_precision="fp32")
        scores = accuracy.score_build(module, first, "fp32")
        if build in ("aoti", "openvino"):
            _package_is_cached_and_never_served_damaged(model, module, build)
        if build_named(build).dense_precision is None:
            assert np.abs(scores - eager).max() <= accuracy.FP32_SCORE_TOLERANCE, build
            continue
        # int8 dense: judged by the reduced-precision rule on the data's labels, never by fp32's exact one
        check = accuracy.check_accuracy(model, module, build, held_out, precision=build_named(build).dense_precision,
                                        table_precision="fp32", labels="data")  # fmt: skip
        assert check.passed and "AUC within 0.1%" in check.rule and check.max_abs_diff > 0, check.to_dict()


def _package_is_cached_and_never_served_damaged(model, module, build) -> None:
    """A build's package of these weights (aoti's `.pt2`, openvino's IR) is found in the cache the second time; an
    instance refuses it once its bytes on disk differ from its record (the serving process would build it again:
    tests/test_artefacts.py)."""
    again = make_build(model, build, precision="fp32", table_precision="fp32")
    assert again.package == module.package and again.package_reason.startswith("found in the cache")
    snapshot = build_named(build).for_snapshot(again)
    assert snapshot.compiled is None and getattr(snapshot, "whole", None) is None  # instances load it themselves
    package = Path(module.package)
    data = package.read_bytes()
    package.write_bytes(data[:-16])  # truncated on disk after it was built
    try:
        with pytest.raises(RuntimeError, match="partial or corrupt"):
            build_named(build).in_instance(snapshot, torch.device("cpu"), precision="fp32", table_precision="fp32")
    finally:
        package.write_bytes(data)


def test_a_trained_models_builds_are_judged_on_the_datas_labels_and_the_run_names_its_checkpoint(trained):
    root, result = trained
    plan = plan_serving([_served(root, precision="bf16", build="fused", max_batch=64)])
    check = plan.precision_choices["tiny"]["build_choice"]["accuracy"]
    assert check["labels"].startswith("the held-out samples' own labels") and check["samples"] == accuracy.CHECK_SAMPLES
    assert check["auc_fp32_eager"] == pytest.approx(result.evals[-1]["auc"], abs=0.02)  # the same data, more of it
    assert check["passed"] == check["passes_99_9"] and check["passes_99"]
    described = plan.models["tiny"].describe()
    assert described["checkpoint"] == str(root / "step-00000040") and described["checkpoint_step"] == 40
    assert described["checkpoint_auc"] == pytest.approx(result.evals[-1]["auc"])


def test_without_a_checkpoint_the_run_says_its_model_is_untrained():
    lines: list[str] = []
    plan = plan_serving([ServedModel("tiny", dlrm_lab.load_preset("tiny"), build="fused", max_batch=64)],
                        log=lines.append)  # fmt: skip
    assert any("no --checkpoint: serving an untrained model" in line for line in lines)
    assert plan.precision_choices["tiny"]["build_choice"]["accuracy"]["labels"].startswith("drawn from the untrained")
    assert plan.models["tiny"].describe()["checkpoint"] is None


def test_a_checkpoint_that_is_not_the_served_models_is_refused_in_one_line(trained, tmp_path):
    root, _ = trained
    mismatch = (
        r"^checkpoint /.*step-00000040: trained 'tiny', not the model served \(table_scale: trained 1.0, served 0.5\)"
    )
    with pytest.raises(UserError, match=mismatch):
        _served(root, preset={"table_scale": 0.5})
    moved = read_checkpoint(root)
    check_spec(moved, {**dlrm_lab.load_preset("tiny").to_dict(), "source": "/elsewhere/tiny.toml"})  # another checkout
    with pytest.raises(UserError, match=r"^checkpoint /.*nowhere: no such directory"):
        _served(tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"^checkpoint /.*: no complete checkpoint \(expected a 'latest' file"):
        _served(tmp_path)
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / TRAINED).write_text("{not json")
    with pytest.raises(UserError, match=r"^checkpoint /.*trained.json: unreadable"):
        _served(step)
    (step / TRAINED).write_text(json.dumps({**read_checkpoint(root).about}))  # the record without its weights
    with pytest.raises(UserError, match=r"^checkpoint /.*step-00000001: its .metadata is damaged or partial"):
        family_of(dlrm_lab.load_preset("tiny")).serving_model(_served(step), 0, lambda _line: None)


def test_keep_warm_is_checked_and_refused_for_the_ranker():
    with pytest.raises(UserError, match=r"^keep_warm_ms 0.5: must be 0 \(off\) or in \[1, 10000\]"):
        ServedModel("tiny", dlrm_lab.load_preset("tiny"), keep_warm_ms=0.5)
    from dlrm_lab.config import load_any_preset

    with pytest.raises(UserError, match="^keep_warm_ms 10: for DLRM presets"):
        ServedModel("hstu-tiny", load_any_preset("hstu-tiny"), keep_warm_ms=10.0)


def test_one_checkpoint_per_model_is_asked_for_by_the_command_line():
    from dlrm_lab.infer.options import ServingOptions

    with pytest.raises(UserError, match=r"^checkpoint: give one per model \(2\), in order; got 1"):
        ServingOptions(checkpoint=("a",)).served(["tiny", "tiny"])


def test_a_checkpoint_is_resolved_once_and_that_step_is_what_every_part_of_the_run_sees(trained, monkeypatch):
    """The option is read into one TrainedCheckpoint where the command reads it: the served model's checks, copies,
    plan, build check and records never read its sidecar again, so a training run still writing cannot hand them
    different steps (issue 58: at least 8 reads a served model a run before)."""
    from dataclasses import replace

    from dlrm_lab.infer.options import ServingOptions
    from dlrm_lab.model import checkpoint as checkpoints

    root, _ = trained
    reads = []
    real = checkpoints.sidecar_problem
    monkeypatch.setattr(checkpoints, "sidecar_problem", lambda about: reads.append(about["step"]) or real(about))
    (served,) = ServingOptions(checkpoint=(str(root),), build="fused", max_batch=64).served(["tiny"])
    assert reads == [40]
    served = replace(replace(served, max_batch=32), largest_query=64)  # each copy re-runs __post_init__'s checks
    plan = plan_serving([served])
    assert plan.models["tiny"].describe()["checkpoint_step"] == 40 and plan.models["tiny"].checkpoint.step == 40
    assert reads == [40]


def test_torch_is_seeded_the_same_for_a_trained_and_an_untrained_server(trained):
    """The checkpoint replaces every weight: two servers of one checkpoint with other seeds serve one model."""
    root, _ = trained
    family = family_of(dlrm_lab.load_preset("tiny"))
    a = family.serving_model(_served(root), 0, lambda _line: None)[0]
    b = family.serving_model(_served(root), 7, lambda _line: None)[0]
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_infer_builds_compares_a_trained_models_builds_on_this_machine(trained):
    from conftest import run_cli_in_process

    root, _ = trained
    args = ["-m", "tiny", "--checkpoint", str(root), "--builds", "eager,fused", "--sizes", "1,16", "--repeats", "1"]
    code, stdout, stderr = run_cli_in_process("infer", "builds", *args)
    assert code == 0, stderr
    table = [line for line in stdout.splitlines() if line.lstrip("│ ").startswith(("eager", "fused"))]
    assert len(table) == 2 and all("pass (data labels)" in line for line in table), stdout
    assert "eager: " in stderr and "us a sample" in stderr  # each build's cost said as it is timed


def test_infer_builds_refuses_an_unknown_build_or_one_size_in_one_line():
    from conftest import run_cli_in_process

    for args, message in (
        (["--builds", "eager,jit"], "error: --builds 'jit': a DLRM has builds eager, fused"),
        (["--sizes", "4"], "error: --sizes 4: give two batch sizes or more"),
        (["--sizes", "4,x"], "error: --sizes '4,x': expected a comma-separated list of numbers"),
    ):
        code, _, stderr = run_cli_in_process("infer", "builds", "--model", "tiny", *args)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(message), stderr


def test_openvinos_bf16_build_is_held_to_the_auc_rule_on_the_datas_labels_and_runs_on_the_instances_threads(trained):
    pytest.importorskip("openvino", reason="the openvino build needs the optional extra dlrm-lab[openvino]")
    root, _ = trained
    served = _served(root)
    family = family_of(served.spec)
    model, _, _ = family.serving_model(served, 0, lambda _line: None)
    module = make_build(model, "openvino", precision="bf16", table_precision="fp32")
    check = accuracy.check_accuracy(model, module, "openvino", family.held_out(served, None, 0), precision="bf16",
                                    table_precision="fp32", labels="data")  # fmt: skip
    assert check.passed and check.to_dict()["passes_99_9"] and "AUC within 0.1%" in check.rule
    assert 0 < check.max_abs_diff < 0.05  # bf16: not fp32's scores, close to them
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        pooled = torch.zeros(3, len(served.spec.feature_names) * served.spec.embedding_dim)
        assert module.compiled(torch.zeros(3, served.spec.num_dense), pooled).shape == (3,)
        assert module.compiled.threads == 1  # compiled for the threads the instance gave torch
    finally:
        torch.set_num_threads(saved)


def test_the_openvino_build_without_openvino_names_the_extra_to_install(monkeypatch):
    from dlrm_lab.infer.builds.openvino import openvino_missing

    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` now fails as if it were not installed
    assert openvino_missing().endswith("pip install 'dlrm-lab[openvino]'")
    assert build_named("openvino").skip(100.0) == openvino_missing()
    with pytest.raises(RuntimeError, match=r"dlrm-lab\[openvino\]"):
        build_named("openvino").make(None, None, precision="fp32", table_precision="fp32")
    monkeypatch.delitem(sys.modules, "openvino")
    monkeypatch.setitem(sys.modules, "nncf", None)  # OpenVINO without its quantiser: only the int8 build is missing
    assert build_named("openvino").skip(100.0) is None
    assert build_named("openvino_int8").skip(100.0).startswith("NNCF is not installed")


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ({"eval": {"auc": "0.79", "step": 40}}, "eval.auc = '0.79': must be in [0, 1]"),
        ({"eval": "good"}, "eval = 'good': must be the last evaluation, an object, or null"),
        ({"data": None}, "data = missing: must be 'synthetic' or the training data's path"),
        ({"seed": None}, "seed = missing: must be a whole number >= 0"),
        ({"step": -1}, "step = -1: must be a whole number >= 0"),
        ({"data_overrides": "a=1"}, "data_overrides = 'a=1': must be a list of KEY=VALUE strings"),
        ({"precision": "fp7"}, "precision = 'fp7': must be one of auto, fp32, bf16, or null"),
        ({"world_size": "1"}, "world_size = '1': must be a whole number >= 1, or null"),
        ({"eval_data": "x"}, "eval_data = 'x': must be what the held-out samples were drawn from, an object, or null"),
    ],
)
def test_a_damaged_sidecar_is_refused_whole_at_start_naming_the_field(trained, tmp_path, damage, said):
    """Every field of trained.json that serving reads later is checked when it is read: one line naming the field,
    before any load, never a KeyError after it (issue 57 A5, D22)."""
    import shutil

    root, _ = trained
    copy = tmp_path / "copy"
    shutil.copytree(read_checkpoint(root).path, copy)
    about = {**read_checkpoint(root).about}
    about.update({k: v for k, v in damage.items() if v is not None})
    for key in (k for k, v in damage.items() if v is None):
        about.pop(key)
    (copy / TRAINED).write_text(json.dumps(about))
    with pytest.raises(UserError, match=r"^checkpoint /.*trained.json: " + re.escape(said)):
        _served(copy)


def test_a_second_run_writes_its_step_beside_the_first_and_a_killed_save_leaves_latest_whole(trained, tmp_path):
    """A checkpoint is written into a partial directory and renamed into place whole; where an earlier run left the
    same step, the new one takes another name and the earlier weights stay readable (issue 57 A1)."""
    import shutil

    import torch

    from dlrm_lab.model.checkpoint import LATEST, load_weights
    from dlrm_lab.train.checkpoint import save_checkpoint

    root, _ = trained
    copy = tmp_path / "run"
    copy.mkdir()
    first = read_checkpoint(root)
    shutil.copytree(first.path, copy / first.path.name)
    (copy / LATEST).write_text(first.path.name + "\n")
    model = family_of(dlrm_lab.load_preset("tiny")).serving_model(_served(copy), 0, lambda _line: None)[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = save_checkpoint(copy, model, optimizer, first.step, True, first.about)
    assert path.name == f"{first.path.name}.1" and (copy / LATEST).read_text().strip() == path.name
    assert read_checkpoint(copy).path == path
    again = read_checkpoint(copy / first.path.name)  # the earlier run's weights, whole
    assert again.step == first.step
    load_weights(model, again)
    assert not list(copy.glob(".step-*"))  # nothing partial left
    # a save killed mid-write leaves its partial directory, never named by `latest`; the next save removes it
    (copy / f".step-{41:08d}.partial").mkdir()
    (copy / f".step-{41:08d}.partial" / "__0_0.distcp").write_bytes(b"")
    assert read_checkpoint(copy).path == path
    assert save_checkpoint(copy, model, optimizer, 41, True, first.about).name == f"step-{41:08d}"
    assert not list(copy.glob(".step-*"))


def test_a_damaged_latest_or_shard_is_one_line_naming_the_file(trained, tmp_path):
    """Issue 57 A1/D21 siblings: `latest` holding bytes that are no name, and a shard file truncated or emptied, are
    each one line naming the file, for serving and for --resume alike (not a UnicodeDecodeError, nor "weights do not
    fit (EOFError)")."""
    import shutil

    from dlrm_lab.errors import FieldError
    from dlrm_lab.model.checkpoint import LATEST, check_metadata, latest_checkpoint

    root, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    (copy / LATEST).write_bytes(b"\xff\xfe\x00step")
    with pytest.raises(FieldError, match=r"latest: damaged .* names no step directory"):
        latest_checkpoint(copy)
    (copy / LATEST).write_text("../elsewhere\n")
    with pytest.raises(FieldError, match=r"latest: damaged"):
        latest_checkpoint(copy)
    step = read_checkpoint(root).path.name
    (copy / LATEST).write_text(step + "\n")
    (shard,) = (copy / step).glob("*.distcp")
    for cut in (shard.stat().st_size // 2, 0):
        with open(shard, "r+b") as f:
            f.truncate(cut)
        for field in ("checkpoint", "resume"):
            with pytest.raises(FieldError, match=rf"{shard.name}: has {cut:,} bytes of the [\d,]+ its metadata names"):
                check_metadata(copy / step, field)
    shard.unlink()
    with pytest.raises(FieldError, match=rf"{shard.name}: is missing"):
        check_metadata(copy / step)


def test_a_stop_inside_the_checkpoint_reader_is_a_stop_not_a_damaged_checkpoint(trained, monkeypatch):
    """DCP wraps whatever a reader raised in its own exception; Ctrl-C and SIGTERM come out as themselves (130 and
    1), never as "its weights do not fit" (issue 57 A2)."""
    import torch.distributed.checkpoint as dcp

    from dlrm_lab.errors import Terminated
    from dlrm_lab.model.checkpoint import load_weights

    root, _ = trained
    model = family_of(dlrm_lab.load_preset("tiny")).serving_model(_served(root), 0, lambda _line: None)[0]
    for stop in (KeyboardInterrupt(), Terminated("terminated by signal SIGTERM")):

        def interrupted_read(*_args, stop=stop, **_kw):
            from torch.distributed.checkpoint.api import CheckpointException

            raise CheckpointException("load", {0: (stop, None)})

        monkeypatch.setattr(dcp, "load", interrupted_read)
        with pytest.raises(type(stop)):
            load_weights(model, read_checkpoint(root))
    assert not issubclass(Terminated, Exception)  # no library's `except Exception` swallows a SIGTERM


def test_a_checkpoint_with_a_remote_target_is_refused_before_anything_runs(trained, tmp_path):
    """A remote server serves the weights it loaded itself: `--checkpoint` with `--target` would record weights the
    run never served, so it is one line naming both, before any connection or run directory (issue 57 D23)."""
    from dlrm_lab.infer.lab import InferConfig, run_inference
    from dlrm_lab.infer.load import QuerySizes, Stream

    root, _ = trained
    with pytest.raises(UserError, match=r"^checkpoint .*: target grpc://127.0.0.1:1: a remote server serves"):
        run_inference([_served(root)], [Stream("tiny", 10.0, QuerySizes.parse("fixed:1"))],
                      InferConfig(target="grpc://127.0.0.1:1"), metrics_dir=tmp_path / "runs")  # fmt: skip
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_damaged_metadata_file_is_one_line_and_no_reader_traceback(trained, tmp_path, capfd):
    """DCP's reader logged a traceback for each metadata it tried before the lab's line, and the line blamed the
    model (issue 57 D21): the metadata is read first, and a damaged one is said to be that."""
    import shutil

    from dlrm_lab.model.checkpoint import load_weights

    root, _ = trained
    copy = tmp_path / "damaged"
    shutil.copytree(read_checkpoint(root).path, copy)
    (copy / ".metadata").write_bytes(b"garbage")
    model = family_of(dlrm_lab.load_preset("tiny")).serving_model(_served(root), 0, lambda _line: None)[0]
    capfd.readouterr()
    with pytest.raises(UserError, match=r"^checkpoint /.*damaged: its .metadata is damaged or partial \("):
        load_weights(model, read_checkpoint(copy))
    assert "Traceback" not in capfd.readouterr().err


def test_infer_builds_lists_a_build_whose_warm_up_fails_with_why_and_times_the_rest(trained, monkeypatch):
    """A build that is made but raises at a batch size it must serve is a row with its reason, not a traceback."""
    from conftest import run_cli_in_process

    from dlrm_lab.infer import build as builds

    real = builds.make_runner

    class Raises:
        def warm_up(self, largest):
            raise RuntimeError("Expected size for first two dimensions of batch2 tensor to be: [1, 16]\nframe #0")

    def runner(module, *a, **k):
        return Raises() if getattr(module, "compiled", None) is not None else real(module, *a, **k)

    monkeypatch.setattr(builds, "make_runner", runner)
    root, _ = trained
    args = ["-m", "tiny", "--checkpoint", str(root), "--builds", "fused,compiled", "--sizes", "1,16", "--repeats", "1"]
    code, stdout, stderr = run_cli_in_process("infer", "builds", *args)
    assert code == 0, stderr
    assert "compiled: not timed: compiled: fails in its warm-up (batches of 1 to 16): Expected size" in stderr
    assert any(line.lstrip("│ ").startswith("compiled") for line in stdout.splitlines()), stdout  # its row, with why
    assert "fused: " in stderr and "us a sample" in stderr
