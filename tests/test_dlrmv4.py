"""MLPerf Training v6.1's DLRMv4 (issue 36, section 1): its preset, its FLOP count by the reference's own rule,
the generator's artists, albums and cross-hash ids, and the streaming train-on-T / evaluate-on-T+1 protocol."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, run_cli_in_process

from dlrm_lab.config import TrainConfig, load_any_preset
from dlrm_lab.config.hstu import reference_training_flops
from dlrm_lab.data.sequences import SequenceGenerator
from dlrm_lab.data.streaming import Stream
from dlrm_lab.errors import UserError

# DLRMv4's layout (the same tables, crosses and towers' structure) at a size tests train in seconds
TINY_V4 = """
name = "dlrmv4-tiny"
family = "hstu"
[model]
items = 2000
users = 201
categories = 8
layers = 2
dim = 16
heads = 2
qk_dim = 8
v_dim = 8
hidden = 32
position_buckets = 128
time_buckets = 64
input_dropout = 0.0
layer_dropout = 0.0
item_tower = [24, 16]
head = [12, 1]
[model.item_tables]
artist = 40
album = 120
[model.cross_tables]
user_x_artist = 3000
user_x_album = 2000
user_x_hour = 1000
item_x_hour = 2000
artist_x_hour = 900
user_x_is_organic = 400
user_x_artist_x_hour = 5000
[data]
users = 200
timestamps = 24
train_timestamps = 23
warmup_timestamps = 8
active_share = 0.8
interactions_mean = 6.0
interactions_sd = 2.0
interactions_max = 12
candidates = 1
max_history = 40
interests = 2
drift_period = 20.0
"""

TABLES = {"item": 9_390_624, "artist": 1_293_395, "album": 3_367_692, "user": 1_000_001,
          "user_x_artist": 100_000_000, "user_x_album": 40_000_000, "user_x_hour": 24_000_000,
          "item_x_hour": 40_000_000, "artist_x_hour": 32_000_000, "user_x_is_organic": 2_000_000,
          "user_x_artist_x_hour": 40_000_000}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("presets") / "dlrmv4-tiny.toml"
    path.write_text(TINY_V4)
    return path


def test_the_preset_has_the_published_shapes_and_recipe():
    from dlrm_lab.config.family import spec_from_dict
    from dlrm_lab.model.hstu import build_ranker

    v4 = load_any_preset("dlrmv4")
    s = v4.shape
    assert (s.layers, s.stu.dim, s.stu.heads, s.stu.qk_dim, s.stu.v_dim) == (3, 512, 4, 128, 128)
    assert s.table_rows == TABLES and all(t.embedding_dim == 512 for t in v4.tables)
    # a request: 8 contextual tokens (the user, 7 crosses) + 4,086 history + 1 candidate = 4,095 of the 4,096 budget
    assert s.contextual_tokens == 8 and v4.data.max_history == 4086 and v4.data.candidates == 1
    assert s.contextual_tokens + v4.data.max_history + v4.data.candidates == 4095 <= v4.reference.max_seq_len == 4096
    assert v4.mean_history == 4086  # every training request has the full history, as MIN_HISTORY = 4,086 asks
    r = v4.reference
    assert (r.batch_size, r.dense_lr, r.target_auc, r.dense_optimizer, r.adam_betas) == (8192, 1e-6, 0.75, "adam",
                                                                                        (0.95, 0.999))  # fmt: skip
    assert (r.embedding_optimizer, r.lr_warmup_steps, r.grad_clip_norm, r.eval_every_share) == (
        "rowwise_adagrad", 24_000, 1.0, 0.001)  # fmt: skip
    assert (r.samples_to_target, r.runs) == (69.3e6, 10) and v4.reference_batch_size == 8192
    # the towers, as built (tables on the meta device): item 1,536 -> 512 -> 512, head 512 -> 512 -> 1
    model = build_ranker(v4, table_device="meta")
    assert [m.weight.shape for m in model.item_tower if isinstance(m, torch.nn.Linear)] == [(512, 1536), (512, 512)]
    assert [m.weight.shape for m in model.head if isinstance(m, torch.nn.Linear)] == [(512, 512), (1, 512)]
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("tables."))
    assert dense == v4.dense_parameters and len(model.contextual) == 8
    # every table scales alike; the published rows stay for the initial rows' spread
    small = load_any_preset("dlrmv4", table_scale=1e-3, max_rows=20_000)
    assert small.shape.table_rows["album"] == 3368 and small.shape.table_rows["user_x_artist"] == 20_000
    assert {t.name: t.published_rows for t in small.tables} == TABLES
    assert small.data.attributes == (("artist", 1294), ("album", 3368)) and small.data.users == 1000
    assert spec_from_dict(small.to_dict()) == small
    code, out, _ = run_cli_in_process("presets", "show", "dlrmv4", "--table-scale", "0.001")
    assert code == 0 and "item tower 1536 -> 512 -> 512" in out and "315.7 GFLOP (published: 315.7)" in out


def test_the_flop_count_is_the_published_315_7_gflop_by_the_references_rule():
    """The README's 315.7 GFLOP per training sample is its rule (`reference_training_flops`): per STU layer at
    S = max_seq_len = 4,096 positions, the u/v/q/k (S x 512 x 2,048 MACs) and output (S x 1,536 x 512) projections
    x2 FLOPs x3 (forward and backward), attention's two products over the causal half (S^2 / 2 x 4 x 256 MACs)
    x2 x3.5; three layers; no lookups, norms, towers or head MLPs. Its parts: attention 180.4, u/v/q/k 77.3,
    output 58.0 GFLOP.

    The lab's own count (`sample_cost`: forward parts x3) of the same request differs by design: it counts
    the request's own 4,095 tokens and its valid (query, key) pairs (its GEMMs agree with the reference's
    to the one token: 4,095 / 4,096), backward as twice forward on attention too (x3, not x3.5: 14% less
    attention), and adds the preprocessor's towers (~19.5 GFLOP) and the head: 309.4 GFLOP, 2.0% under."""
    from dlrm_lab.model.cost import sample_cost

    v4 = load_any_preset("dlrmv4")
    assert v4.reference_flops_per_sample == pytest.approx(315.7e9, rel=2e-4)
    assert v4.reference_flops_per_sample == pytest.approx(v4.reference.flops_per_sample, rel=2e-4)
    one_layer_attention = 2 * 3.5 * 4096**2 / 2 * 4 * 256
    assert 3 * one_layer_attention == pytest.approx(180.4e9, rel=3e-4)
    stack = reference_training_flops(v4.shape, 4096)
    assert stack - 3 * one_layer_attention == pytest.approx((77.3e9 + 58.0e9), rel=1e-3)
    # at the same sequence, the per-step figure of the README's table (x 1,024 samples a rank): 323.26 TFLOP
    assert stack * 1024 == pytest.approx(323.26e12, rel=1e-4)
    lab = sample_cost(v4)
    pre, stack_fwd, post = v4.shape.request_flops_parts(4086, 1)
    assert lab.training_flops == 3 * (pre + stack_fwd + post)
    gemm_fwd = 3 * 2 * 4095 * (512 * 2048 + 1536 * 512)
    assert 3 * gemm_fwd == pytest.approx(3 * 2 * 3 * 4096 * (512 * 2048 + 1536 * 512) * 4095 / 4096)
    assert 3 * (stack_fwd - gemm_fwd) == pytest.approx(3 * one_layer_attention * 3 / 3.5, rel=2e-3)
    assert lab.training_flops == pytest.approx(309.4e9, rel=1e-3)
    assert lab.training_flops / v4.reference_flops_per_sample == pytest.approx(0.980, abs=0.002)
    # DLRMv3 and hstu-tiny keep their count (the published formula's request: 6,400 history, 2,048 candidates)
    v3 = load_any_preset("dlrmv3")
    assert v3.shape.contextual_tokens == 1 and v3.shape.request_flops(6400, 2048) == 5 * (
        3_670_016 * 8449 + 2048 * 33_600_897 + 0) + v3.shape.request_flops_parts(6400, 2048)[0] + (
        v3.shape.request_flops_parts(6400, 2048)[2])  # fmt: skip
    assert v3.reference_flops_per_sample is None and load_any_preset("hstu-tiny").shape.table_rows == {
        "item": 2000, "item_category": 8, "user": 200}  # fmt: skip


