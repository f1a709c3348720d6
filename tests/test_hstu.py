"""HSTU layers (issue 17, first block): the mask, the two attention paths, the cost count."""

import pytest
import torch
from conftest import ROOT
from torch.nn import functional as F

from dlrm_lab.model.hstu import STULayer, STUShape, attention_pairs, valid_attention

SMALL = STUShape(dim=16, heads=2, qk_dim=4, v_dim=3)


def test_mask_is_causal_over_history_and_candidates_see_history_and_themselves():
    # request 0: 3 history tokens then 2 candidates; request 1: 2 history, 1 candidate, 2 padding
    m = valid_attention(torch.tensor([5, 3]), torch.tensor([2, 1]), 5)
    assert m.shape == (2, 5, 5) and m.dtype == torch.bool
    want0 = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],  # candidate: the history and itself
        [1, 1, 1, 0, 1],  # not the other candidate
    ], dtype=torch.bool)  # fmt: skip
    want1 = torch.zeros(5, 5, dtype=torch.bool)
    want1[:3, :3] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # padding: nothing
    assert torch.equal(m[0], want0) and torch.equal(m[1], want1)
    for history, cands in ((3, 2), (2, 1), (6401, 0), (1, 5)):
        n = history + cands
        if n <= 64:
            assert int(valid_attention(torch.tensor([n]), torch.tensor([cands]), n).sum()) == attention_pairs(
                history, cands
            )


def test_layer_flops_follow_the_reference_shapes():
    # DLRMv3: D 512, 4 heads of 128; a request of 1 contextual + 6,400 history tokens and 2,048 candidates
    shape = STUShape()
    pairs = attention_pairs(6401, 2048)
    assert pairs == 33_600_897
    assert shape.layer_flops(6401, 2048) == 3_670_016 * 8449 + 2048 * pairs  # ~99.8 GFLOP
    assert shape.layer_flops(6401, 2048, path="padded") == 3_670_016 * 8449 + 2048 * 8449**2
    # attention grows with the square of the history
    assert shape.layer_flops(2 * 6401, 0) - 3_670_016 * 2 * 6401 == pytest.approx(
        4 * (shape.layer_flops(6401, 0) - 3_670_016 * 6401), rel=1e-3
    )


def _batch(seed: int = 0):
    torch.manual_seed(seed)
    lengths, candidates = torch.tensor([7, 4, 9]), torch.tensor([3, 1, 2])
    x = torch.randn(3, 9, SMALL.dim)
    return x, lengths, candidates


def test_padded_and_jagged_attention_agree_and_leave_padding_alone():
    x, lengths, candidates = _batch()
    padded = STULayer(SMALL, attention="padded").eval()
    jagged = STULayer(SMALL, attention="jagged").eval()
    jagged.load_state_dict(padded.state_dict())
    with torch.no_grad():
        a, b = padded(x, lengths, candidates), jagged(x, lengths, candidates)
    assert a.shape == x.shape
    real = torch.arange(9).unsqueeze(0) < lengths.unsqueeze(1)
    torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-6)
    assert torch.equal(a[~real], x[~real]) and torch.equal(b[~real], x[~real])
    with pytest.raises(ValueError, match="attention 'flash'"):
        STULayer(SMALL, attention="flash")


def test_what_a_token_sees_decides_its_output():
    layer = STULayer(SMALL).eval()
    x, lengths, candidates = _batch(1)
    with torch.no_grad():
        base = layer(x, lengths, candidates)
        # request 0: history tokens 0-3, candidates 4-6
        changed = x.clone()
        changed[0, 5] += 1.0  # one candidate
        out = layer(changed, lengths, candidates)
        assert torch.equal(out[0, :5], base[0, :5]) and torch.equal(out[0, 6], base[0, 6])  # others unmoved
        assert not torch.equal(out[0, 5], base[0, 5])
        changed = x.clone()
        changed[0, 2] += 1.0  # a history token: later tokens and every candidate move, earlier ones do not
        out = layer(changed, lengths, candidates)
        assert torch.equal(out[0, :2], base[0, :2])
        assert all(not torch.equal(out[0, t], base[0, t]) for t in range(2, 7))
        changed = x.clone()
        changed[1, 6:] = 100.0  # padding of request 1
        assert torch.equal(layer(changed, lengths, candidates)[1, :4], base[1, :4])
    x.requires_grad_(True)
    layer.train()
    layer(x, lengths, candidates).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


TINY_RANKER = dict(items=1000, categories=8, users=50, layers=2, stu=STUShape(dim=16, heads=2, qk_dim=8, v_dim=8),
                   hidden=16, position_buckets=64, time_buckets=16, input_dropout=0.0, layer_dropout=0.0)  # fmt: skip


