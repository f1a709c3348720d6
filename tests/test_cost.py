"""The analytic cost model, against counts done by hand for `tiny` and the published kaggle figure."""

import pytest

import dlrm_lab
from dlrm_lab.model.cost import sample_cost, step_communication_bytes


def test_tiny_counts_by_hand():
    # tiny: 4 dense -> 16 -> 8; 4 features of dim 8 (pooling 1, 2, 1, 3); dot gives 8 + 4 + 6 = 18 -> 16 -> 1
    c = sample_cost(dlrm_lab.load_preset("tiny"))
    assert c.bottom_mlp_flops == 2 * (4 * 16 + 16 * 8) == 384
    assert c.interaction_flops == 2 * 5 * 5 * 8 == 400
    assert c.top_mlp_flops == 2 * (18 * 16 + 16 * 1) == 608
    assert c.forward_flops == 1392
    # weight and input gradients, but no gradient for the dense input features
    assert c.backward_flops == (4 * (64 + 128) - 2 * 64) + 800 + 2 * 608 == 2656
    assert c.training_flops == 4048
    assert c.embedding_bytes_read == 7 * 8 * 4 == c.embedding_bytes_written
    assert c.optimizer_state_bytes == 2 * 4 * 7


def test_kaggle_training_cost_is_the_published_2_85_mflop():
    c = sample_cost(dlrm_lab.load_preset("kaggle"))
    mlp_only = 3 * (c.bottom_mlp_flops + c.top_mlp_flops)
    assert mlp_only == pytest.approx(2.846e6, rel=1e-3)
    assert c.training_flops == pytest.approx(2.9e6, rel=0.02)  # plus the interaction, minus one input gradient


def test_cat_and_dcnv2_interactions():
    assert sample_cost(dlrm_lab.load_preset("rm1", max_rows=10)).interaction_flops == 0
    dcn = dlrm_lab.load_preset("dcnv2", max_rows=10)
    n = dcn.over_arch_in_features  # 27 x 128
    assert sample_cost(dcn).interaction_flops == 3 * 4 * n * 512


def test_communication_per_step():
    tiny = dlrm_lab.load_preset("tiny")
    assert step_communication_bytes(tiny, 64, 1) == {
        "input_dist": 0.0,
        "pooled_all_to_all": 0.0,
        "pooled_reduce_scatter": 0.0,
        "gradient_all_reduce": 0.0,
    }
    comm = step_communication_bytes(tiny, 64, 2)
    assert comm["input_dist"] == 32 * (8 * 7 + 4 * 4) * 0.5
    assert comm["pooled_all_to_all"] == 2 * 32 * 4 * 32 * 0.5 and comm["pooled_reduce_scatter"] == 0.0
    assert comm["gradient_all_reduce"] == 2 * 0.5 * 4 * tiny.dense_parameters


def test_communication_follows_the_plan_of_the_run():
    """Row-wise outputs are reduce-scattered for the whole global batch; replicas send no ids
    and all-reduce their rows' gradients with the dense ones."""
    tiny = dlrm_lab.load_preset("tiny")
    uniform = step_communication_bytes(tiny, 64, 2)
    first, *rest = tiny.tables
    rows = step_communication_bytes(tiny, 64, 2, {t.name: "row_wise" for t in tiny.tables})
    assert rows["input_dist"] == uniform["input_dist"]
    assert rows["pooled_all_to_all"] == 0.0 and rows["pooled_reduce_scatter"] == 2 * uniform["pooled_all_to_all"]
    mixed = step_communication_bytes(tiny, 64, 2, {first.name: "data_parallel"})
    kept = [t for t in tiny.tables if t.name != first.name]
    assert mixed["input_dist"] == sum(32 * (8 * t.pooling_factor + 4) * len(t.feature_names) * 0.5 for t in kept)
    assert mixed["gradient_all_reduce"] == 2 * 0.5 * 4 * (tiny.dense_parameters + first.num_parameters)
