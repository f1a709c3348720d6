"""The lab on CUDA: every test here needs a GPU (marked `gpu`, skipped without one) and imports only what a GPU
host carries beside torch (the lab, TorchRec and fbgemm-gpu: `../shared/gpu-bundle`), so that the GPU check
(`lab-gpu-check.sh`) collects them all where the CPU suite's own extras (duckdb, polars, OpenVINO) are absent."""

import pytest
import torch
from conftest import make_batch

import dlrm_lab

pytestmark = pytest.mark.gpu


def test_model_runs_on_cuda():
    spec = dlrm_lab.load_preset("tiny")
    model = dlrm_lab.build_model(spec, device="cuda")
    batch = make_batch(spec, 4, seed=0).to(torch.device("cuda"))
    assert model(batch.dense_features, batch.sparse_features).device.type == "cuda"


def test_the_interaction_choice_times_both_ways_on_cuda():
    from dlrm_lab.config import TrainConfig
    from dlrm_lab.model.interaction import DotInteractionArch
    from dlrm_lab.train.choices import choose_run_interaction

    spec = dlrm_lab.load_preset("tiny")
    model = dlrm_lab.build_model(spec, device="cuda")
    ctx = type("Ctx", (), {"is_main": True, "world_size": 1, "device": torch.device("cuda")})()
    choice = choose_run_interaction(spec, TrainConfig(batch_size=256, precision="bf16", device="cuda"), ctx, model,
                                    None)  # fmt: skip
    assert set(choice["ms"]) == {"fp32", "autocast"} and all(v > 0 for v in choice["ms"].values())
    arch = next(m for m in model.modules() if isinstance(m, DotInteractionArch))
    assert arch.gram_dtype == (torch.float32 if choice["gram_dtype"] == "fp32" else None)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_on_cuda(precision):
    """bf16: the run's measured choices (the interaction's way among them) time their candidates on the GPU."""
    from dlrm_lab.config import TrainConfig
    from dlrm_lab.train import preflight, train

    spec = dlrm_lab.load_preset("tiny")
    result = train(preflight(spec, TrainConfig(steps=10, batch_size=64, device="cuda", precision=precision)))
    assert result.summary["device"].startswith("cuda") and result.summary["samples_per_s"] > 0


def test_gemm_rates_are_measured_on_the_gpu():
    from dlrm_lab.metrics import precision as prec

    rates = prec.measure_shape_rates([(256, 512, 512)], ["fp32", "bf16", "fp16"], torch.device("cuda"), 1)
    assert set(rates) == {"fp32", "bf16", "fp16"} and all(v > 0 for v in rates.values())


def test_request_batches_pin_for_the_cuda_prefetcher():
    from dlrm_lab.config import load_any_preset
    from dlrm_lab.data.request_batches import RequestBatch
    from dlrm_lab.data.sequences import SequenceGenerator

    batch = RequestBatch.from_block(SequenceGenerator(load_any_preset("hstu-tiny").data).requests(0, 4)).pin_memory()
    assert batch.actions.is_pinned() and batch.labels.is_pinned()
    assert batch.to("cuda", non_blocking=True).labels.device.type == "cuda"
