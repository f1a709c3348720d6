"""The time-ordered request generator for generative rankers (HSTU)."""

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from dlrm_lab.config.sequence_spec import SequenceSpec
from dlrm_lab.data.sequences import LIKE_RATING, SequenceGenerator
from dlrm_lab.errors import UserError

SPEC = SequenceSpec(
    users=300, items=6000, categories=12, timestamps=30, train_timestamps=25, warmup_timestamps=4,
    interactions_mean=6, interactions_sd=2, candidates=10, max_history=48,
)  # fmt: skip


@pytest.fixture(scope="module")
def gen():
    return SequenceGenerator(SPEC, seed=7)


def test_any_slice_of_the_stream_is_the_same_requests(gen):
    whole = gen.requests(0, 400)
    a, b = gen.requests(0, 150), gen.requests(150, 400)
    for field in ("user", "step", "history_lengths", "candidate_items", "labels"):
        assert np.array_equal(np.concatenate([getattr(a, field), getattr(b, field)]), getattr(whole, field))
    assert np.array_equal(np.concatenate([a.history_items, b.history_items]), whole.history_items)
    again = SequenceGenerator(SPEC, seed=7).requests(150, 400)
    assert np.array_equal(again.history_actions, b.history_actions)
    other = SequenceGenerator(SPEC, seed=8).requests(150, 400)
    assert not np.array_equal(other.candidate_items, b.candidate_items)
    # past the window's end the stream wraps (epochs)
    n = gen.num_requests("train")
    assert n == (SPEC.train_timestamps - SPEC.warmup_timestamps) * SPEC.active_users
    assert np.array_equal(gen.requests(n, n + 5).user, gen.requests(0, 5).user)


def _spans(block):
    h = np.concatenate([[0], np.cumsum(block.history_lengths)])
    c = np.concatenate([[0], np.cumsum(block.candidate_lengths)])
    return h, c


def test_histories_grow_with_what_the_user_met_at_earlier_requests(gen):
    block = gen.requests(0, gen.num_requests("train"))
    assert np.all(np.diff(block.step) >= 0)  # time order
    h, c = _spans(block)
    checked = 0
    for user in np.unique(block.user)[:40]:
        idx = np.nonzero(block.user == user)[0]
        for i, j in zip(idx, idx[1:], strict=False):
            if block.step[j] != block.step[i] + 1 or block.history_lengths[j] >= SPEC.max_history:
                continue
            before = block.history_items[h[i] : h[i + 1]]
            after = block.history_items[h[j] : h[j + 1]]
            met = len(after) - len(before)  # what the user met at request i's step: its leading candidates
            assert 1 <= met <= SPEC.candidates
            assert np.array_equal(after[: len(before)], before)
            assert np.array_equal(after[len(before) :], block.candidate_items[c[i] : c[i] + met])
            # the history remembers whether the user liked them: the candidates' labels
            liked = (block.history_actions[h[j] + len(before) : h[j + 1]] >> 1) & 1
            assert np.array_equal(liked, block.labels[c[i] : c[i] + met].astype(np.uint8))
            checked += 1
    assert checked >= 10
    assert block.history_lengths.max() == SPEC.max_history  # the newest are kept
    ages = block.history_ages_s[h[-2] : h[-1]]
    assert np.all(np.diff(ages) <= 0) and ages.min() >= SPEC.timestamp_s  # oldest first, all before the request


def test_evaluation_is_a_later_window(gen):
    train = gen.requests(0, gen.num_requests("train"))
    held = gen.requests(0, gen.num_requests("eval"), "eval")
    assert train.step.max() < SPEC.train_timestamps <= held.step.min()
    assert held.step.max() == SPEC.timestamps - 1 and held.history_lengths.mean() > train.history_lengths.mean()


def test_popularity_interests_and_drift(gen):
    block = gen.requests(0, 2000)
    ranks = block.candidate_items // SPEC.categories
    assert np.mean(ranks < 10) > 0.25  # Zipf: the first 10 of 500 ranks take a large share
    interests = gen.user_interests(np.repeat(block.user, SPEC.candidates))
    in_interest = (interests == block.candidate_categories[:, None]).any(axis=1).mean()
    assert in_interest == pytest.approx(SPEC.interest_share + (1 - SPEC.interest_share) * 4 / 12, abs=0.03)
    users, cats = np.arange(50), np.zeros(50, dtype=np.int64)
    assert not np.allclose(gen.affinity(users, cats, np.zeros(50)), gen.affinity(users, cats, np.full(50, 7.0)))


