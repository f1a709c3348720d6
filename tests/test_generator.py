"""The synthetic generator: calibrated distributions, determinism, shards, learnable labels."""

import math

import numpy as np
import pytest

import dlrm_lab
from dlrm_lab.config import TrainConfig
from dlrm_lab.data import SyntheticGenerator, SyntheticSource, load_data_spec, synthetic_generator
from dlrm_lab.data.distributions import expected_pooling, expected_top_share, fit_zipf_alpha, sample_pooling
from dlrm_lab.data.synthetic import expected_auc
from dlrm_lab.train import preflight, train

ONE_TABLE = """
num_dense = 2
num_embeddings = [{rows}]
embedding_dim = 4
bottom_mlp = [4]
top_mlp = [4, 1]
"""


def one_feature(tmp_path, rows, ids, pooling='{ distribution = "fixed", value = 1 }', extra=""):
    model_path = tmp_path / "one.toml"
    model_path.write_text(ONE_TABLE.format(rows=rows))
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(f"click_rate = 0.2\n[features.cat_0]\nids = {ids}\npooling = {pooling}\n{extra}")
    model = dlrm_lab.load_preset(str(model_path))
    return SyntheticGenerator(load_data_spec(str(spec_path), model), seed=5)


def lookups(gen, n):
    return np.concatenate([gen.block(b).values[0] for b in range(math.ceil(n / gen.block_size))])[:n]


@pytest.mark.parametrize("alpha", [0.8, 1.05, 1.3])
def test_zipf_exponent_fits_within_0_05_at_a_million_samples(tmp_path, alpha):
    gen = one_feature(tmp_path, 200_000, f'{{ distribution = "zipf", alpha = {alpha} }}')
    counts = np.bincount(lookups(gen, 1_000_000), minlength=200_000)
    assert abs(fit_zipf_alpha(counts) - alpha) < 0.05
    top = 2000  # the top 1% of rows
    share = np.sort(counts)[::-1][:top].sum() / counts.sum()
    assert share == pytest.approx(expected_top_share({"distribution": "zipf", "alpha": alpha}, 200_000, top), abs=0.02)


def test_zipf_small_table_matches_exact_probabilities():
    from dlrm_lab.data.distributions import zipf_ranks

    ranks = zipf_ranks(np.random.default_rng(0), 1_000_000, 6, 1.3)
    p = np.arange(1, 7) ** -1.3
    np.testing.assert_allclose(np.bincount(ranks, minlength=6) / 1e6, p / p.sum(), atol=0.002)


def test_hot_set_gives_its_mass_to_its_rows(tmp_path):
    gen = one_feature(tmp_path, 100_000, '{ distribution = "hot_set", hot_fraction = 0.01, hot_mass = 0.7 }')
    counts = np.bincount(lookups(gen, 400_000), minlength=100_000)
    assert np.sort(counts)[::-1][:1000].sum() / counts.sum() == pytest.approx(0.7, abs=0.01)


def test_permutation_scatters_hot_rows_and_stays_a_bijection(tmp_path):
    ids = '{ distribution = "zipf", alpha = 1.2 }'
    scattered = np.bincount(lookups(one_feature(tmp_path, 10_000, ids), 200_000), minlength=10_000)
    in_order = np.bincount(
        lookups(one_feature(tmp_path, 10_000, ids, extra="permute = false"), 200_000), minlength=10_000
    )
    assert np.argmax(in_order) == 0 and np.argmax(scattered) != 0
    top_scattered = np.argsort(scattered)[::-1][:10]
    assert np.ptp(top_scattered) > 1000  # the ten hottest rows are spread over the table
    # same popularity profile: a permutation only renames rows
    assert abs(np.sort(scattered)[::-1][:100].sum() - np.sort(in_order)[::-1][:100].sum()) < 0.01 * 200_000


def test_drift_moves_the_hot_set(tmp_path):
    gen = one_feature(tmp_path, 50_000, '{ distribution = "zipf", alpha = 1.3 }', extra="drift = { every = 8192 }")
    first = np.bincount(gen.samples(0, 8192).values[0], minlength=50_000)
    second = np.bincount(gen.samples(8192, 16384).values[0], minlength=50_000)
    assert np.argmax(first) != np.argmax(second)
    assert np.sort(first)[-1] == pytest.approx(np.sort(second)[-1], rel=0.15)  # same skew, other rows


