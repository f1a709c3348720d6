"""The bf16 dense weights (train.dense_weights): copies of the fp32 masters the optimizer steps, equal to them after
every step; checkpoints that keep the masters; the same held-out AUC as autocast's fp32 weights at two seeds."""

from __future__ import annotations

import pytest
import torch

import dlrm_lab
from dlrm_lab.config import TrainConfig
from dlrm_lab.data import open_sources
from dlrm_lab.metrics.hardware import cpu_flags
from dlrm_lab.metrics.run import read_manifest
from dlrm_lab.model import build_model
from dlrm_lab.train import preflight, train
from dlrm_lab.train.dense_weights import DenseWeights


def _model_and_batch():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    spec = dlrm_lab.load_preset("tiny")
    torch.manual_seed(0)
    model = build_model(spec)
    batch = 32
    ids = torch.randint(0, min(t.num_embeddings for t in spec.tables), (batch * spec.num_features,))
    kjt = KeyedJaggedTensor.from_lengths_sync(spec.feature_names, ids, torch.ones(len(ids), dtype=torch.int64))
    return model, torch.randn(batch, spec.num_dense), kjt, torch.randint(0, 2, (batch,)).float()


def test_the_bf16_copies_equal_their_masters_after_every_step_and_the_masters_take_the_update():
    model, dense, kjt, labels = _model_and_batch()
    names = [n for n, _ in model.named_parameters() if not n.startswith("sparse_arch")]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    weights = DenseWeights(model, names)
    masters = weights.masters
    optimizer = torch.optim.Adagrad(masters, lr=0.05, fused=True)
    weights.use("bf16")
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n in names)
    assert model.dense_dtype == torch.bfloat16 and not weights.autocast
    for _ in range(3):
        logits = model(dense, kjt)
        assert logits.dtype == torch.float32  # the loss's boundary: back to fp32
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        weights.to_masters()
        assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
        assert all(c.grad is None for c in weights.copies)  # the next backward's gradient is its own
        optimizer.step()
        weights.after_step()
        assert weights.largest_gap() == 0.0  # each copy is its master rounded to bf16, after every step
    assert all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(m, before[n]) for n, m in zip(names, masters, strict=True))  # the masters moved
    with weights.as_trained():  # a checkpoint's view: the fp32 masters themselves, autocast's way
        state = model.state_dict()
        assert all(state[n].dtype == torch.float32 for n in names) and model.dense_dtype is None
        assert all(state[n].data_ptr() == m.data_ptr() for n, m in zip(names, masters, strict=True))
    assert weights.way == "bf16" and model.dense_dtype == torch.bfloat16
    weights.use("fp32")
    params = dict(model.named_parameters())
    assert all(params[n] is m for n, m in zip(names, masters, strict=True))


def test_a_bf16_weights_run_checkpoints_its_masters_and_auto_decides_on_its_own_steps(tmp_path):
    spec = dlrm_lab.load_preset("tiny")
    base = dict(batch_size=64, seed=3, prefetch=0, eval_batches=2, precision="bf16")
    fixed = train(
        preflight(spec, TrainConfig(steps=8, dense_weights="bf16", checkpoint_dir=str(tmp_path / "ck"), **base)),
        metrics_dir=tmp_path / "runs",
    )
    choice = read_manifest(fixed.run_dir)["config"]["dense_weights_choice"]
    assert choice["dense_weights"] == "bf16" and choice["reason"] == "--dense-weights bf16"
    # its checkpoint holds the fp32 masters: a resume takes the same steps as the run that went on
    longer = train(preflight(spec, TrainConfig(steps=12, dense_weights="bf16", **base)))
    resumed = train(preflight(spec, TrainConfig(steps=12, dense_weights="bf16", resume=True,
                                      checkpoint_dir=str(tmp_path / "ck"), **base)))  # fmt: skip
    assert [r["loss"] for r in resumed.steps] == pytest.approx([r["loss"] for r in longer.steps[8:]], rel=1e-4)
    # auto: both ways over a window of the run's own steps, the choice and its evidence recorded
    auto = train(preflight(spec, TrainConfig(steps=80, dense_weights="auto", **base)), metrics_dir=tmp_path / "auto")
    record = read_manifest(auto.run_dir)["config"]["dense_weights_choice"]
    assert record["requested"] == "auto" and record["dense_weights"] in ("bf16", "fp32")
    assert set(record["trial"]["ms"]) == {"bf16", "fp32"} and record["trial"]["pairs"] == 8
    # where the run cannot take them: fp32 weights, and why
    fp32 = train(preflight(spec, TrainConfig(steps=2, dense_weights="auto", **{**base, "precision": "fp32"})),
                 metrics_dir=tmp_path / "fp32")  # fmt: skip
    why = read_manifest(fp32.run_dir)["config"]["dense_weights_choice"]
    assert why["dense_weights"] == "fp32" and "nothing to cast" in why["reason"]


NATIVE_BF16 = bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))


@pytest.mark.skipif(not NATIVE_BF16, reason="bf16 is emulated on this CPU (43-100x slower than fp32 on AVX2)")
@pytest.mark.parametrize("seed", [0, 2])  # two of the three seeds kaggle's time to quality is tested at
def test_bf16_weights_reach_the_held_out_auc_of_autocast_at_every_seed(seed):
    """Time to quality kept: kaggle (1,000-row tables), 150 steps of 256, judged on 16,384 held-out samples
    (at 200 steps, 0.7819 and 0.7886 at seed 0 on 2026-11-29, fp32 and bf16 weights)."""
    spec = dlrm_lab.load_preset("kaggle", max_rows=1000)
    auc = {}
    for way in ("fp32", "bf16"):
        source, held_out = open_sources(spec, "synthetic", 256, eval_batches=64, seed=seed)
        cfg = TrainConfig(steps=150, batch_size=256, eval_batches=64, eval_every=150, seed=seed, precision="bf16",
                          dense_weights=way)  # fmt: skip
        auc[way] = train(preflight(spec, cfg, data=False), source=source, eval_source=held_out).summary["eval_auc"]
    assert auc["bf16"] >= auc["fp32"] - 0.005, auc  # no worse (the two ways' roundings differ: either may lead)


def test_the_copies_and_their_gradients_live_beside_their_masters():
    """The CPU twin of a GPU run: copies made on the host while the masters sat on the GPU failed the first GEMM."""
    from dlrm_lab.train.step import dense_params

    model = build_model(dlrm_lab.load_preset("tiny"), device="meta")
    weights = DenseWeights(model, list(dense_params(model)))
    assert weights.copies and {t.device.type for t in [*weights.copies, *weights.master_grads]} == {"meta"}
