"""Serving the HSTU ranker (issue 17, part 4): requests as samples of a time-ordered library, one
score per candidate, history reuse, and a LoadGen run in time order."""

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import run_cli_in_process

from dlrm_lab.config import load_any_preset
from dlrm_lab.data.sequences import SequenceGenerator, with_overrides
from dlrm_lab.errors import UserError
from dlrm_lab.infer.history import HistoryCache, reuse_accuracy, score_requests
from dlrm_lab.infer.requests import SERVED_WINDOW, RequestLibrary
from dlrm_lab.model.hstu import build_ranker, prefix_attention, valid_attention

# histories that outgrow max_history lose their oldest items, and a cached prefix with them:
# the served window's histories (~150 items) fit in 256
SETS = ("max_history=256",)


@pytest.fixture(scope="module")
def spec():
    return with_overrides(load_any_preset("hstu-tiny"), list(SETS))


@pytest.fixture(scope="module")
def library(spec):
    return RequestLibrary.generate(spec, 0, 100_000)


@pytest.fixture(scope="module")
def model(spec):
    torch.manual_seed(0)
    return build_ranker(spec).eval()


def test_the_library_is_the_eval_window_in_time_order_and_gathers_what_the_generator_made(spec, library):
    gen = SequenceGenerator(spec.data, 0)
    assert library.size == gen.num_requests(SERVED_WINDOW)  # capped at the window: no wrap to short histories
    assert np.all(np.diff(library.step) >= 0)
    want = gen.requests(30, 33, SERVED_WINDOW)
    got = library.gather(np.array([2, 1]), np.array([30, 32]))
    for name in ("user", "history_lengths", "history_items", "history_actions", "candidate_items", "labels"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert np.array_equal(library.output_counts(30, 3), [spec.data.candidates] * 3)
    library.load([(0, 5)])
    assert library.loaded == 5
    library.unload([(0, 5)])


def test_new_tokens_see_the_prefix_and_follow_the_request_mask_after_it():
    # a request of user + 4 history tokens + 2 candidates, the first 3 tokens encoded before
    full = valid_attention(torch.tensor([7]), torch.tensor([2]), 7)[0]
    mask = prefix_attention(torch.tensor([3]), torch.tensor([4]), torch.tensor([5]))[0]
    assert torch.equal(mask, full[3:])  # the new rows of the whole request's mask
    # a miss (prefix 0) is the whole mask; padding rows and columns see nothing
    both = prefix_attention(torch.tensor([0, 3]), torch.tensor([7, 4]), torch.tensor([5, 5]))
    assert torch.equal(both[0, :, 3:], full) and not both[1, 4:].any() and not both[1, :, 3 + 4 :].any()


def test_a_history_encoded_by_the_same_request_gives_exactly_the_full_scores(model, library):
    block = library.block(0, 12)
    cache = HistoryCache(max_bytes=10**8)
    with torch.inference_mode():
        full, none = score_requests(model, block, None)
        first, misses = score_requests(model, block, cache)
        again, reused = score_requests(model, block, cache)  # every history cached: candidates encoded alone
    assert not none.any() and not misses.any()
    assert np.array_equal(reused, block.history_lengths)
    assert torch.allclose(first, full, atol=1e-6) and torch.allclose(again, full, atol=1e-5)
    assert (cache.hits, cache.misses) == (12, 12)


def test_reuse_across_a_users_requests_hits_and_costs_little(model, library):
    got = reuse_accuracy(model, library, batch=64)
    # every user's first request in the window misses, later ones hit (their histories only grew)
    first = len(np.unique(library.user))
    assert got["hit_rate"] == pytest.approx(1 - first / library.size, abs=0.02)
    assert 0.5 < got["reused_history_share"] < 1
    # stale positions and ages of the reused tokens change scores a little, not the ranking
    assert 0 < got["max_score_difference"] < 0.05
    assert got["auc_reused"] == pytest.approx(got["auc_full"], abs=0.01)


def test_the_cache_keeps_to_its_bytes_and_drops_a_history_that_changed(model, library):
    block = library.block(0, 20)
    one = HistoryCache(max_bytes=10**9)
    with torch.inference_mode():
        score_requests(model, library.block(0, 1), one)
    per_user = one.bytes
    cache = HistoryCache(max_bytes=int(per_user * 5.5))
    with torch.inference_mode():
        score_requests(model, block, cache)
    assert len(cache.entries) <= 6 and cache.bytes <= cache.max_bytes and cache.evictions >= 14
    user = int(block.user[-1])
    items = cache.entries[user].items
    assert cache.prefix(user, items[1:]) is None  # the oldest item gone (max_history): not a prefix
    assert cache.prefix(user, np.concatenate([items, [7]])) is not None


def test_the_server_scores_each_candidate_of_a_request_as_the_model_does(spec, library):
    from dlrm_lab.infer.plan import plan_serving
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.server import InferenceServer
    from dlrm_lab.infer.sut import Query

    served = ServedModel("r", spec, max_batch=8, attention="padded", precision="fp32", library_samples=64)
    done = {}
    with InferenceServer(plan_serving([served]), pin_cores=False) as server:
        for k, (size, offset) in enumerate(((3, 0), (1, 10), (20, 30))):  # 20 > max batch: split in pieces
            server.submit(Query(k, "r", size, offset, on_done=lambda q, status, s: done.update({q.query_id: s})))
        assert server.drain(60)
        rows = server.take_records()
        assert server.library("r").size == 64
    torch.manual_seed(0)
    model = build_ranker(spec, attention="padded").eval()
    assert {r["status"] for r in rows} == {"ok"} and max(r["pieces"] for r in rows) >= 3
    with torch.inference_mode():
        for k, (size, offset) in enumerate(((3, 0), (1, 10), (20, 30))):
            want = torch.sigmoid(score_requests(model, library.block(offset, size), None)[0]).numpy()
            assert done[k].shape == (size * spec.data.candidates,)
            # scores depend slightly on the batch (the normaliser is the batch's longest request)
            assert np.abs(done[k] - want).max() < 0.02


def test_history_affinity_sends_a_users_requests_to_the_instance_holding_their_history(spec, library):
    from dlrm_lab.infer.batching import take_batch
    from dlrm_lab.infer.pools import Pool
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.sut import Query

    pool = Pool(served=ServedModel("r", spec, instances=2, history_cache_mb=8), library=library)
    pool.homes = [3, 4]  # this model's instances
    for k in range(12):
        q = Query(k, "r", 1, k)
        q.home = pool.homes[int(library.user[k]) % 2]
        pool.waiting.append(q)
        pool.waiting_samples += 1
    homes = [q.home for q in pool.waiting]
    batch = take_batch(pool, 3, 4)
    assert [q.query_id for q, _, _ in batch] == [k for k, h in enumerate(homes) if h == 4][:3]  # its own, oldest first
    assert pool.waiting_samples == 9 == len(pool.waiting)
    while any(q.home == 3 for q in pool.waiting):
        assert all(q.home == 3 for q, _, _ in take_batch(pool, 4, 3))
    rest = list(pool.waiting)  # none of instance 3's own left: it takes the head rather than idle
    assert [q for q, _, _ in take_batch(pool, 2, 3)] == rest[:2]


def test_loadgen_server_issues_requests_in_time_order_and_history_reuse_is_recorded(tmp_path):
    pytest.importorskip("mlperf_loadgen")
    code, out, err = run_cli_in_process(
        "infer", "run", "--model", "hstu-tiny", "--set", SETS[0], "--scenario", "server", "--order", "time",
        "--history-cache-mb", "16", "--qps", "170", "--duration", "3", "--warmup", "0", "--sla-ms", "400",
        "--attention", "jagged", "--precision", "fp32", "--max-batch", "64", "--no-pin-cores",
        "--metrics-dir", str(tmp_path), "--no-progress",
    )  # fmt: skip
    (run,) = tmp_path.glob("infer-*")
    (row,) = pq.read_table(run / "summary.parquet").to_pylist()
    # What is tested is the order LoadGen's queries are served in, not this machine's tail beside another test worker:
    # the bound is wide (400 ms), yet a host at a seventh of its speed misses it (CI, 2026-11-30), so the verdict is
    # only held to the exit code. A max batch of 64 requests is beyond what this load fills: builds are timed at it
    assert code == (0 if row["loadgen_result"] == "VALID" else 1), err
    assert code == 0 or "verdict is INVALID for hstu-tiny" in err
    assert row["completed_queries"] == row["queries"] > 460
    assert row["attention"] == "jagged" and row["history_cache_mb"] == 16
    # in time order each user's next request finds the history it grew from
    assert 0.3 < row["history_hit_rate"] < 1 and row["history_tokens_reused_mean"] > 10
    queries = pq.read_table(run / "queries.parquet", columns=["history_reused", "samples"]).to_pandas()
    assert queries["history_reused"].sum() == pytest.approx(row["history_hit_rate"] * queries["samples"].sum())


def test_hstu_serving_options_are_refused_in_one_line(spec):
    from dlrm_lab.infer.options import ServingOptions
    from dlrm_lab.infer.served import ServedModel

    with pytest.raises(UserError, match="tables are fp32"):
        ServedModel("r", spec, table_precision="int8")
    with pytest.raises(UserError, match="data_overrides KEY=VALUE"):
        ServedModel("r", spec, data_spec="kaggle")
    with pytest.raises(UserError, match="history reuse is for HSTU"):
        ServingOptions(history_cache_mb=8).served(["tiny"])
    with pytest.raises(UserError, match="data_overrides changes an HSTU preset"):
        ServingOptions(data_overrides=("candidates=4",)).served(["tiny"])
    code, _, err = run_cli_in_process("serve", "--model", "hstu-tiny", "--port", "0")
    assert code != 0 and "served in process only" in err and "Traceback" not in err
