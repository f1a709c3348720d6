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
    spec = load_preset("tiny", interaction="cat", embedding_dim=[8, 4, 8, 12])
    assert [t.embedding_dim for t in spec.tables] == [8, 4, 8, 12]
    with pytest.raises(UserError, match="needs one embedding_dim"):
        load_preset("tiny", embedding_dim=[8, 4, 8, 12])


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
        ({"feature_names": '["a", "a"]'}, "feature_names = ['a', 'a']: names must be unique ('a' repeated)"),
        ({"embedding_dim": "[8, 0]"}, "table 't_cat_1': embedding_dim = 0: must be an integer >= 1"),
        ({"dcn": "{ num_layers = 2 }"}, "dcn_num_layers = 2, dcn_low_rank = 0: only for interaction 'dcnv2'"),
        ({"reference": "{ batch_size = 512 }"}, "[reference] needs both batch_size and dense_lr"),
        ({"reference": "{ batch_size = 0, dense_lr = 0.1 }"}, "reference.batch_size = 0: must be an integer >= 1"),
        ({"reference": "{ batch_size = 64, dense_lr = -1 }"}, "reference.dense_lr = -1: must be a number > 0"),
        ({"reference": "{ batch = 64, dense_lr = 0.1 }"}, "[reference] may hold only batch_size, dense_lr, source"),
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


def spec_dict(**changes) -> dict:
    """The tiny preset as `ModelSpec.to_dict` writes it (and the gRPC proxy reads it), changed."""
    data = load_preset("tiny").to_dict()
    for key, value in changes.items():
        if key.startswith("tables."):  # tables.1.num_embeddings=0
            _, i, field = key.split(".")
            data["tables"][int(i)][field] = value
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tables.1.num_embeddings": 0}, "table 't_cat_1': num_embeddings = 0: must be an integer >= 1"),
        ({"tables.2.pooling_factor": -1.0}, "table 't_cat_2': pooling_factor = -1.0: must be a number > 0"),
        ({"tables.1.embedding_dim": 4}, "interaction 'dot' needs one embedding_dim for all tables, got [4, 8]"),
        ({"bottom_mlp": [16, 4]}, "bottom_mlp ends at 4 but embedding_dim is 8; interaction 'dot' needs them equal"),
        ({"interaction": "fm"}, "interaction = 'fm': allowed: dot, cat, dcnv2"),
        (
            {"tables.2.feature_names": ["cat_0"]},
            "feature_names = ['cat_0', 'cat_1', 'cat_0', 'cat_3']: names must be unique",
        ),
        (
            {"tables.3.name": "t_cat_0"},
            "table_names = ['t_cat_0', 't_cat_1', 't_cat_2', 't_cat_0']: names must be unique",
        ),
        ({"interaction": "dcnv2"}, "dcn_num_layers = 0: interaction 'dcnv2' needs an integer >= 1"),
        ({"top_mlp": [16, 2]}, "top_mlp = [16, 2] must end at 1"),
        ({"num_dense": True}, "num_dense = True: must be an integer >= 1"),
        ({"max_rows": 0}, "max_rows = 0: must be an integer >= 1"),
        ({"colour": "red"}, "unknown field(s) colour"),
    ],
)
def test_spec_from_dict_checks_every_invariant(changes, message):
    data = spec_dict(**changes)
    with pytest.raises(UserError) as err:
        dlrm_lab.ModelSpec.from_dict(data)
    text = str(err.value)
    assert message in text and "\n" not in text
    assert text.startswith(data["source"] + ": ")  # names the preset the spec came from


def test_every_construction_path_is_checked():
    import dataclasses

    spec = load_preset("tiny")
    with pytest.raises(UserError, match="num_dense = 0: must be an integer >= 1"):
        dataclasses.replace(spec, num_dense=0)
    with pytest.raises(UserError, match=r"^table 't': num_embeddings = 0: must be an integer >= 1$"):
        dlrm_lab.TableSpec("t", num_embeddings=0, embedding_dim=8, feature_names=("a",))
    with pytest.raises(UserError, match=r"^model spec 'm': bottom_mlp ends at 4 but embedding_dim is 8"):
        dlrm_lab.ModelSpec("m", 4, (dlrm_lab.TableSpec("t", 10, 8, ("a",)),), bottom_mlp=(4,), top_mlp=(1,))
    with pytest.raises(UserError, match="missing required field 'embedding_dim'"):
        data = spec_dict()
        del data["tables"][0]["embedding_dim"]
        dlrm_lab.ModelSpec.from_dict(data)
    # lists are taken and stored as tuples, so a spec built from JSON-like values equals the loaded one
    table = dlrm_lab.TableSpec("t_cat_0", 100, 8, ["cat_0"], pooling_factor=1)
    assert table == spec.tables[0] and table.feature_names == ("cat_0",) and table.pooling_factor == 1.0
    rebuilt = dlrm_lab.ModelSpec(**{**spec_dict(), "tables": list(spec.tables)})
    assert rebuilt == spec and hash(rebuilt) == hash(spec)


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
        ({"steps": 0}, "steps 0"),
        ({"batch_size": -2}, "batch_size -2"),
        ({"precision": "fp8"}, "precision 'fp8': allowed: auto, fp32, bf16"),
        ({"device": "tpu"}, "device 'tpu'"),
        ({"dense_optimizer": "lamb"}, "dense_optimizer 'lamb'"),
        ({"embedding_lr": 0.0}, "embedding_lr 0.0"),
        ({"steps": 10, "warmup_steps": 10}, "warmup_steps 10"),
        ({"table_update": "fast"}, "table_update 'fast': allowed: auto, fbgemm, batched"),
        ({"distribution": "nccl"}, "distribution 'nccl': allowed: torchrec, lean"),
    ],
)
def test_bad_train_options(kwargs, message):
    """The config names its fields (the command line names them by flag: test_options)."""
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
