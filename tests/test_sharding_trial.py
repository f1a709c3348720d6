"""`--sharding auto`: candidate plans timed on the ranks, the fastest kept, the times cached per job shape."""

from types import SimpleNamespace

import pytest
import torch
from conftest import store_profile

from dlrm_lab.distributed.context import init_distributed
from dlrm_lab.errors import UserError
from dlrm_lab.train import sharding_trial as st


def _ctx(world_size=2, device="cpu", rank=0):
    return SimpleNamespace(world_size=world_size, device=torch.device(device), rank=rank, is_main=rank == 0)


def test_pick_takes_the_fastest_and_the_planner_on_a_tie():
    choice = st.pick({"planner": 12.0, "table_wise": 9.0, "row_wise": 15.0}, {"column_wise": "refused: x"}, "now")
    assert choice.sharding == "table_wise" and choice.step_ms["planner"] == 12.0
    assert "fastest of 3 plans" in choice.reason and "planner 12.0" in choice.reason
    assert choice.to_dict()["skipped"] == {"column_wise": "refused: x"}
    assert st.pick({"row_wise": 5.0, "planner": 5.0}, {}, "now").sharding == "planner"
    with pytest.raises(UserError, match="no sharding plan could be tried"):
        st.pick({}, {"planner": "refused: too big"}, "now")


def test_run_trials_times_each_distinct_plan_after_warm_up():
    calls: list[tuple[str, int]] = []
    signatures = {"planner": "A", "table_wise": "B", "row_wise": "A"}

    def build(candidate):
        if candidate == "data_parallel":
            raise UserError("do not fit [planner: 2.0 GiB needed]")
        return candidate, None, signatures.get(candidate, candidate)

    def step(model, optimizer, batch):
        calls.append((model, batch))

    batches = list(range(st.WARMUP_STEPS + st.TIMED_STEPS + 3))  # more than needed: only the first are used
    trials = st.run_trials(["planner", "table_wise", "row_wise", "data_parallel"], build, step, batches, 1)
    assert trials["planner"][0] == "timed" and len(trials["planner"][1]) == st.TIMED_STEPS
    assert trials["row_wise"] == ("same", "planner")  # not timed again
    assert trials["data_parallel"] == ("refused", "2.0 GiB needed")
    assert [b for m, b in calls if m == "planner"] == list(range(st.WARMUP_STEPS + st.TIMED_STEPS))
    assert {m for m, _ in calls} == {"planner", "table_wise"}
    step_ms, skipped = st.summarize_trials(trials)
    assert set(step_ms) == {"planner", "table_wise"}
    assert skipped == {"row_wise": "the same plan as planner", "data_parallel": "refused: 2.0 GiB needed"}


def test_choose_sharding_only_measures_auto_on_several_cpu_ranks():
    def never():
        raise AssertionError("nothing is timed here")

    asked = st.choose_sharding("row_wise", _ctx(), "k", never)
    assert asked.sharding == "row_wise" and "asked for" in asked.reason and asked.step_ms == {}
    assert st.choose_sharding("planner", _ctx(), "k", never).sharding == "planner"
    one = st.choose_sharding("auto", _ctx(world_size=1), "k", never)
    assert one.sharding == "planner" and "one rank" in one.reason
    gpu = st.choose_sharding("auto", _ctx(device="cuda"), "k", never)
    assert gpu.sharding == "planner" and "cuda" in gpu.reason


def test_auto_measures_once_then_reads_the_machine_profile(tmp_path, monkeypatch):
    init_distributed("cpu")  # a group of one: the broadcast of the cached entry is a no-op
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    store_profile(tmp_path)
    runs = []

    def trial():
        runs.append(1)
        return {"planner": ("timed", [20.0, 22.0, 21.0, 50.0]), "table_wise": ("timed", [15.0, 16.0, 14.0, 15.0])}

    first = st.choose_sharding("auto", _ctx(), "cpu/2r/kaggle", trial)
    assert first.sharding == "table_wise" and first.step_ms == {"planner": 21.5, "table_wise": 15.0}
    assert first.source.startswith("measured now") and "stored in" in first.source
    again = st.choose_sharding("auto", _ctx(), "cpu/2r/kaggle", trial)
    assert runs == [1] and again.sharding == "table_wise" and again.source.startswith("cached in")
    assert "cached" in again.line
    other_shape = st.choose_sharding("auto", _ctx(), "cpu/2r/rm2", trial)
    assert runs == [1, 1] and other_shape.sharding == "table_wise"


def test_the_trial_key_names_the_job_shape():
    from dlrm_lab import load_preset
    from dlrm_lab.config import TrainConfig

    spec = load_preset("tiny")
    cfg = TrainConfig(batch_size=64)
    key = st.trial_key(spec, torch.device("cpu"), 2, 2, cfg)
    assert "2r2l" in key and "b64" in key and key.startswith("cpu/") and "tiny-" in key
    assert key != st.trial_key(spec, torch.device("cpu"), 2, 2, TrainConfig(batch_size=128))
    assert key != st.trial_key(spec, torch.device("cpu"), 2, 2, cfg, backend="mpi4py")
    assert key != st.trial_key(load_preset("tiny", table_scale=0.5), torch.device("cpu"), 2, 2, cfg)
    for other in (TrainConfig(batch_size=64, pipeline=True), TrainConfig(batch_size=64, dense_optimizer="sgd"),
                  TrainConfig(batch_size=64, table_update="batched")):  # fmt: skip
        assert key != st.trial_key(spec, torch.device("cpu"), 2, 2, other)


def test_a_new_probe_keeps_the_measured_sharding_trials(tmp_path, monkeypatch):
    from dlrm_lab.metrics.roofline import load_profile, save_profile

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    profile = store_profile(tmp_path)
    st.store_trials("cpu/2r/kaggle", {"table_wise": 15.0}, {})
    save_profile({**profile, "comms": {}})  # as `machine probe` writes a fresh profile
    assert load_profile()["sharding_trials"]["cpu/2r/kaggle"]["step_ms"] == {"table_wise": 15.0}
