"""Data specs: every shipped spec resolves; impossible parameters are one clear line."""

from pathlib import Path

import pytest

import dlrm_lab
from dlrm_lab.data.spec import available_data_specs, load_data_spec
from dlrm_lab.errors import UserError

PRESETS = ["tiny", "kaggle", "terabyte", "dcnv2", "rm1", "rm2", "rm3"]


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_names_a_shipped_spec_that_resolves(preset):
    model = dlrm_lab.load_preset(preset, max_rows=1000)
    assert model.data_spec in available_data_specs()
    spec = load_data_spec(model.data_spec, model)
    assert spec.feature_names == model.feature_names
    assert [f.rows for f in spec.features] == [t.num_embeddings for t in model.tables]


def test_model_pooling_becomes_the_fixed_multi_hot_size():
    model = dlrm_lab.load_preset("dcnv2", max_rows=1000)
    spec = load_data_spec("criteo_multihot", model)
    assert [f.pooling["value"] for f in spec.features] == [round(t.pooling_factor) for t in model.tables]


def test_set_overrides_one_feature_and_top_level_fields():
    model = dlrm_lab.load_preset("tiny")
    spec = load_data_spec(
        "tiny", model, ["features.cat_2.ids.alpha=1.7", "click_rate=0.1", 'features.cat_0.ids={distribution="uniform"}']
    )
    by = {f.name: f for f in spec.features}
    assert by["cat_2"].ids == {"distribution": "zipf", "alpha": 1.7}
    assert by["cat_0"].ids == {"distribution": "uniform"}
    assert by["cat_3"].ids == {"distribution": "zipf", "alpha": 1.1}  # default untouched
    assert spec.click_rate == 0.1 and spec.overrides[1] == "click_rate=0.1"


BASE = """
click_rate = 0.2
[features.default]
ids = { distribution = "zipf", alpha = 1.0 }
pooling = { distribution = "uniform", min = 1, max = 3 }
"""


def write(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "spec.toml"
    path.write_text(BASE + extra)
    return str(path)


@pytest.mark.parametrize(
    "extra, message",
    [
        ('[features.cat_1]\nids = { distribution = "zipf", alpha = 0 }', "features.cat_1.ids.alpha = 0"),
        ('[features.cat_1]\nids = { distribution = "zipf", alpha = -1.5 }', "must be a number in (0"),
        (
            '[features.cat_2]\npooling = { distribution = "uniform", min = 5, max = 2 }',
            "min = 5: must not exceed max = 2",
        ),
        ('[features.cat_0]\nids = { distribution = "hot_set", hot_fraction = 0, hot_mass = 0.5 }', "hot_fraction = 0"),
        ('[features.cat_0]\nids = { distribution = "hot_set", hot_fraction = 0.1, hot_mass = 1.5 }', "hot_mass = 1.5"),
        (
            '[features.cat_0]\nids = { distribution = "reuse", distances = [1, 2], probabilities = [0.7, 0.6] }',
            "must sum to at most 1",
        ),
        ('[features.cat_0]\nids = { distribution = "pareto" }', "ids.distribution = 'pareto': allowed: uniform, zipf"),
        ('[features.cat_0]\nids = { distribution = "zipf" }', "missing parameter(s) alpha for zipf"),
        ('[features.cat_0]\nids = { distribution = "zipf", alpha = 1, beta = 2 }', "unknown parameter(s) beta"),
        ('[features.cat_9]\nids = { distribution = "uniform" }', "[features.cat_9]: model tiny has no such feature"),
        ("[features.cat_0]\ncolour = 1", "unknown key(s) colour"),
        ('[features.cat_0]\npooling = { distribution = "normal", mean = 3, std = -1 }', "pooling.std = -1"),
        ("[features.cat_0]\ndrift = { every = 0 }", "drift.every = 0: must be an integer >= 1"),
        ('[dense]\ndistribution = "poisson"', "dense.distribution = 'poisson'"),
    ],
)
def test_impossible_specs_are_refused_naming_file_and_field(tmp_path, extra, message):
    path = write(tmp_path, extra)
    with pytest.raises(UserError) as err:
        load_data_spec(path, dlrm_lab.load_preset("tiny"))
    text = str(err.value)
    assert message in text and path in text and "\n" not in text


def test_click_rate_and_bad_set_syntax(tmp_path):
    model = dlrm_lab.load_preset("tiny")
    with pytest.raises(UserError, match=r"click_rate = 1.5: must be a number in \(0, 1\)"):
        load_data_spec(write(tmp_path, ""), model, ["click_rate=1.5"])
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_data_spec("tiny", model, ["click_rate"])
    with pytest.raises(UserError, match="unknown data spec 'nope'; available: criteo"):
        load_data_spec("nope", model)
