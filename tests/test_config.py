"""Presets load, scale and validate; every mistake is one clear line."""

import math
from pathlib import Path

import numpy as np
import pytest

import dlrm_lab
from dlrm_lab.config import TrainConfig, available_presets, load_preset
from dlrm_lab.errors import UserError

PRESETS = ["tiny", "kaggle", "terabyte", "dcnv2", "rm1", "rm2", "rm3"]


def test_all_published_presets_are_shipped():
    assert set(PRESETS) <= set(available_presets())


def test_kaggle_matches_the_published_config():
    spec = load_preset("kaggle")
    assert spec.num_dense == 13 and len(spec.tables) == 26
    assert {t.embedding_dim for t in spec.tables} == {16}
    assert spec.bottom_mlp == (512, 256, 64, 16) and spec.top_mlp == (512, 256, 1)
    assert spec.tables[2].num_embeddings == 10131227
    # 13 dense -> 16, 26 features: 16 + 26 + 26*25/2 interaction outputs
    assert spec.over_arch_in_features == 16 + 26 + 325


def test_rm_presets_follow_deeprecsys():
    rm1, rm2, rm3 = (load_preset(n) for n in ("rm1", "rm2", "rm3"))
    assert (len(rm1.tables), rm1.tables[0].num_embeddings, rm1.tables[0].pooling_factor) == (8, 4_000_000, 80)
    assert (len(rm2.tables), rm2.tables[0].embedding_dim, rm2.tables[0].pooling_factor) == (32, 64, 120)
    assert rm3.num_dense == 2560 and rm3.bottom_mlp == (1024, 256, 32)
    assert {s.interaction for s in (rm1, rm2, rm3)} == {"cat"}


def test_dcnv2_has_multi_hot_pooling_and_low_rank_cross_layers():
    spec = load_preset("dcnv2")
    assert spec.dcn_num_layers == 3 and spec.dcn_low_rank == 512
    assert max(t.pooling_factor for t in spec.tables) == 100


def test_table_scale_and_max_rows():
    full = load_preset("kaggle")
    scaled = load_preset("kaggle", table_scale=0.01)
    capped = load_preset("kaggle", max_rows=1000)
    for f, s, c in zip(full.tables, scaled.tables, capped.tables, strict=True):
        assert s.num_embeddings == max(1, math.ceil(f.num_embeddings * 0.01))
        assert c.num_embeddings == min(f.num_embeddings, 1000)
    both = load_preset("kaggle", table_scale=0.5, max_rows=10)
    assert max(t.num_embeddings for t in both.tables) == 10
    assert both.table_scale == 0.5 and both.max_rows == 10


def test_parameter_count_matches_the_built_model():
    for name in PRESETS:
        spec = load_preset(name, max_rows=64)
        model = dlrm_lab.build_model(spec)
        assert sum(p.numel() for p in model.parameters()) == spec.num_parameters, name


def test_overrides_are_validated_like_the_file():
    spec = load_preset("tiny", interaction="cat", embedding_dim=[8, 4, 8, 2])
    assert [t.embedding_dim for t in spec.tables] == [8, 4, 8, 2]
    with pytest.raises(UserError, match="needs one embedding_dim"):
        load_preset("tiny", embedding_dim=[8, 4, 8, 2])


def test_spec_round_trips_through_its_dict():
    spec = load_preset("dcnv2", max_rows=100)
    assert dlrm_lab.ModelSpec.from_dict(spec.to_dict()) == spec


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "m.toml"
    path.write_text(text)
    return str(path)


GOOD = """
num_dense = 4
num_embeddings = [10, 20]
embedding_dim = 8
bottom_mlp = [16, 8]
top_mlp = [4, 1]
"""


@pytest.mark.parametrize(
    "change, message",
    [
        ({"embedding_dim": "[8, 4]"}, "needs one embedding_dim"),
        ({"bottom_mlp": "[16, 4]"}, "bottom_mlp ends at 4 but embedding_dim is 8"),
        ({"interaction": '"fm"'}, "interaction = 'fm': allowed: dot, cat, dcnv2"),
        ({"num_embeddings": "[10, -1]"}, "entry -1 must be an integer >= 1"),
        ({"num_embeddings": "[]"}, "non-empty list"),
        ({"num_dense": "0"}, "num_dense = 0: must be an integer >= 1"),
        ({"top_mlp": "[4, 2]"}, "must end at 1"),
        ({"pooling_factor": "[1, 2, 3]"}, "one entry per table (2), got 3"),
        ({"pooling_factor": "0"}, "must be a number > 0"),
        ({"interaction": '"dcnv2"'}, "missing required field 'dcn.num_layers'"),
        ({"colour": '"red"'}, "unknown field(s) colour"),
    ],
)
def test_bad_model_files_name_file_field_and_rule(tmp_path, change, message):
    lines = dict(line.split(" = ", 1) for line in GOOD.strip().splitlines())
    lines.update(change)
    path = write(tmp_path, "\n".join(f"{k} = {v}" for k, v in lines.items()))
    with pytest.raises(UserError) as err:
        load_preset(path)
    text = str(err.value)
    assert message in text and path in text and "\n" not in text


def test_missing_field_and_bad_toml(tmp_path):
    with pytest.raises(UserError, match="missing required field 'top_mlp'"):
        load_preset(write(tmp_path, GOOD.replace("top_mlp = [4, 1]", "")))
    with pytest.raises(UserError, match="invalid TOML"):
        load_preset(write(tmp_path, "num_dense = = 3"))


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(UserError) as err:
        load_preset("kagle")
    assert "unknown model preset 'kagle'" in str(err.value)
    assert "kaggle" in str(err.value) and "rm3" in str(err.value)


def test_bad_scaling_is_refused():
    with pytest.raises(UserError, match="table_scale"):
        load_preset("tiny", table_scale=0)
    with pytest.raises(UserError, match="max_rows"):
        load_preset("tiny", max_rows=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps": 0}, "--steps 0"),
        ({"batch_size": -2}, "--batch-size -2"),
        ({"precision": "fp8"}, "--precision 'fp8': allowed: auto, fp32, bf16"),
        ({"device": "tpu"}, "--device 'tpu'"),
        ({"dense_optimizer": "lamb"}, "--dense-optimizer 'lamb'"),
        ({"embedding_lr": 0.0}, "--embedding-lr 0.0"),
        ({"steps": 10, "warmup_steps": 10}, "--warmup-steps 10"),
    ],
)
def test_bad_train_options(kwargs, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs)


def test_warmup_is_detected_from_step_times():
    from dlrm_lab.train.records import detect_warmup

    rng = np.random.default_rng(0)
    steady = list(30 + rng.normal(0, 1, 60))  # 30 ms steps with +/- 1 ms noise
    assert detect_warmup([300, 90, 60, 45, 40, 34] + steady) == 6  # slow start until within 10% of steady
    assert detect_warmup([300] + steady) == 1  # the first step is always warm-up
    assert detect_warmup(steady[:4]) == 0  # too short to tell
    assert detect_warmup(list(range(110, 10, -1))) == 50  # still speeding up: at most half the run is warm-up
    assert detect_warmup([300] + [20.0] * 10 + [30.0] * 30) == 1  # faster than steady is not warm-up
