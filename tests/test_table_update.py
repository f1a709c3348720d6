"""The batched table update (train.table_update) applies fbgemm's exact update, and the run chooses it by timing."""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    OptimType,
    SparseType,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from dlrm_lab.model import native
from dlrm_lab.train.table_update import (
    BatchedTableUpdate,
    _gradient_rows,
    choose_table_update,
    install,
    time_paths,
    unsupported,
)


def _pair(optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, pooling=PoolingMode.SUM, rows=(50, 30, 7), dim=8,
          feature_table_map=None, **kw):  # fmt: skip
    specs = [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows]
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        made.append(SplitTableBatchedEmbeddingBagsCodegen(
            specs, optimizer=optimizer, learning_rate=0.1, eps=1e-6, pooling_mode=pooling,
            feature_table_map=feature_table_map, **kw))  # fmt: skip
    assert torch.equal(made[0].weights_host, made[1].weights_host)
    return made


def _batch(rows, feature_table_map, batch=6, seed=1, weighted=False, bag=None):
    """Bags of 0-3 ids, or of `bag` ids each (every bag alike: the update's fixed-width path)."""
    g = torch.Generator().manual_seed(seed)
    ids, lengths = [], []
    for t in feature_table_map:
        for _ in range(batch):
            n = int(torch.randint(0, 4, (1,), generator=g)) if bag is None else bag  # empty bags too
            lengths.append(n)
            # repeats within the batch: the update sums them
            ids.append(torch.randint(0, min(rows[t], 5), (n,), generator=g))
    indices = torch.cat(ids)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    weights = torch.rand(len(indices), generator=g) if weighted else None
    return indices, offsets, weights


def _state(tbe):
    return tbe.weights_host.clone(), tbe.momentum1_host.clone() if tbe.momentum1_host.numel() else None