def test_an_items_artist_and_album_are_its_own_and_crosses_hash_what_their_names_cross(tiny_v4):
    spec = load_any_preset(tiny_v4)
    gen = SequenceGenerator(spec.data, seed=3)
    block = gen.requests(0, 120)
    items = np.concatenate([block.history_items, block.candidate_items])
    cats = np.concatenate([block.history_categories, block.candidate_categories])
    attrs = np.concatenate([block.history_attributes, block.candidate_attributes])
    artist, album = attrs[:, 0], attrs[:, 1]
    for item in np.unique(items)[:200]:  # one artist and one album per item, wherever it appears
        seen = attrs[items == item]
        assert (seen == seen[0]).all()
    assert (artist % 8 == cats).all() and (album % 40 == artist).all()  # an album is one artist's, in one genre
    assert artist.max() < 40 and album.max() < 120 and len(np.unique(album)) > 60
    assert np.array_equal(SequenceGenerator(spec.data, seed=3).item_attributes(items, cats), attrs)
    # the crosses: user_x_artist is a function of (user, the anchor's artist), user_x_hour of (user, hour)
    names = [n for n, _ in spec.data.crosses]
    anchor_artist = block.candidate_attributes[:, 0]  # one candidate a request: the anchor
    ux_artist = block.crosses[:, names.index("user_x_artist")]
    for key in set(zip(block.user.tolist(), anchor_artist.tolist(), strict=True)):
        same = (block.user == key[0]) & (anchor_artist == key[1])
        assert len(set(ux_artist[same])) == 1
    hour, organic = gen.request_context(block.user, block.step)
    ids = gen.cross_ids(block.user, block.step, block.candidate_items, block.candidate_attributes)
    assert np.array_equal(ids, block.crosses) and (ids < np.array([r for _, r in spec.data.crosses])).all()
    other_hour = gen.cross_ids(block.user, block.step + 1, block.candidate_items, block.candidate_attributes)
    moved = ids != other_hour
    assert not moved[:, names.index("user_x_artist")].any() and not moved[:, names.index("user_x_album")].any()
    changed_hour = gen.request_context(block.user, block.step + 1)[0] != hour
    assert np.array_equal(moved[:, names.index("user_x_hour")], changed_hour)
    assert 0.3 < organic.mean() < 0.7 and set(np.unique(hour)) <= set(range(24))
    # a history outgrows its one candidate: up to interactions_max items met a step
    assert block.history_lengths.max() > spec.data.timestamps and (block.candidate_lengths == 1).all()