def test_reuse_distance_repeats_recent_ids(tmp_path):
    gen = one_feature(tmp_path, 1_000_000, '{ distribution = "reuse", distances = [1, 5], probabilities = [0.3, 0.2] }')
    x = gen.block(0).values[0]
    assert np.mean(x[1:] == x[:-1]) == pytest.approx(0.3, abs=0.03)  # fresh ids almost never collide
    assert np.mean(x[5:] == x[:-5]) == pytest.approx(0.2, abs=0.03)


@pytest.mark.parametrize(
    "pooling",
    [
        {"distribution": "fixed", "value": 3},
        {"distribution": "uniform", "min": 2, "max": 9},
        {"distribution": "normal", "mean": 10, "std": 4, "min": 1, "max": 15},
        {"distribution": "lognormal", "mean": 20, "sigma": 1.0, "min": 0, "max": 100},
        {"distribution": "histogram", "values": [1, 4, 50], "weights": [0.5, 0.3, 0.2]},
    ],
)
def test_pooling_distributions_meet_their_mean_and_bounds(pooling):
    n = sample_pooling(np.random.default_rng(1), 200_000, pooling)
    assert n.mean() == pytest.approx(expected_pooling(pooling), rel=0.02)
    if "min" in pooling:
        assert n.min() >= pooling["min"] and n.max() <= pooling["max"]
    if pooling["distribution"] == "histogram":
        assert np.mean(n == 50) == pytest.approx(0.2, abs=0.005)


def test_same_seed_same_bytes_other_seed_other_bytes():
    model = dlrm_lab.load_preset("tiny")
    a = synthetic_generator(model, seed=7).samples(100, 9000)
    b = synthetic_generator(model, seed=7).samples(100, 9000)
    c = synthetic_generator(model, seed=8).samples(100, 9000)
    assert a.dense.tobytes() == b.dense.tobytes() and a.labels.tobytes() == b.labels.tobytes()
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a.values + a.lengths, b.values + b.lengths, strict=True))
    assert a.dense.tobytes() != c.dense.tobytes()


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_shards_are_disjoint_and_together_the_whole(world_size):
    model = dlrm_lab.load_preset("tiny")
    gen = synthetic_generator(model, seed=1)
    whole = SyntheticSource(gen, 96 * world_size).batch(4)
    parts = [SyntheticSource(gen.clone(), 96, r, world_size).batch(4) for r in range(world_size)]
    ranges = [SyntheticSource(gen, 96, r, world_size).sample_range(4) for r in range(world_size)]
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(world_size - 1))  # contiguous, no overlap
    np.testing.assert_array_equal(np.concatenate([p.dense_features for p in parts]), whole.dense_features)
    np.testing.assert_array_equal(np.concatenate([p.labels for p in parts]), whole.labels)
    for key in model.feature_names:
        joined = np.concatenate([p.sparse_features[key].values() for p in parts])
        np.testing.assert_array_equal(joined, whole.sparse_features[key].values())


def test_any_range_equals_the_same_samples_from_blocks():
    gen = synthetic_generator(dlrm_lab.load_preset("tiny"), seed=2)
    edge = gen.block_size
    a = gen.samples(edge - 100, edge + 100)  # crosses a block boundary
    b = gen.clone().samples(edge - 1000, edge + 5000).slice(900, 1100)
    np.testing.assert_array_equal(a.dense, b.dense)
    assert all(np.array_equal(x, y) for x, y in zip(a.values, b.values, strict=True))


def test_teacher_is_calibrated_to_the_click_rate():
    model = dlrm_lab.load_preset("kaggle", max_rows=10_000)
    gen = synthetic_generator(model, seed=0)
    labels = gen.samples(0, 245_760).labels
    assert labels.mean() == pytest.approx(gen.spec.click_rate, rel=0.1)  # 3% of 245k samples
    assert 0.75 < gen.teacher_auc < 1.0


def test_expected_auc_of_known_cases():
    assert expected_auc(np.array([0.5, 0.5, 0.5])) == pytest.approx(0.5)
    # two samples: p=0.9 and p=0.1; positive/negative pairs ranked right with weight 0.81
    assert expected_auc(np.array([0.9, 0.1])) == pytest.approx((0.9 * 0.9 + 0.5 * (0.9 * 0.1 + 0.1 * 0.9)) / 1.0)