@pytest.mark.parametrize(
    "optimizer,pooling,weighted,shared,bag",
    [
        (OptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, False, False, None),
        (OptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.MEAN, False, True, None),  # two features read one table
        (OptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, True, False, None),  # per-id weights
        (OptimType.EXACT_SGD, PoolingMode.SUM, False, True, None),
        (OptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.NONE, False, False, None),  # sequence tables
        (OptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, False, True, 1),  # one id a bag (Criteo)
        (OptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.MEAN, True, False, 3),  # every bag of 3, weighted
        (OptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.MEAN, True, False, None),
        (OptimType.EXACT_SGD, PoolingMode.MEAN, False, True, 2),
    ],
)
@pytest.mark.parametrize("rows_kernel", [True, False], ids=["the lab's row kernel", "torch's ops"])
def test_batched_update_matches_fbgemm(optimizer, pooling, weighted, shared, bag, rows_kernel, monkeypatch):
    """Both ways of the batched update (the lab's kernel over the distinct rows, `model.native`, where it builds;
    torch's ops where it does not) apply fbgemm's update; the kernel's op is seen running, not assumed."""
    rows = (50, 30, 7)
    feature_table_map = [0, 1, 1, 2] if shared else [0, 1, 2]
    fbgemm, batched = _pair(optimizer, pooling, rows, feature_table_map=feature_table_map)
    install(torch.nn.ModuleList([batched]), "batched")
    assert type(batched) is BatchedTableUpdate and type(fbgemm) is SplitTableBatchedEmbeddingBagsCodegen
    if rows_kernel:
        assert native.load() is None, native.load()  # CI builds it
    else:
        monkeypatch.setattr(native, "load", lambda: "the lab's C++ kernels did not build: no compiler")
    before = _state(fbgemm)
    for step in range(3):  # the state carries over steps
        indices, offsets, weights = _batch(rows, feature_table_map, seed=step, weighted=weighted, bag=bag)
        outs = [m(indices, offsets, weights) for m in (fbgemm, batched)]
        torch.testing.assert_close(outs[0], outs[1])  # the same forward
        grad = torch.randn_like(outs[0])
        outs[0].backward(grad)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs[1].backward(grad)
        ran = {e.name for e in prof.events()}
        # bags all one length take one call from the offsets (mean-pooled too); ragged ones, tried there first, the
        # grouping and the pass in one call unscaled and the two ops scaled; weighted ids, the two ops
        ops = {name: f"dlrm_lab::{name}" for name in ("group_and_update_bags", "group_and_update", "group_rows")}
        kernels = (
            {"dlrm_lab::group_rows", "dlrm_lab::rowwise_update"} if weights is not None
            else {ops["group_and_update"]} if pooling == PoolingMode.NONE
            else {ops["group_and_update_bags"]} if bag is not None
            else {ops["group_and_update_bags"], ops["group_rows"], "dlrm_lab::rowwise_update"}
            if pooling == PoolingMode.MEAN
            else {ops["group_and_update_bags"], ops["group_and_update"]}
        )  # fmt: skip
        assert (kernels <= ran) == rows_kernel and not ({ops["group_and_update"], ops["group_rows"]} <= ran)
        if bag is not None and weights is None:
            assert not {ops["group_and_update"], ops["group_rows"]} & ran  # the bags' call alone
    after_fbgemm, after_batched = _state(fbgemm), _state(batched)
    assert (after_fbgemm[0] - before[0]).abs().max() > 1e-3  # rows moved
    torch.testing.assert_close(after_batched[0], after_fbgemm[0], rtol=1e-5, atol=1e-6)
    if optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
        assert (after_fbgemm[1] > 0).any()
        torch.testing.assert_close(after_batched[1], after_fbgemm[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("pooling,bag", [(PoolingMode.SUM, 1), (PoolingMode.MEAN, None)])
def test_a_gradient_sliced_from_the_interactions_is_read_in_place_and_updates_as_fbgemm(pooling, bag):
    """In a model the lookup's gradient is a column slice of the interaction's (its dense output first): the
    update reads it as rows of the wider tensor, no copy, and applies fbgemm's update all the same."""
    rows, feature_table_map, dim = (50, 30, 7), [0, 1, 2], 8
    fbgemm, batched = _pair(pooling=pooling, rows=rows, feature_table_map=feature_table_map, dim=dim)
    install(torch.nn.ModuleList([batched]), "batched")
    for step in range(3):
        indices, offsets, weights = _batch(rows, feature_table_map, seed=step, bag=bag)
        outs = [m(indices, offsets, weights) for m in (fbgemm, batched)]
        wide = torch.randn(len(outs[0]), dim + outs[0].size(1))
        for out in outs:
            torch.cat((torch.zeros(len(out), dim), out), dim=1).backward(wide)  # out's gradient: wide[:, dim:]
    torch.testing.assert_close(batched.weights_host, fbgemm.weights_host, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batched.momentum1_host, fbgemm.momentum1_host, rtol=1e-5, atol=1e-7)
    sliced = wide[:, dim:]
    found, per_sample = _gradient_rows(sliced, dim, len(feature_table_map), pooled=True)
    assert not sliced.is_contiguous() and found.data_ptr() == sliced.data_ptr() and per_sample == 4  # not copied
    for b in range(len(sliced)):
        for f in range(len(feature_table_map)):
            assert torch.equal(found[b * per_sample + f], sliced[b, f * dim : (f + 1) * dim])


def test_learning_rate_changes_reach_the_batched_update():
    fbgemm, batched = _pair(OptimType.EXACT_SGD)
    install(torch.nn.ModuleList([batched]), "batched")
    for m in (fbgemm, batched):
        m.set_learning_rate(0.5)
    indices, offsets, _ = _batch((50, 30, 7), [0, 1, 2])
    grad = None
    for m in (fbgemm, batched):
        out = m(indices, offsets)
        grad = torch.ones_like(out) if grad is None else grad
        out.backward(grad)
    torch.testing.assert_close(batched.weights_host, fbgemm.weights_host)


def test_what_the_batched_update_leaves_to_fbgemm():
    assert unsupported(torch.nn.Linear(2, 2)).startswith("Linear is not")
    (adam, _) = _pair(OptimType.EXACT_ADAGRAD)
    assert "EXACT_ADAGRAD" in unsupported(adam)
    (fp16, _) = _pair(weights_precision=SparseType.FP16)
    assert "float16" in unsupported(fp16)
    specs = [(10, 8, EmbeddingLocation.HOST, ComputeDevice.CPU), (10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)]
    mixed = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=OptimType.EXACT_ROWWISE_ADAGRAD)
    assert unsupported(mixed) == "its tables have different widths"
    # a group it cannot take stays fbgemm's, asked or not
    model = torch.nn.ModuleList([mixed])
    install(model, "batched")
    assert type(mixed) is SplitTableBatchedEmbeddingBagsCodegen
    choice = choose_table_update("batched", model, lambda: None)
    assert choice.path == "fbgemm" and "different widths" in choice.reason


def test_auto_times_both_paths_and_leaves_the_model_unchanged():
    rows = (2000, 3000, 500)
    fbgemm, batched = _pair(rows=rows, dim=16)
    indices, offsets, _ = _batch(rows, [0, 1, 2], batch=64)
    model = torch.nn.ModuleList([batched])
    before = _state(batched)
    choice = choose_table_update("auto", model, lambda: batched(indices, offsets))
    after = _state(batched)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert set(choice.backward_ms) == {"fbgemm", "batched"} and all(v > 0 for v in choice.backward_ms.values())
    assert choice.path in ("fbgemm", "batched") and "first batch" in choice.reason
    assert type(batched) is (BatchedTableUpdate if choice.path == "batched" else SplitTableBatchedEmbeddingBagsCodegen)
    assert choice.to_dict()["table_update"] == choice.path
    # asked outright: no timing, the reason says who asked
    fixed = choose_table_update("fbgemm", model, lambda: None)
    assert fixed.path == "fbgemm" and fixed.reason == "--table-update fbgemm" and not fixed.backward_ms
    assert type(batched) is SplitTableBatchedEmbeddingBagsCodegen
    assert time_paths([(batched, (indices, offsets, None))], repeats=1).keys() == {"fbgemm", "batched"}


def test_a_batch_looked_up_before_another_batchs_update_is_updated_from_the_rows_as_they_are_then():
    """A second lookup before the first batch's backward (a pipeline's next batch, gradient accumulation): the two
    updates leave what fbgemm's two backwards leave (a version that read a batch's rows at its lookup, while they
    were in the cache, had to read them again here; it was measured and not kept)."""
    rows, feature_table_map = (50, 30, 7), [0, 1, 2]
    fbgemm, batched = _pair(rows=rows, feature_table_map=feature_table_map)
    install(torch.nn.ModuleList([batched]), "batched")
    first, second = _batch(rows, feature_table_map, seed=0, bag=1), _batch(rows, feature_table_map, seed=1, bag=1)
    for m in (fbgemm, batched):
        outs = [m(*first), m(*second)]  # both looked up, then both updated: they share rows (ids below 5)
        for k, out in enumerate(outs):
            out.backward(torch.full_like(out, 0.5 + k))
    after_fbgemm, after_batched = _state(fbgemm), _state(batched)
    torch.testing.assert_close(after_batched[0], after_fbgemm[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after_batched[1], after_fbgemm[1], rtol=1e-5, atol=1e-7)


def test_the_ids_grouped_by_row_are_a_stable_sort_and_a_bad_row_is_refused():
    """`group_rows` (a hash of the rows seen) against torch's stable sort, its rows in the order first seen: each row
    with all its ids in their order, at sizes from one row to kaggle's 26M and 2^32 rows, every row repeated and
    none; given a source, each grouped id's source row in its place. A row outside the table is one error."""
    assert native.load() is None, native.load()
    g = torch.Generator().manual_seed(0)
    for num_rows, n in ((1, 5), (7, 300), (3000, 5000), (26_000_000, 53_248), (2**32, 1000)):
        rows = torch.randint(0, num_rows, (n,), generator=g)
        for kind in (torch.long, torch.int) if num_rows < 2**31 else (torch.long,):
            unique, starts, order = torch.ops.dlrm_lab.group_rows(rows.to(kind), None, num_rows)
            first = {}
            for k, row in enumerate(rows.tolist()):
                first.setdefault(row, []).append(k)
            assert unique.tolist() == list(first) and starts[-1] == n
            groups = [order[a:b].tolist() for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)]
            assert groups == list(first.values())
            source = torch.randint(0, 10**6, (n,), generator=g)
            _, _, sources = torch.ops.dlrm_lab.group_rows(rows.to(kind), None, num_rows, source)
            assert torch.equal(sources, source.index_select(0, order))
    # each segment's ids offset by its base (a feature's ids by its table's first row)
    ids, bases = torch.tensor([4, 0, 4, 1, 0, 2], dtype=torch.int32), torch.tensor([0, 3, 5])
    unique, starts, order = torch.ops.dlrm_lab.group_rows(ids, bases, 9)
    assert (
        unique.tolist() == [4, 0, 7, 5] and starts.tolist() == [0, 2, 3, 5, 6] and order.tolist() == [0, 3, 1, 2, 5, 4]
    )
    empty = torch.ops.dlrm_lab.group_rows(torch.empty(0, dtype=torch.long), None, 10)
    assert [t.tolist() for t in empty] == [[], [0], []]
    with pytest.raises(RuntimeError, match="row 10 outside the table's 10"):
        torch.ops.dlrm_lab.group_rows(torch.tensor([3, 10]), None, 10)
    with pytest.raises(RuntimeError, match="row 10 outside the table's 10"):
        torch.ops.dlrm_lab.group_rows(torch.tensor([3, 4]), torch.tensor([0, 6]), 10)
    with pytest.raises(RuntimeError, match="5 ids in 2 equal segments"):
        torch.ops.dlrm_lab.group_rows(torch.arange(5), torch.tensor([0, 6]), 10)
    with pytest.raises(RuntimeError, match="must each fit 32 bits"):
        torch.ops.dlrm_lab.group_rows(torch.tensor([3]), None, 2**32 + 1)
    with pytest.raises(RuntimeError, match="a source row for each of the 2 ids"):
        torch.ops.dlrm_lab.group_rows(torch.tensor([3, 4]), None, 10, torch.arange(3))
    # the grouping and the pass in one call: the same rows as the two ops, and the same refusals
    table, state, grads = torch.randn(10, 4), torch.rand(10), torch.randn(3, 4)
    ids, source = torch.tensor([3, 7, 3, 1]), torch.tensor([0, 2, 1, 2])
    want_table, want_state = table.clone(), state.clone()
    unique, starts, sources = torch.ops.dlrm_lab.group_rows(ids, None, 10, source)
    torch.ops.dlrm_lab.rowwise_update(want_table, want_state, unique, starts, sources, grads, None, 0.1, 1e-8)
    torch.ops.dlrm_lab.group_and_update(table, state, ids, None, source, grads, 0.1, 1e-8)
    assert torch.equal(table, want_table) and torch.equal(state, want_state)
    with pytest.raises(RuntimeError, match="group_and_update: the table must be fp32 rows"):
        torch.ops.dlrm_lab.group_and_update(table.double(), state, ids, None, source, grads, 0.1, 1e-8)
    with pytest.raises(RuntimeError, match="row 10 outside the table's 10"):
        torch.ops.dlrm_lab.group_and_update(table, state, torch.tensor([10]), None, torch.tensor([0]), grads, 0.1, 0.0)
    with pytest.raises(RuntimeError, match="gradient row 3 of 3"):
        torch.ops.dlrm_lab.group_and_update(table, state, ids, None, torch.tensor([0, 3, 1, 2]), grads, 0.1, 0.0)


def test_the_bags_update_refuses_ragged_bags_untouched_and_gradient_rows_that_do_not_fit():
    """`group_and_update_bags` updates only where every bag holds the same number of ids: ragged, empty or
    not-from-zero bags leave the table as it was and answer False; a gradient too short for the bags is one error."""
    assert native.load() is None, native.load()
    table, state = torch.zeros(10, 4), torch.zeros(10)
    bases, grad = torch.tensor([0, 5]), torch.ones(4, 4)  # 2 features, 2 samples
    op = torch.ops.dlrm_lab.group_and_update_bags
    for offsets in ([0, 1, 3, 4, 5], [0, 0, 0, 0, 0], [1, 2, 3, 4, 5]):
        ids = torch.zeros(offsets[-1], dtype=torch.int32)
        assert op(table, state, ids, bases, torch.tensor(offsets), 2, grad, 0.1, 1e-8, False) is False
        assert not table.any() and not state.any()
    assert op(table, state, torch.tensor([1, 2, 0, 4]), bases, torch.tensor([0, 1, 2, 3, 4]), 2, grad, 0.1, 1e-8, True)
    assert sorted(torch.nonzero(state).view(-1).tolist()) == [1, 2, 5, 9]  # each id plus its feature's first row
    with pytest.raises(RuntimeError, match="2 samples of 2 features, 3 gradient rows apart, do not fit the 4"):
        op(table, state, torch.tensor([1, 2, 0, 4]), bases, torch.tensor([0, 1, 2, 3, 4]), 3, grad, 0.1, 1e-8, False)
    with pytest.raises(RuntimeError, match="5 bags for 2 features"):
        op(table, state, torch.arange(5), bases, torch.arange(6), 2, grad, 0.1, 1e-8, False)
    with pytest.raises(RuntimeError, match="row 12 outside the table's 10"):
        op(table, state, torch.tensor([1, 2, 0, 7]), bases, torch.tensor([0, 1, 2, 3, 4]), 2, grad, 0.1, 1e-8, False)