def test_streaming_never_scores_a_request_before_one_it_trained_on(tiny_v4, tmp_path, monkeypatch):
    """--protocol streaming walks the windows in time order: at every evaluation, every scored request is later
    than every request trained on so far (the next window), and the eval table records both windows."""
    import dlrm_lab.train.loop as loop
    from dlrm_lab.train import preflight, train

    trained: list[int] = []  # each trained request's time step, in training order
    scored: list[tuple[int, list[int]]] = []  # (requests trained before it, the scored requests' steps)
    real_step, real_evaluate = loop.train_step, loop.evaluate

    def spy_step(dmp, optimizer, batch, *args):
        trained.extend(batch.steps.tolist())
        return real_step(dmp, optimizer, batch, *args)

    def spy_evaluate(model, batches, device):
        batches = list(batches)
        scored.append((len(trained), [s for b in batches for s in b.steps.tolist()]))
        return real_evaluate(model, batches, device)

    monkeypatch.setattr(loop, "train_step", spy_step)
    monkeypatch.setattr(loop, "evaluate", spy_evaluate)
    spec = load_any_preset(tiny_v4)
    cfg = TrainConfig(steps=45, batch_size=16, protocol="streaming", eval_every_share=0.05, eval_batches=2,
                      dense_optimizer="adam", dense_lr=3e-3, prefetch=2)  # fmt: skip
    result = train(preflight(spec, cfg), metrics_dir=tmp_path)
    stream = Stream(spec.data, 16)
    assert (stream.steps, stream.per_window, stream.skipped_per_window) == (150, 10, 0)
    assert trained == sorted(trained) and trained[0] == 8 and len(trained) == 45 * 16  # wall-clock order
    every = round(0.05 * 150)  # the share is of the stream's steps: 8
    assert [e["step"] for e in result.evals] == [*range(every - 1, 44, every), 44]
    for (seen, steps), row in zip(scored, result.evals, strict=True):
        assert min(steps) > max(trained[:seen]) and set(steps) == {max(trained[:seen]) + 1}
        assert (row["train_window"], row["eval_window"]) == (max(trained[:seen]), min(steps))
        assert row["num_samples"] == 2 * 16  # two global batches of the next window, one candidate each
    table = pq.read_table(result.run_dir / "eval.parquet").to_pylist()
    assert [(r["train_window"], r["eval_window"]) for r in table] == [
        (e["train_window"], e["eval_window"]) for e in result.evals]  # fmt: skip
    manifest = json.loads((result.run_dir / "manifest.json").read_text())["config"]
    assert manifest["stream"]["eval_every"] == every and manifest["stream"]["train_windows"] == [8, 23]
    assert manifest["train"]["protocol"] == "streaming" and manifest["eval_data"]["window"] == "next"


