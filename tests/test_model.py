"""The model: shapes, TorchRec equivalence for dot and dcnv2, cat with mixed dims, meta tables."""

import pytest
import torch
from conftest import make_batch
from torchrec.models.dlrm import DLRM as TorchRecDLRM
from torchrec.models.dlrm import DLRM_DCN as TorchRecDLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedTensor

import dlrm_lab

PRESETS = ["tiny", "kaggle", "terabyte", "dcnv2", "rm1", "rm2", "rm3"]


def _shaped_batch(spec, n: int, seed: int):
    """`n` samples of the spec's shape drawn by torch: its dense features, each feature's ids (its table's
    pooling factor rounded, at least 1) within the table. Not the synthetic generator's: calibrating its
    teacher (rm3's: 40,960 samples of 2,560 dense features) costs seconds, and every preset trains on its
    generator's samples in tests/test_train.py."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in spec.tables:
        for feature in t.feature_names:
            ids = max(1, round(t.pooling_factor))
            keys.append(feature)
            lengths.append(torch.full((n,), ids, dtype=torch.int32))
            values.append(torch.randint(0, t.num_embeddings, (n * ids,), generator=gen))
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return torch.randn(n, spec.num_dense, generator=gen), sparse


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_scaled_and_gives_one_logit_per_sample(name):
    spec = dlrm_lab.load_preset(name, max_rows=100)
    model = dlrm_lab.build_model(spec)
    logits = model(*_shaped_batch(spec, 5, seed=1))
    assert logits.shape == (5,)
    assert torch.isfinite(logits).all()


def torchrec_reference(spec):
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names),
            )
            for t in spec.tables
        ]
    )
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=list(spec.bottom_mlp),
        over_arch_layer_sizes=list(spec.top_mlp),
    )
    if spec.interaction == "dcnv2":
        return TorchRecDLRM_DCN(**common, dcn_num_layers=spec.dcn_num_layers, dcn_low_rank_dim=spec.dcn_low_rank)
    return TorchRecDLRM(**common)


@pytest.mark.parametrize("name", ["tiny", "kaggle", "dcnv2"])
def test_state_dicts_load_both_ways_and_outputs_equal_torchrec(name):
    spec = dlrm_lab.load_preset(name, max_rows=200)
    ours = dlrm_lab.build_model(spec)
    ref = torchrec_reference(spec)
    assert list(ours.state_dict()) == list(ref.state_dict())
    batch = make_batch(spec, 16, seed=3)

    torch.manual_seed(7)
    ref_weights = {k: torch.randn_like(v) * 0.1 for k, v in ref.state_dict().items()}
    ref.load_state_dict(ref_weights)
    ours.load_state_dict(ref.state_dict())  # TorchRec checkpoint -> dlrm-lab
    with torch.no_grad():
        torch.testing.assert_close(
            ours(batch.dense_features, batch.sparse_features),
            ref(batch.dense_features, batch.sparse_features).squeeze(-1),
        )

    torch.manual_seed(8)
    ours.load_state_dict({k: torch.randn_like(v) * 0.1 for k, v in ours.state_dict().items()})
    ref.load_state_dict(ours.state_dict())  # dlrm-lab checkpoint -> TorchRec
    with torch.no_grad():
        torch.testing.assert_close(
            ref(batch.dense_features, batch.sparse_features).squeeze(-1),
            ours(batch.dense_features, batch.sparse_features),
        )


def test_cat_interaction_concatenates_bottom_output_and_pooled_embeddings():
    spec = dlrm_lab.load_preset("tiny", interaction="cat", embedding_dim=[8, 4, 8, 12])
    model = dlrm_lab.build_model(spec)
    assert spec.over_arch_in_features == 8 + (8 + 4 + 8 + 12)
    batch = make_batch(spec, 6, seed=0)
    with torch.no_grad():
        dense_out = model.dense_arch(batch.dense_features)
        pooled = model.sparse_arch.embedding_bag_collection(batch.sparse_features).to_dict()
        expected_in = torch.cat([dense_out] + [pooled[f] for f in spec.feature_names], dim=1)
        expected = model.over_arch(expected_in).squeeze(-1)
        torch.testing.assert_close(model(batch.dense_features, batch.sparse_features), expected)


def test_pooling_sums_the_rows_of_a_multi_hot_feature():
    spec = dlrm_lab.load_preset("tiny")  # cat_3 looks up 3 ids per sample
    model = dlrm_lab.build_model(spec)
    batch = make_batch(spec, 2, seed=0)
    ids = batch.sparse_features["cat_3"].values().view(2, 3)
    table = model.sparse_arch.embedding_bag_collection.embedding_bags["t_cat_3"].weight
    pooled = model.sparse_arch.embedding_bag_collection(batch.sparse_features).to_dict()["cat_3"]
    torch.testing.assert_close(pooled, table[ids].sum(dim=1))


def test_tables_can_stay_unallocated_on_meta():
    spec = dlrm_lab.load_preset("terabyte")  # 89 GiB if materialised
    model = dlrm_lab.build_model(spec, table_device="meta")
    tables = list(model.sparse_arch.embedding_bag_collection.parameters())
    assert tables and all(t.is_meta for t in tables)
    assert not any(p.is_meta for p in model.dense_arch.parameters())


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("fp16", torch.float16)])
def test_built_and_trained_tables_have_the_requested_precision(precision, dtype):
    from dlrm_lab.config import TrainConfig
    from dlrm_lab.model import build_model
    from dlrm_lab.train import preflight, train

    spec = dlrm_lab.load_preset("tiny")
    built = build_model(spec, table_precision=precision)
    assert {p.dtype for p in built.sparse_arch.embedding_bag_collection.parameters()} == {dtype}
    trained = train(
        preflight(spec, TrainConfig(steps=2, batch_size=32, table_precision=precision)), keep_model=True
    ).model
    tables = {k: v for k, v in trained.state_dict().items() if "embedding_bags" in k}
    assert tables and {v.local_shards()[0].tensor.dtype if hasattr(v, "local_shards") else v.dtype
                       for v in tables.values()} == {dtype}  # fmt: skip


def test_unknown_table_precision_is_an_error_naming_it():
    from dlrm_lab.model import build_model

    with pytest.raises(ValueError, match="table_precision 'int3': allowed: fp32, fp16"):
        build_model(dlrm_lab.load_preset("tiny"), table_precision="int3")


def spec_like(**changes):
    """The tiny preset's fields as a plain object: a spec that skipped `ModelSpec`'s checks."""
    import dataclasses
    import types

    spec = dlrm_lab.load_preset("tiny")
    return types.SimpleNamespace(**{**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}, **changes})


def table(name, dim):
    return dlrm_lab.TableSpec(name, num_embeddings=10, embedding_dim=dim, feature_names=(name,))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"bottom_mlp": (16, 4)},
            "interaction 'dot' needs the bottom MLP's output dim (4) equal to the embedding dim (8)",
        ),
        (
            {"tables": (table("a", 8), table("b", 4)), "interaction": "dcnv2", "dcn_num_layers": 1, "dcn_low_rank": 2},
            "interaction 'dcnv2' needs one embedding dim for all tables, got a: 8, b: 4",
        ),
        ({"interaction": "dcnv2"}, "interaction 'dcnv2' needs dcn_num_layers (0) and dcn_low_rank (0) >= 1"),
        ({"interaction": "fm"}, "interaction 'fm': allowed: dot, cat, dcnv2"),
        ({"top_mlp": (16, 2)}, "top_mlp [16, 2] ends at 2 outputs, but the model gives one logit per sample (1)"),
        ({"tables": ()}, "at least one embedding table is required"),
    ],
)
def test_dlrm_refuses_inconsistent_sizes_naming_them(changes, message):
    with pytest.raises(ValueError) as err:
        dlrm_lab.build_model(spec_like(**changes))
    assert message in str(err.value)


def test_dlrm_builds_from_a_consistent_spec_like_object():
    model = dlrm_lab.build_model(spec_like(interaction="cat", bottom_mlp=(16, 5)))
    assert next(model.over_arch.parameters()).shape[1] == 5 + 4 * 8  # dense output beside 4 pooled dims of 8
    batch = make_batch(dlrm_lab.load_preset("tiny"), 3, seed=0)
    assert model(batch.dense_features, batch.sparse_features).shape == (3,)


def test_archs_refuse_arguments_naming_them():
    from dlrm_lab.model.dlrm import PooledSparseArch
    from dlrm_lab.model.interaction import DotInteractionArch

    with pytest.raises(ValueError, match=r"num_sparse_features = -1: must be an integer >= 1"):
        DotInteractionArch(num_sparse_features=-1)
    mixed = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t_a", num_embeddings=4, embedding_dim=8, feature_names=["a"]),
            EmbeddingBagConfig(name="t_b", num_embeddings=4, embedding_dim=4, feature_names=["b"]),
        ]
    )
    with pytest.raises(ValueError, match="needs one embedding_dim for all tables, got t_a: 8, t_b: 4"):
        PooledSparseArch(mixed)
    assert PooledSparseArch(mixed, flat=True).out_features == 12
    with pytest.raises(ValueError, match="any_order is for the dot interaction"):
        PooledSparseArch(mixed, flat=True, any_order=True)


def test_dot_interaction_over_embeddings_in_any_order_matches_feature_order():
    """A sharded collection returns its ranks' tables in turn: the dot interaction picks the same
    pairs from them, values and gradients, without regrouping them into feature order."""
    from dlrm_lab.model.dlrm import pooled_with_triangle
    from dlrm_lab.model.interaction import DotInteractionArch

    names = [f"f{k}" for k in range(5)]
    order = ["f3", "f0", "f4", "f1", "f2"]
    B, D = 6, 4
    torch.manual_seed(0)
    dense = torch.randn(B, D)
    by_name = {name: torch.randn(B, D) for name in names}
    inter = DotInteractionArch(num_sparse_features=len(names))

    def run(keys):
        d = dense.clone().requires_grad_()
        emb = {k: by_name[k].clone().requires_grad_() for k in keys}
        kt = KeyedTensor(keys=keys, length_per_key=[D] * len(keys), values=torch.cat([emb[k] for k in keys], 1))
        values, triangle = pooled_with_triangle(kt, names)
        out = inter(d, values.view(B, len(keys), D), triangle)
        (out * torch.arange(out.shape[1])).sum().backward()
        return out, d.grad, {k: emb[k].grad for k in keys}

    want, want_dense_grad, want_grads = run(names)
    got, got_dense_grad, got_grads = run(order)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_dense_grad, want_dense_grad, rtol=1e-6, atol=1e-6)
    for name in names:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(want, inter(dense, torch.stack([by_name[n] for n in names], 1)), rtol=0, atol=0)


@pytest.mark.parametrize("autocast,gram_dtype", [(False, None), (True, None), (True, torch.float32)])
def test_the_dot_interactions_own_forward_and_backward_equal_autograds_through_the_plain_ops(autocast, gram_dtype):
    """The interaction trained with its own forward and backward (`_DotInteraction`: one buffer, the pairs gathered
    into the output, one GEMM of both triangles' gradient) against autograd through the plain ops, for the default
    triangle and a sharded collection's order, in fp32, under bf16 autocast and with the Gram matrix told fp32;
    untracked calls (no grad, as a served model runs) take the plain ops."""
    from dlrm_lab.model.dlrm import _triangle_index
    from dlrm_lab.model.interaction import _plain_interaction, dot_interaction

    torch.manual_seed(0)
    n, D = 6, 16
    dense, sparse = torch.randn(32, D), torch.randn(32, n - 1, D)
    rows, cols = torch.triu_indices(n, n, offset=1)
    weights = torch.randn(D + n * (n - 1) // 2)
    names = tuple(f"f{k}" for k in range(n - 1))
    for pairs in (rows * n + cols, _triangle_index(tuple(reversed(names)), names, torch.device("cpu"))):
        got = [dense.clone().requires_grad_(), sparse.clone().requires_grad_()]
        want = [dense.clone().requires_grad_(), sparse.clone().requires_grad_()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = dot_interaction(*got, pairs, gram_dtype)
            if gram_dtype is None:
                plain = _plain_interaction(*want, pairs)
            else:
                with torch.autocast("cpu", enabled=False):
                    plain = _plain_interaction(want[0].to(gram_dtype), want[1].to(gram_dtype), pairs)
        assert type(out.grad_fn).__name__ == "_DotInteractionBackward" and out.dtype == plain.dtype
        torch.testing.assert_close(out, plain, rtol=0, atol=0)  # the same GEMM forward
        (out.float() * weights).sum().backward()
        (plain.float() * weights).sum().backward()
        # bf16: autograd adds two bf16 GEMMs' outputs in bf16, the one GEMM accumulates in fp32
        tolerance = {"rtol": 2e-2, "atol": 2e-2} if autocast and gram_dtype is None else {"rtol": 1e-5, "atol": 1e-5}
        for g, w in zip(got, want, strict=True):
            assert g.grad.dtype == w.grad.dtype == torch.float32
            torch.testing.assert_close(g.grad, w.grad, **tolerance)
    with torch.no_grad():
        assert dot_interaction(*got, pairs, gram_dtype).grad_fn is None


def test_docstring_examples_run():
    import doctest

    import dlrm_lab.model.dlrm as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted >= 25  # the examples of PooledSparseArch, the interactions, DLRM and build_model


def test_a_dot_interaction_told_fp32_computes_its_gram_matrix_out_of_autocast():
    from dlrm_lab.model.interaction import DotInteractionArch

    torch.manual_seed(0)
    inter = DotInteractionArch(num_sparse_features=5)
    dense = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)  # a bottom MLP's output under autocast
    sparse = torch.randn(8, 5, 16, requires_grad=True)
    want = inter(dense.float(), sparse)  # fp32 all through
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = inter(dense, sparse)
        inter.gram_dtype = torch.float32
        kept = inter(dense, sparse)
    assert cast.dtype == torch.bfloat16 and kept.dtype == torch.float32
    torch.testing.assert_close(kept, want)
    kept.sum().backward()
    assert dense.grad.dtype == torch.bfloat16 and sparse.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_labs_interaction_kernel_equals_the_plain_ops_forward_and_backward(dtype):
    """`model.native`'s kernel against autograd through the plain ops in float64: whole and partial blocks of
    samples (a vector's lanes each), the default triangle, a sharded collection's order and the triangle with its
    diagonal (a feature's gradient gathered from every pair it is in, twice from itself), and the interaction's
    own module run with `native` set; its sums are fp32 whatever the dtype (bf16: one rounding of the output)."""
    from dlrm_lab.model import native
    from dlrm_lab.model.dlrm import _triangle_index
    from dlrm_lab.model.interaction import DotInteractionArch, _plain_interaction

    assert native.load() is None, native.load()  # CI builds it: a test, not an option
    torch.manual_seed(0)
    n, D = 7, 16
    rows, cols = torch.triu_indices(n, n, offset=1)
    names = tuple(f"f{k}" for k in range(n - 1))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-1}
    for batch in (1, 16, 37):
        dense, sparse = torch.randn(batch, D).to(dtype), torch.randn(batch, n - 1, D).to(dtype)
        with_self = torch.triu_indices(n, n)  # each feature's product with itself too: two terms of its gradient
        orders = (rows * n + cols, _triangle_index(tuple(reversed(names)), names, torch.device("cpu")))
        for pairs in (*orders, with_self[0] * n + with_self[1]):
            want = [dense.double().requires_grad_(), sparse.double().requires_grad_()]
            got = [dense.clone().requires_grad_(), sparse.clone().requires_grad_()]
            plain = _plain_interaction(*want, pairs)
            out = torch.ops.dlrm_lab.dot_interaction(*got, pairs)
            assert out.dtype == dtype and out.shape == plain.shape
            torch.testing.assert_close(out.double(), plain.detach(), **tolerance)
            weights = torch.randn(plain.shape[1], dtype=torch.float64)
            (plain * weights).sum().backward()
            (out.double() * weights).sum().backward()
            for g, w in zip(got, want, strict=True):
                assert g.grad.dtype == dtype
                torch.testing.assert_close(g.grad.double(), w.grad, **tolerance)
        # rows that start off a 32-bit word: bf16's paired-coordinate products read words, so these take the
        # kernel's other path (on CPUs without AVX512_BF16 every bf16 call does)
        shifted = torch.empty(batch * (n - 1) * D + 1, dtype=dtype)[1:].view(batch, n - 1, D)
        shifted.copy_(sparse)
        torch.testing.assert_close(
            torch.ops.dlrm_lab.dot_interaction(dense, shifted, rows * n + cols).double(),
            _plain_interaction(dense.double(), sparse.double(), rows * n + cols),
            **tolerance,
        )
    # widths whose features the bf16 forward holds in registers (8 and 32 beside 16) and one it does not (12), over
    # the triangle, a sharded order (runs of one first feature) and the diagonal, forward and backward; on AMX the
    # triangle of up to 32 features is a sample's tile products (one tile of rows, or two: 17, 27 and 32 features)
    for features, width in ((7, 8), (7, 12), (7, 32), (17, 16), (27, 16), (27, 8), (32, 32), (27, 34)):
        rows, cols = torch.triu_indices(features, features, offset=1)
        names = tuple(f"f{k}" for k in range(features - 1))
        diagonal = torch.triu_indices(features, features)
        orders = (
            rows * features + cols,
            _triangle_index(tuple(reversed(names)), names, torch.device("cpu")),
            diagonal[0] * features + diagonal[1],
        )
        dense, sparse = torch.randn(37, width).to(dtype), torch.randn(37, features - 1, width).to(dtype)
        for pairs in orders:
            want = [dense.double().requires_grad_(), sparse.double().requires_grad_()]
            got = [dense.clone().requires_grad_(), sparse.clone().requires_grad_()]
            plain = _plain_interaction(*want, pairs)
            out = torch.ops.dlrm_lab.dot_interaction(*got, pairs)
            torch.testing.assert_close(out.double(), plain.detach(), **tolerance)
            weights = torch.randn(plain.shape[1], dtype=torch.float64)
            (plain * weights).sum().backward()
            (out.double() * weights).sum().backward()
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g.grad.double(), w.grad, **tolerance)
    rows, cols = torch.triu_indices(n, n, offset=1)
    # a width not a whole number of the backward's register tiles (8): its last coordinates on their own
    dense, sparse = torch.randn(37, 12).to(dtype), torch.randn(37, n - 1, 12).to(dtype)
    want = [dense.double().requires_grad_(), sparse.double().requires_grad_()]
    got = [dense.clone().requires_grad_(), sparse.clone().requires_grad_()]
    _plain_interaction(*want, rows * n + cols).sum().backward()
    torch.ops.dlrm_lab.dot_interaction(*got, rows * n + cols).double().sum().backward()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.grad.double(), w.grad, **tolerance)
    arch = DotInteractionArch(num_sparse_features=n - 1)
    arch.native = True
    dense, sparse = torch.randn(5, D, dtype=torch.bfloat16), torch.randn(5, n - 1, D)  # autocast's mixed inputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = arch(dense, sparse)
    assert out.dtype == torch.bfloat16 and out.grad_fn is None
    torch.testing.assert_close(
        out.float(), _plain_interaction(dense.float(), sparse, arch.triu_flat_indices), **{"rtol": 2e-2, "atol": 1e-1}
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_labs_interaction_kernel_reads_fp32_embeddings_beside_a_narrower_dense_part_with_no_cast(dtype):
    """fp32 pooled embeddings beside a bf16 (autocast's) or fp16 dense output: the kernel rounds them as it reads
    them, so its output equals the cast inputs' bit for bit, and writes their gradient in fp32 (the cast inputs'
    gradient is the same before its rounding); the module makes no cast op of them either way."""
    from dlrm_lab.model import native
    from dlrm_lab.model.interaction import DotInteractionArch

    assert native.load() is None
    torch.manual_seed(0)
    for batch, n, D in ((37, 7, 16), (5, 7, 12), (2048, 27, 16)):
        rows, cols = torch.triu_indices(n, n, offset=1)
        pairs = rows * n + cols
        dense, sparse = torch.randn(batch, D).to(dtype), torch.randn(batch, n - 1, D)
        mixed = [dense.clone().requires_grad_(), sparse.clone().requires_grad_()]
        cast = [dense.clone().requires_grad_(), sparse.to(dtype).requires_grad_()]
        out = torch.ops.dlrm_lab.dot_interaction(*mixed, pairs)
        want = torch.ops.dlrm_lab.dot_interaction(*cast, pairs)
        assert out.dtype == dtype and torch.equal(out, want)
        weights = torch.randn(out.shape)
        (out.float() * weights).sum().backward()
        (want.float() * weights).sum().backward()
        assert mixed[1].grad.dtype == torch.float32 and torch.equal(mixed[0].grad, cast[0].grad)
        assert torch.equal(mixed[1].grad.to(dtype), cast[1].grad)
    arch = DotInteractionArch(num_sparse_features=6)
    arch.native = True
    dense, sparse = torch.randn(5, 16, requires_grad=True), torch.randn(5, 6, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = arch(dense, sparse)
    inputs = [f for f, _ in out.grad_fn.next_functions]
    assert type(inputs[1]).__name__ == "AccumulateGrad" and inputs[1].variable is sparse  # no ToCopyBackward0
    with pytest.raises(RuntimeError, match="only fp32 sparse beside bf16 or fp16 dense"):
        torch.ops.dlrm_lab.dot_interaction(torch.randn(2, 4).bfloat16(), torch.randn(2, 2, 4).half(), pairs[:1])


def test_the_labs_interaction_kernel_refuses_pairs_outside_the_gram_matrix():
    from dlrm_lab.model import native

    assert native.load() is None
    with pytest.raises(RuntimeError, match="outside the 3 x 3 Gram matrix"):
        torch.ops.dlrm_lab.dot_interaction(torch.randn(2, 4), torch.randn(2, 2, 4), torch.tensor([1, 9]))
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.dlrm_lab.dot_interaction(torch.randn(2, 4), torch.randn(3, 2, 4), torch.tensor([1]))


def test_a_lock_left_by_a_killed_kernel_build_is_cleared_and_a_live_ones_kept(tmp_path):
    """torch's builder waits on its lock file while it exists: one left by a killed build would stop every later
    load; one younger than any build is a build under way and stays."""
    import os
    import time
    import types

    from dlrm_lab.model import native

    builder = types.SimpleNamespace(_get_build_directory=lambda name, verbose: str(tmp_path))
    lock = tmp_path / "lock"
    lock.touch()
    native._clear_stale_lock(builder)
    assert lock.exists()  # a build under way
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    native._clear_stale_lock(builder)
    assert not lock.exists()
    native._clear_stale_lock(builder)  # no lock: nothing to do


def test_the_kernels_build_is_named_for_its_checkout_and_sources(tmp_path, monkeypatch):
    """torch caches an extension's build by its name alone and rebuilds it (~20 s) for another compile command: the
    lab's name holds the sources' paths and bytes, so two checkouts on one machine (ab.py's sides, a worktree) keep a
    build each instead of rebuilding one in turn, and changed sources never load an older build."""
    from dlrm_lab.model import native

    here = native._name()
    assert here == native.NAME and here.startswith("dlrm_lab_native_")
    copies = []
    for source in native._SOURCES:
        (tmp_path / source.name).write_bytes(source.read_bytes())
        copies.append(tmp_path / source.name)
    monkeypatch.setattr(native, "_SOURCES", copies)
    elsewhere = native._name()
    assert elsewhere != here  # the same sources in another checkout: a build of its own
    assert native._name() == elsewhere  # and the same one each time
    copies[0].write_bytes(copies[0].read_bytes() + b"\n// changed\n")
    assert native._name() not in (here, elsewhere)  # changed sources: another build
    changed = native._name()
    header = tmp_path / native._HEADERS[0].name
    header.write_bytes(native._HEADERS[0].read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(native, "_HEADERS", [header])
    assert native._name() != changed  # a header the sources include is in the name too
    copies[1].unlink()
    assert native._name().startswith("dlrm_lab_native_")  # a source missing: named still; `load` says why


@pytest.mark.parametrize("preset", ["tiny", "dcnv2", "rm1", "hstu-tiny"])
def test_every_parameter_and_buffer_is_built_on_the_requested_device(preset):
    """The CPU twin of a GPU build: a module made without a device argument (the dot interaction's pairs, a
    buffer) stayed on the CPU while the rest went to the GPU, and its first call on CUDA failed."""
    from dlrm_lab.config import load_any_preset

    spec = load_any_preset(preset)
    model = dlrm_lab.build_model(spec, device="meta")
    placed = {name: t.device.type for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert placed and {k: v for k, v in placed.items() if v != "meta"} == {}


def test_the_mlps_relu_runs_in_place_with_the_same_scores_gradients_and_state_dict():
    """`model.dlrm._relu_in_place`: TorchRec's Perceptrons apply `torch.relu_` to their own fresh output; scores,
    every gradient and the state dict's keys equal those of the same weights with TorchRec's `torch.relu`."""
    from torchrec.modules.mlp import Perceptron
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from dlrm_lab.model.dlrm import DLRM

    spec = dlrm_lab.load_preset("tiny")
    torch.manual_seed(0)
    model = DLRM(spec)
    layers = [m for m in model.modules() if isinstance(m, Perceptron)]
    assert layers and all(m._activation_fn is torch.relu_ for m in layers)
    plain = DLRM(spec)
    plain.load_state_dict(model.state_dict())
    for m in plain.modules():
        if isinstance(m, Perceptron):
            m._activation_fn = torch.relu
    assert list(plain.state_dict()) == list(model.state_dict())
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=spec.feature_names, values=torch.arange(4 * 6) % 5, lengths=torch.ones(4 * 6, dtype=torch.int64)
    )
    dense = torch.randn(6, spec.num_dense)
    for m in (model, plain):
        m(dense, kjt).sum().backward()
    torch.testing.assert_close(model(dense, kjt), plain(dense, kjt), rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_interaction_kernel_writes_a_padded_output_equal_to_its_own_and_zero_beyond(dtype):
    """Serving's padded form (`dot_interaction_padded`, a next GEMM at a wider K): the same outputs as the plain op,
    then zero columns up to the width; the module's `out_width` takes it, torch's ways pad to match; a width under
    the outputs is refused."""
    from dlrm_lab.model import native
    from dlrm_lab.model.interaction import DotInteractionArch

    assert native.load() is None
    torch.manual_seed(0)
    for batch in (1, 17, 256):  # a block of 16 lanes, part of one, several
        dense, sparse = torch.randn(batch, 16).to(dtype), torch.randn(batch, 26, 16)
        arch = DotInteractionArch(num_sparse_features=26)
        arch.use("native")
        with torch.no_grad():
            plain = arch(dense, sparse)
            arch.out_width = 384
            wide = arch(dense, sparse)
            assert plain.shape == (batch, 367) and wide.shape == (batch, 384) and wide.dtype == plain.dtype
            assert torch.equal(wide[:, :367], plain) and not wide[:, 367:].any()
            arch.use("fp32")  # torch's ops: the same width, padded after them
            assert arch(dense.float(), sparse).shape == (batch, 384)
    pairs = DotInteractionArch(num_sparse_features=26).triu_flat_indices
    with pytest.raises(RuntimeError, match="a width of 300 is narrower than the 367 outputs"):
        torch.ops.dlrm_lab.dot_interaction_padded(dense, sparse.to(dtype), pairs, 300)