FEATURES = ("item_id", "item_category_id", "item_candidate_id", "item_candidate_category_id", "user_id")


def _requests(n: int, gen: torch.Generator):
    """Random requests; a candidate is clicked when its category and the user id have the
    same parity: learnable only through attention, since the user id reaches the candidates
    by the contextual token alone (item ids and histories are fresh draws)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    feats: dict[str, list[torch.Tensor]] = {k: [] for k in FEATURES}
    labels, actions = [], []
    for _ in range(n):
        h, c = int(torch.randint(3, 12, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        user = torch.randint(0, 50, (1,), generator=gen)
        cand_cat = torch.randint(0, 8, (c,), generator=gen)
        parts = (torch.randint(0, 1000, (h,), generator=gen), torch.randint(0, 8, (h,), generator=gen),
                 torch.randint(0, 1000, (c,), generator=gen), cand_cat, user)  # fmt: skip
        for k, v in zip(FEATURES, parts, strict=True):
            feats[k].append(v)
        labels.append((cand_cat % 2 == user % 2).float())
        actions.append(torch.randint(0, 32, (h,), generator=gen))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(FEATURES), values=torch.cat([torch.cat(feats[k]) for k in FEATURES]),
        lengths=torch.tensor([len(v) for k in FEATURES for v in feats[k]]),
    )  # fmt: skip
    acts = torch.cat(actions)
    return kjt, acts, torch.zeros(len(acts)), torch.cat(labels)


def test_the_ranker_scores_every_candidate_and_both_attention_paths_agree():
    from dlrm_lab.model.hstu import HSTURanker, RankerShape

    kjt, actions, ages, labels = _requests(5, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    padded = HSTURanker(RankerShape(**TINY_RANKER), attention="padded").eval()
    jagged = HSTURanker(RankerShape(**TINY_RANKER), attention="jagged").eval()
    jagged.load_state_dict(padded.state_dict())
    with torch.no_grad():
        a, b = padded(kjt, actions, ages), jagged(kjt, actions, ages)
    assert a.shape == labels.shape and torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_small_ranker_learns_what_only_attention_can_tell():
    from torchmetrics.functional.classification import binary_auroc

    from dlrm_lab.model.hstu import HSTURanker, RankerShape

    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = HSTURanker(RankerShape(**TINY_RANKER))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    held_out = _requests(64, torch.Generator().manual_seed(99))
    for _ in range(300):
        kjt, actions, ages, labels = _requests(16, gen)
        loss = F.binary_cross_entropy_with_logits(model(kjt, actions, ages), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        kjt, actions, ages, labels = held_out
        auc = float(binary_auroc(model(kjt, actions, ages), labels.long()))
    assert auc > 0.9, auc


def test_hstu_presets_load_scale_and_refuse_bad_fields(tmp_path):
    from conftest import run_cli_in_process

    import dlrm_lab
    from dlrm_lab.config import HSTUSpec, available_presets, load_any_preset, preset_family
    from dlrm_lab.errors import UserError

    assert {"dlrmv3", "hstu-tiny"} <= set(available_presets("hstu")) and "dlrmv3" not in available_presets()
    assert preset_family("dlrmv3") == "hstu" and preset_family("kaggle") == "dlrm"
    v3 = load_any_preset("dlrmv3")
    assert isinstance(v3, HSTUSpec)
    assert (v3.shape.layers, v3.shape.stu.dim, v3.shape.stu.heads, v3.shape.items) == (5, 512, 4, 1_000_000_000)
    assert v3.data.candidates == 2048 and v3.data.max_history + v3.data.candidates + 1 == 16_384
    small = load_any_preset("dlrmv3", table_scale=1e-4, max_rows=50_000)
    assert (small.shape.items, small.shape.users, small.shape.categories) == (50_000, 1000, 128)
    assert small.data.items == 50_000 and small.data.users == 500 and small.published_rows["items"] == 10**9
    # the cost per request: 5 layers of the STU count, ~0.5 TFLOP at 6,400 history items and 2,048 candidates
    assert v3.shape.request_flops(6400, 2048) == pytest.approx(5 * STUShape().layer_flops(6401, 2048), rel=0.05)
    with pytest.raises(UserError, match="is of family hstu: this command runs DLRM presets"):
        dlrm_lab.load_preset("dlrmv3")
    from dlrm_lab.config.family import spec_from_dict

    assert spec_from_dict(small.to_dict()) == small  # as a run's manifest holds it (scale sweeps read it back)
    assert spec_from_dict(dlrm_lab.load_preset("tiny").to_dict()) == dlrm_lab.load_preset("tiny")
    body = (ROOT / "models" / "hstu-tiny.toml").read_text()
    for change, message in (
        (body.replace("layers = 2", "layers = 0"), r"\[model\] layers = 0: must be an integer >= 1"),
        (
            body.replace("input_dropout = 0.0", "input_dropout = 1.5"),
            r"input_dropout = 1.5: must be a number in \[0, 1\)",
        ),
        (body.replace("[data]", "[data]\nusers = 5000"), r"\[data\] users = 5000: must be 1 .. the user table's 200"),
        (body.replace("[data]", "[data]\nitems = 5"), r"\[data\] items: set by \[model\] items"),
        (body.replace("candidates = 8", "candidate = 8"), r"unknown key 'candidate'"),
        ("extra = 1\n" + body, "unknown field"),
    ):
        path = tmp_path / "bad.toml"
        path.write_text(change)
        with pytest.raises(UserError, match=message):
            load_any_preset(path)
    code, out, _ = run_cli_in_process("presets")
    assert code == 0 and "HSTU ranker presets" in out and "hstu-tiny" in out
    code, out, _ = run_cli_in_process("presets", "show", "dlrmv3", "--table-scale", "0.0001")
    assert code == 0 and "5 STU layers, width 512" in out and "GFLOP forward" in out


def test_hstu_tiny_learns_through_the_training_loop(tmp_path):
    """The lab's one training loop runs the ranker: sharded sequence tables with the fused optimizer,
    time-ordered requests, held-out AUC on the later window against the teacher's."""
    import json

    from dlrm_lab.config import TrainConfig, load_any_preset
    from dlrm_lab.errors import UserError
    from dlrm_lab.model.cost import sample_cost
    from dlrm_lab.train import preflight, train

    spec = load_any_preset("hstu-tiny")
    result = train(
        preflight(spec, TrainConfig(steps=100, batch_size=32, eval_every=50, eval_batches=6)), metrics_dir=tmp_path
    )
    s = result.summary
    assert s["interaction"] == "hstu" and s["num_parameters"] == spec.num_parameters
    assert s["loss_last"] < s["loss_first"] and result.evals[-1]["auc"] > 0.75  # random ranking is 0.5
    assert 0.85 < s["teacher_auc"] < 0.99 and s["eval_auc"] < s["teacher_auc"]
    assert s["flops_per_sample"] == sample_cost(spec).training_flops > 0  # a sample is a request
    assert s["embedding_lookup_share"] > 0  # the sequence tables' phases are timed
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    assert {t["table"] for t in manifest["config"]["sharding_plan"]["tables"]} == {"item", "item_category", "user"}
    assert manifest["config"]["eval_data"]["window"] == "eval" and manifest["config"]["data"]["window"] == "train"
    chosen = manifest["config"]["attention_choice"]  # --attention auto: both paths timed, the faster taken
    assert set(chosen["layer_seconds"]) == {"padded", "jagged"}
    assert chosen["attention"] == min(chosen["layer_seconds"], key=chosen["layer_seconds"].get)
    # the report draws a request's FLOPs against its history, the run marked at its mean history
    from dlrm_lab.report.html import write_report

    report = write_report(tmp_path, tmp_path / "report")
    drawn = report.drawn["request_flops"]
    (curve,) = drawn.curves.values()
    assert all(p >= j for p, j in zip(curve["padded"], curve["jagged"], strict=True))
    assert curve["jagged"] == sorted(curve["jagged"]) and drawn.history[-1] == spec.data.max_history
    ((mean, gflop),) = drawn.marks.values()
    assert mean == spec.mean_history and gflop == pytest.approx(s["flops_per_sample"] / 3 / 1e9)
    with pytest.raises(UserError, match="^pipeline: hstu-tiny"):
        train(preflight(spec, TrainConfig(steps=2, pipeline=True)))
    with pytest.raises(UserError, match="hstu-tiny trains on its synthetic requests"):
        train(preflight(spec, TrainConfig(steps=2, data=str(tmp_path))))