def test_streaming_stops_at_the_target_and_records_the_time_to_it():
    """Time to quality on the stream: the run stops at the first evaluation that reaches the target AUC."""
    from dlrm_lab.train import preflight, train

    spec = load_any_preset("hstu-tiny")
    cfg = TrainConfig(steps=150, batch_size=28, protocol="streaming", eval_every_share=0.04, eval_batches=5,
                      target_auc=0.7, prefetch=0)  # fmt: skip
    result = train(preflight(spec, cfg))
    s, evals = result.summary, result.evals
    assert s["target_reached"] and evals[-1]["auc"] >= 0.7 and all(e["auc"] < 0.7 for e in evals[:-1])
    assert s["steps_to_target"] == evals[-1]["step"] + 1 == s["steps"] < 150 and s["time_to_target_s"] > 0
    assert evals[0]["auc"] < evals[-1]["auc"] <= s["teacher_auc"]


def test_what_the_protocol_and_the_layout_refuse_is_one_line(tiny_v4, tmp_path):
    from dlrm_lab.train.preflight import preflight

    spec = load_any_preset(tiny_v4)
    with pytest.raises(UserError, match="protocol streaming: tiny .*has no time windows"):
        preflight(load_any_preset("tiny"), TrainConfig(protocol="streaming"))
    with pytest.raises(UserError, match="protocol streaming: a window holds 160 requests, fewer than one global "
                                        "batch of 200 \\(lower batch_size\\)"):  # fmt: skip
        Stream(spec.data, 200)
    with pytest.raises(UserError, match="eval_every_share 0: must be a share in"):
        TrainConfig(eval_every_share=0)
    with pytest.raises(UserError, match="protocol 'online': allowed: holdout, streaming"):
        TrainConfig(protocol="online")
    code, _, err = run_cli_in_process("train", "--preset", "tiny", "--protocol", "streaming", "--steps", "2")
    assert code == 2 and err.startswith("error: --protocol streaming: tiny") and len(err.strip().splitlines()) == 1
    code, _, err = run_cli_in_process("train", "--preset", str(tiny_v4), "--protocol", "streaming", "--batch-size",
                                      "100", "--set", "users=100")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert (
        "--protocol streaming: a window holds 80 requests, fewer than one global batch of 100 (lower --batch-size)"
        in err
    )
    body = TINY_V4
    for change, message in (
        (body.replace("album = 120", "album = 0"), r"\[model.item_tables\] album = 0: must be an integer >= 1"),
        (
            body.replace("user_x_album = 2000", "user_x_genre = 2000"),
            "cross table 'user_x_genre': its name crosses two or more of album, artist, hour, is_organic, item, user",
        ),
        (body.replace("item_tower = [24, 16]", "item_tower = [24, 8]"), "item_tower ends at the width 16"),
        (body.replace("head = [12, 1]", "head = [12]"), r"head = \[12\]: must be \[hidden, out\]"),
        (body.replace("[model.item_tables]", "[model.item_tables]\nuser = 5"), "user: a name the ranker's own"),
        (body + "\n[reference]\nwarmup = 3\n", "unknown key 'warmup'; allowed: adam_betas"),
        (body + "\n[reference]\nadam_betas = [0.9]\n", r"adam_betas = \[0.9\]: must be two numbers in \[0, 1\)"),
        (body.replace("[data]", "[data]\ncrosses = []"), r"\[data\] crosses: set by \[model.cross_tables\]"),
    ):
        path = tmp_path / "bad.toml"
        path.write_text(change)
        with pytest.raises(UserError, match=message):
            load_any_preset(path)
    # serving and request files do not carry the attributes and crosses yet: refused before anything starts
    code, _, err = run_cli_in_process("data", "gen", "--preset", str(tiny_v4), "--out", str(tmp_path / "d"))
    assert code == 2 and "the request files' columns" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli_in_process("infer", "run", "--preset", str(tiny_v4), "--duration", "1")
    assert code == 2 and "the served request library" in err


