"""The time-ordered request generator for generative rankers (HSTU)."""

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from dlrm_lab.config.hstu import SequenceSpec
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