def test_set_changes_an_hstu_presets_requests(tmp_path):
    from conftest import run_cli_in_process

    from dlrm_lab.config import load_any_preset
    from dlrm_lab.data.sequences import with_overrides
    from dlrm_lab.errors import UserError

    spec = load_any_preset("hstu-tiny")
    small = with_overrides(spec, ["candidates=4", "max_history=16"])
    assert (small.data.candidates, small.data.max_history, small.shape) == (4, 16, spec.shape)
    assert small.mean_history == 16 and with_overrides(spec, []) is spec
    for bad, message in (
        ("candidate=4", "^data_overrides 'candidate=4': hstu-tiny's \\[data\\] keys are"),
        ("items=5", "^data_overrides 'items=5'"),
        ("users=1000", "^data_overrides users=1000: must be 1 .. the user table's 200 rows"),
        ("candidates=0", "candidates = 0: an integer >= 1"),
    ):
        with pytest.raises(UserError, match=message):
            with_overrides(spec, [bad])
    code, out, err = run_cli_in_process(
        "train", "--preset", "hstu-tiny", "--set", "candidates=4", "--set", "max_history=16", "--steps", "3",
        "--batch-size", "8", "--eval-batches", "1", "--no-progress", "--metrics-dir", str(tmp_path),
    )  # fmt: skip
    assert code == 0, err
    assert "~16 history items + 4 candidates" in " ".join((err + out).split())
    (run,) = tmp_path.glob("train-*")
    import json

    data = json.loads((run / "manifest.json").read_text())["config"]["model"]["data"]
    assert (data["candidates"], data["max_history"]) == (4, 16)
    code, _, err = run_cli_in_process("train", "--preset", "hstu-tiny", "--set", "candidate=4")
    assert code == 2 and err.startswith("error: --set 'candidate=4'") and len(err.strip().splitlines()) == 1