def test_the_scaled_benchmark_command_trains_on_the_stream(tmp_path, monkeypatch):
    """benchmarks/dlrmv4.py's run, at a size a test affords: the published layers and tables (scaled), streaming.
    The script in this process, its `dlrm-lab train` through the CLI's entry point where `lab_run` would start
    it as a process (a real `dlrm-lab` process: tests/test_cli.py's ctrl-c test)."""
    import importlib.util
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its `from common import ...`
    found = importlib.util.spec_from_file_location("benchmark_dlrmv4", ROOT / "benchmarks" / "dlrmv4.py")
    benchmark = importlib.util.module_from_spec(found)
    found.loader.exec_module(benchmark)

    def lab_run(tmp, *args):  # benchmarks/common.py's, without the process
        root = tmp / "run-0"
        code, _, err = run_cli_in_process(*args, "--metrics-dir", str(root), "--no-progress")
        assert code == 0, err
        (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
        return run_dir

    out = tmp_path / "r.json"
    monkeypatch.setattr(benchmark, "lab_run", lab_run)
    monkeypatch.setattr(sys, "argv", ["dlrmv4.py", "--smoke", "--out", str(out)])
    benchmark.main()
    result = json.loads(out.read_text())
    assert result["command"] == "dlrm-lab " + " ".join(benchmark.command("smoke"))
    run = result["run"]
    assert run["protocol"] == "streaming" and run["evals"] and run["steps"] > 0 and run["teacher_auc"] > 0.5
    assert all(e["eval_window"] == e["train_window"] + 1 for e in run["evals"])


def test_the_published_dense_recipe_is_the_default_and_each_setting_can_be_given():
    """Adam's betas, the warm-up and the clip come from the preset's [reference] unless given; a DLRM preset
    publishes none, so its MLPs step as before."""
    from dlrm_lab.config.train import dense_recipe_for

    v4 = load_any_preset("dlrmv4", table_scale=1e-4, max_rows=2000)
    recipe = dense_recipe_for(v4, TrainConfig(dense_optimizer="adam"))
    assert (recipe.betas, recipe.lr_warmup_steps, recipe.grad_clip_norm) == ((0.95, 0.999), 24_000, 1.0)
    assert recipe.rule.startswith("published (") and "adam_betas, lr_warmup_steps, grad_clip_norm" in recipe.rule
    given = dense_recipe_for(v4, TrainConfig(dense_optimizer="adam", adam_beta1=0.8, lr_warmup_steps=0))
    assert (given.betas, given.lr_warmup_steps, given.grad_clip_norm) == ((0.8, 0.999), 0, 1.0)
    assert given.rule.startswith("given: adam_betas, lr_warmup_steps; published (") and given.rule.endswith(
        "): grad_clip_norm"
    )
    assert dense_recipe_for(v4, TrainConfig()).betas is None  # Adagrad: the published betas are Adam's
    plain = dense_recipe_for(load_any_preset("tiny"), TrainConfig(dense_optimizer="adam"))
    assert (plain.betas, plain.lr_warmup_steps, plain.grad_clip_norm) == ((0.9, 0.999), 0, None)
    with pytest.raises(UserError, match="adam_beta1 1.2: must be in"):
        TrainConfig(adam_beta1=1.2)
    with pytest.raises(UserError, match="grad_clip_norm 0: must be a number > 0"):
        TrainConfig(grad_clip_norm=0)


def test_the_recipe_warms_the_dense_rate_up_and_clips_only_the_dense_gradients():
    """RecipeOptimizer: the dense rate rises linearly over the warm-up (resumed from the run's step), the dense
    gradients' norm is clipped before each step, and the tables' optimizer is left as it is."""
    import torch
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    from dlrm_lab.config.train import DenseRecipe
    from dlrm_lab.train.step import RecipeOptimizer

    table, mlp = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    fused = KeyedOptimizerWrapper({"table": table}, lambda ps: torch.optim.SGD(ps, lr=1.0))
    dense = KeyedOptimizerWrapper({"mlp": mlp}, lambda ps: torch.optim.SGD(ps, lr=1.0))
    opt = RecipeOptimizer(fused, dense, 1.0, DenseRecipe(lr_warmup_steps=4, grad_clip_norm=0.5))
    rates = []
    for _ in range(5):
        rates.append(dense.param_groups[0]["lr"])
        table.grad, mlp.grad = torch.full((4,), 10.0), torch.full((4,), 10.0)
        before = mlp.detach().clone()
        opt.step()
        assert float((before - mlp.detach()).norm()) == pytest.approx(0.5 * rates[-1], rel=1e-5)  # clipped
    assert rates == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert float(table.detach()[0]) == pytest.approx(-50.0)  # the tables' 5 steps of lr 1 x grad 10, unclipped
    opt.resume_at(1)  # a run resumed at step 1
    assert dense.param_groups[0]["lr"] == 0.5