def test_the_teacher_is_calibrated_and_its_auc_is_the_best_reachable(gen):
    block = gen.requests(0, gen.num_requests("eval"), "eval")
    assert block.labels.mean() == pytest.approx(block.click_probability.mean(), abs=0.02)
    teacher = gen.teacher
    assert 0.7 < teacher["teacher_auc"] < 0.99
    auc = float(binary_auroc(torch.from_numpy(block.click_probability), torch.from_numpy(block.labels).long()))
    assert auc == pytest.approx(teacher["teacher_auc"], abs=0.02)
    assert gen.describe()["spec"]["items"] == SPEC.items and LIKE_RATING == 3.5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"users": 0}, "users = 0: an integer >= 1"),
        ({"train_timestamps": 30}, "train_timestamps = 30: below timestamps (30)"),
        ({"active_share": 1.5}, "active_share = 1.5: in (0, 1]"),
        ({"interests": 20}, "interests = 20: at most the categories (12)"),
    ],
)
def test_bad_spec_values_are_named(change, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        SequenceSpec(**{**SPEC.to_dict(), **change}).check()
    with pytest.raises(UserError, match="unknown key 'user'"):
        SequenceSpec.from_dict({"user": 3})


def test_requests_to_parquet_and_back_checked_against_the_spec(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import run_cli_in_process

    from dlrm_lab.data.request_files import write_requests
    from dlrm_lab.data.stats import dataset_problems, dataset_stats

    gen = SequenceGenerator(SPEC, seed=7)
    out = tmp_path / "req"
    info = write_requests(gen, out, requests=500, shards=2)
    assert info["rows"] == 500 and [f["rows"] for f in info["files"]] == [250, 250]
    table = pq.read_table(out)
    block = gen.requests(0, 500)
    assert table["user"].to_pylist() == block.user.tolist()
    assert [len(x) for x in table["history_items"].to_pylist()] == block.history_lengths.tolist()
    result = dataset_stats(out)
    assert result["kind"] == "requests" and not result["problems"] and result["samples"] == 500
    assert all(c.ok for c in result["checks"]) and len(result["checks"]) == 4
    assert result["quantities"]["candidates mean"] == SPEC.candidates
    code, text, _ = run_cli_in_process("data", "stats", str(out), "--strict")
    assert code == 0 and "HSTU requests" in text and "4 of 4 checks" in text
    # files that are not what the stored spec and seed produce: the replay check says so
    labels = table["labels"].to_pylist()
    labels[0] = [1.0 - v for v in labels[0]]  # the first request is among those replayed
    tampered = table.set_column(
        table.schema.get_field_index("labels"), "labels", pa.array(labels, pa.list_(pa.float32()))
    )
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(tampered, bad / "part-00000.parquet")
    (bad / "_dataset.json").write_text(json.dumps({**info, "shards": 1}))
    result = dataset_stats(bad)
    replay = next(c for c in result["checks"] if c.quantity == "regenerated from spec and seed")
    assert not replay.ok
    # a structural problem: one line naming the column, exit 1
    items = table["candidate_items"].to_pylist()
    items[0][0] = SPEC.items + 5
    broken = table.set_column(table.schema.get_field_index("candidate_items"), "candidate_items",
                              pa.array(items, pa.list_(pa.int64())))  # fmt: skip
    pq.write_table(broken, bad / "part-00000.parquet")
    assert dataset_problems(bad) == [f"{bad}: candidate_items: ids 0..{SPEC.items + 5} outside the table's 0..5999"]
    code, _, err = run_cli_in_process("data", "stats", str(bad))
    assert code == 1 and "candidate_items" in err
    with pytest.raises(UserError, match="^rows 99999: must be 1 .. the train window's"):
        write_requests(gen, tmp_path / "x", requests=99_999)
    code, _, err = run_cli_in_process("data", "gen", "--preset", "hstu-tiny", "--out", str(tmp_path / "t"),
                                      "--format", "criteo-tsv")  # fmt: skip
    assert code == 2 and "HSTU requests are written as parquet only" in err


def test_what_each_part_of_the_rating_is_worth(gen):
    """The teacher reports the AUC of rankings by parts of the rating, so a model's AUC can be placed between
    "knows the items" and "knows the user's drifting taste"; each part adds, none beats the teacher."""
    from dlrm_lab.data.sequences import scored_auc
    from dlrm_lab.data.synthetic import expected_auc

    p = np.linspace(0.01, 0.99, 99)
    assert scored_auc(p, p) == pytest.approx(expected_auc(p)) and scored_auc(-p, p) < 0.5
    signals = gen.teacher["signal_auc"]
    assert 0.5 < signals["item"] < signals["item + affinity without drift"] < gen.teacher["teacher_auc"]