def test_training_tiny_reaches_ninety_percent_of_the_teacher_auc():
    model = dlrm_lab.load_preset("tiny")
    result = train(preflight(model, TrainConfig(steps=120, batch_size=256, eval_batches=16, seed=1)))
    teacher = synthetic_generator(model, seed=1).teacher_auc
    assert teacher > 0.8
    assert result.summary["eval_auc"] >= 0.9 * teacher


SHARE_CASES = {  # (preset, data spec, overrides): every id law, pooling law, dense law and drift
    "kaggle criteo": ("kaggle", None, ()),
    "multi-hot uniform pooling": ("dcnv2", "criteo_multihot", ()),
    "production, gaussian dense": ("rm2", "production", ()),
    "uniform ids": ("tiny", "uniform", ()),
    "fixed pooling of 3": ("tiny", None, ('features.default.pooling={distribution="fixed", value=3}',)),
    "hot set, lognormal pooling, drift": (
        "tiny",
        None,
        (
            'features.default.ids={distribution="hot_set", hot_fraction=0.01, hot_mass=0.8}',
            'features.default.pooling={distribution="lognormal", mean=3, sigma=0.8, min=0, max=12}',
            "features.default.drift={every=700}",
        ),
    ),  # fmt: skip
    "reuse ids, normal pooling": (
        "tiny",
        None,
        (
            'features.default.ids={distribution="reuse", distances=[1, 3], probabilities=[0.3, 0.2]}',
            'features.default.pooling={distribution="normal", mean=2, std=1, min=0, max=5}',
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(SHARE_CASES))
def test_a_ranks_share_of_each_block_is_the_same_samples_as_the_whole_block(case):
    """A rank whose batch is smaller than a block generates only its share of each block (the
    restricted generator): the same samples, bit for bit, as slicing whole blocks, for every law."""
    preset, data_spec, overrides = SHARE_CASES[case]
    model = dlrm_lab.load_preset(preset, table_scale=0.001) if preset == "rm2" else dlrm_lab.load_preset(preset)
    gen = synthetic_generator(model, data_spec, overrides, seed=3)
    whole = gen.clone()
    for world in (2, 3):
        batch = max(1, gen.block_size // (4 * world)) + 5  # slices cross block edges
        for rank in range(world):
            source = SyntheticSource(gen, batch, rank, world, offset=17)
            assert source.generator._share is not None and gen._share is None  # a twin restricted, not gen
            for k in (0, 1, 2, 7, 8, 9):
                lo, hi = source.sample_range(k)
                got, want = source.generator.samples(lo, hi), whole.samples(lo, hi)
                assert got.start == want.start == lo
                np.testing.assert_array_equal(got.dense, want.dense)
                np.testing.assert_array_equal(got.labels, want.labels)
                np.testing.assert_array_equal(got.click_probability, want.click_probability)
                for a, b in zip(got.lengths + got.values, want.lengths + want.values, strict=True):
                    np.testing.assert_array_equal(a, b)
    # a range outside the share is still served (from a whole block)
    odd = SyntheticSource(gen, 64, 0, 2).generator
    np.testing.assert_array_equal(odd.samples(64, 100).dense, whole.samples(64, 100).dense)


def test_a_blocks_slices_share_offsets_summed_once_and_equal_the_samples_of_their_range():
    """A generated block is sliced batch by batch (`SampleBlock.slice`): its features' offsets are summed from their
    lengths on the first slice and kept, and every slice is the generator's samples of that range."""
    spec = dlrm_lab.load_preset("tiny")
    gen = synthetic_generator(spec, seed=5)
    block = gen.block(0)
    assert block.feature_offsets is None
    multi = [f for f, n in enumerate(block.lengths) if len(set(n.tolist())) > 1]
    assert multi, "the tiny preset has a feature of several pooling factors"
    for lo, hi in ((0, 7), (7, 300), (300, gen.block_size)):
        part = block.slice(lo, hi)
        want = synthetic_generator(spec, seed=5).block(0).slice(lo, hi)  # a fresh block: its offsets summed now
        for got, ref in zip(part.values, want.values, strict=True):
            np.testing.assert_array_equal(got, ref)
        for got, ref in zip(part.lengths, want.lengths, strict=True):
            np.testing.assert_array_equal(got, ref)
    kept = block.feature_offsets
    assert kept is not None and block.offsets() is kept
    for f in multi:
        np.testing.assert_array_equal(kept[f], np.concatenate(([0], np.cumsum(block.lengths[f]))))