def test_the_attention_path_is_chosen_by_timing_unless_asked():
    from dlrm_lab.config import load_any_preset
    from dlrm_lab.errors import UserError
    from dlrm_lab.model.hstu import choose_attention, time_attention_paths

    seconds = time_attention_paths(SMALL, [9, 5, 7], [2, 1, 3], torch.device("cpu"), repeats=1)
    assert set(seconds) == {"padded", "jagged"} and all(v > 0 for v in seconds.values())
    spec = load_any_preset("hstu-tiny")
    asked = choose_attention("jagged", spec, 8, torch.device("cpu"))
    assert asked.path == "jagged" and "asked for" in asked.reason and asked.seconds == {}
    auto = choose_attention("auto", spec, 4, torch.device("cpu"))
    assert auto.path == min(auto.seconds, key=auto.seconds.get) and "4 of the run's requests" in auto.reason
    with pytest.raises(UserError, match="^attention 'sparse': allowed: auto, padded, jagged"):
        choose_attention("sparse", spec, 4, torch.device("cpu"))


def test_hstu_options_the_family_cannot_take_are_refused_in_one_line():
    from dlrm_lab.config import TrainConfig, load_any_preset
    from dlrm_lab.data.sequences import with_overrides
    from dlrm_lab.errors import UserError
    from dlrm_lab.train.preflight import preflight

    spec = load_any_preset("hstu-tiny")
    for cfg, message in (
        (TrainConfig(table_precision="fp16"), "^table_precision fp16: hstu-tiny's tables are fp32"),
        (TrainConfig(shard=("item=table_row_wise",)), "^shard item=table_row_wise: hstu-tiny's tables take"),
        (TrainConfig(sharding="data_parallel"), "^sharding data_parallel: hstu-tiny's tables take table_wise"),
    ):
        with pytest.raises(UserError, match=message):
            preflight(spec, cfg)
    for bad, message in (("users=abc", "^data_overrides users='abc'"),
                         ("active_share=x", "active_share = 'x': a number"),
                         ("candidates=true", "candidates = True: an integer >= 1")):  # fmt: skip
        with pytest.raises(UserError, match=message):
            with_overrides(spec, [bad])


def test_sequence_tables_send_every_ids_row():
    """The cost model's bytes for the HSTU ranker at 2 ranks, worked by hand for hstu-tiny (mean history 64,
    8 candidates: the item and category tables see (64 + 8) / 2 x 2 features = 72 ids a request, the user 1)."""
    from dlrm_lab.config import load_any_preset
    from dlrm_lab.model.cost import step_communication_bytes

    comm = step_communication_bytes(load_any_preset("hstu-tiny"), 64, 2)
    # ids: 32 requests a rank, half remote, 8 bytes an id and 4 a length per feature
    assert comm["input_dist"] == 32 * 0.5 * ((8 * 72 + 8) * 2 + (8 + 4))
    # every id's 16-float row comes back and its gradient goes out: no pooling, no reduce-scatter
    assert comm["pooled_all_to_all"] == 32 * 0.5 * 2 * 4 * 16 * (72 + 72 + 1) and comm["pooled_reduce_scatter"] == 0
